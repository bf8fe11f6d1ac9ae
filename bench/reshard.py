#!/usr/bin/env python
"""Hybrid engine vs a naive switch: training layout -> generation layout on 8 CPU devices.

The model is a ~160M-parameter Llama-style decoder (fp32) trained FSDP over all 8 devices
and generating with tensor parallelism of width t_g. Side by side, alternating:
  hflax:  HybridEngine.to_generate: on CPU devices (which share host memory) each distinct
          generate shard is written once from the training shards in place, and its
          replicas over the data axis share that buffer; on accelerators, device-to-device
          copies of the missing pieces only;
  naive:  gather the full parameters into a fresh host copy, then write every generate
          replica from it into a buffer of its own, as a transfer to each device would.
Prints median times, their ratio, train + generate shard bytes per device, the host
memory each switch allocates beyond its result, and the bytes each writes.

  python bench/reshard.py [--tensor 2] [--repeats 5]
"""
import argparse
import os
import statistics
import sys
import time
import tracemalloc

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from hflax.models import ModelConfig, create_abstract  # noqa: E402
from hflax.sharding.hybrid_engine import HybridEngine, _aligned_empty, shard_bytes  # noqa: E402
from hflax.sharding.layouts import TRAIN_RULES, state_shardings, train_mesh  # noqa: E402

CFG = ModelConfig(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_layers=8,
                  num_heads=16, num_kv_heads=8)


def sharded_random_params(abstract, shardings):
  """Random weights created directly in their shards (no device ever holds the model)."""
  leaves, treedef = jax.tree.flatten(abstract)
  keys = jax.random.split(jax.random.key(0), len(leaves))
  made = [jax.jit(lambda k, a=a: 0.02 * jax.random.normal(k, a.shape, a.dtype),
                  out_shardings=s)(key)
          for a, s, key in zip(leaves, jax.tree.leaves(shardings), keys)]
  return jax.tree.unflatten(treedef, made)


def _buffers(state) -> dict:
  """Bytes of each distinct buffer behind `state`'s shards (replicas may share one)."""
  return {shard.data.unsafe_buffer_pointer(): shard.data.nbytes
          for leaf in jax.tree.leaves(state) for shard in leaf.addressable_shards}


def _new_bytes(state, old_state) -> int:
  old = _buffers(old_state)
  return sum(n for ptr, n in _buffers(state).items() if ptr not in old)


def gather(x):
  """`x` as a fresh host array. jax.device_get would hand back the numpy copy that its
  first call cached on `x`, so every switch after the warm-up would skip the gather."""
  out = np.empty(x.shape, x.dtype)
  for shard in x.addressable_shards:
    if shard.replica_id == 0:
      out[shard.index] = np.asarray(shard.data)
  return out


def put_each_replica(x, sharding):
  """Host array `x` laid out as `sharding`, every replica copied into its own buffer.

  XLA:CPU adopts a 64-byte-aligned host array instead of copying it (jax 0.10.2's
  device_put(..., may_alias=False) too), so a plain device_put lets replicas share the
  host copy or not depending on its alignment. Each replica is written into an aligned
  buffer here, which the device adopts: one copy per replica, as on an accelerator."""
  shards = []
  for device, index in sharding.addressable_devices_indices_map(x.shape).items():
    replica = _aligned_empty(x[index].shape, x.dtype)
    replica[...] = x[index]
    shards.append(jax.device_put(replica, device))
  return jax.make_array_from_single_device_arrays(x.shape, sharding, shards)


def host_staging(fn, old_state):
  """Runs one switch; returns its result and the peak host bytes numpy allocated during it
  beyond the new buffers the result keeps (tracemalloc traces numpy's allocations): the
  host copies made on the way."""
  tracemalloc.start()
  out = jax.block_until_ready(fn())
  peak = tracemalloc.get_traced_memory()[1]
  tracemalloc.stop()
  return out, peak - _new_bytes(out, old_state)


def assert_same(a, b):
  """Same sharding, and the same values in every shard of every leaf (replicas included)."""
  for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
    assert x.sharding.is_equivalent_to(y.sharding, x.ndim), (x.sharding, y.sharding)
    for sx, sy in zip(x.addressable_shards, y.addressable_shards, strict=True):
      assert (sx.device, sx.index) == (sy.device, sy.index)
      np.testing.assert_array_equal(np.asarray(sx.data), np.asarray(sy.data))


def timed(fn, repeats):
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - start)
  return times


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tensor", type=int, default=2, help="generation tensor width t_g")
  parser.add_argument("--repeats", type=int, default=5)
  args = parser.parse_args()

  mesh = train_mesh(jax.devices()[:8], fsdp=8)
  _, abstract = create_abstract(CFG)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract)
  train = state_shardings(abstract, mesh, TRAIN_RULES)
  params = sharded_random_params(abstract, train)
  engine = HybridEngine(mesh, abstract, train, args.tensor)
  model_bytes = sum(x.nbytes for x in jax.tree.leaves(params))

  def hflax_switch():
    return engine.to_generate(params)[0]

  def naive_switch():
    leaves, treedef = jax.tree.flatten(params)
    host = [gather(x) for x in leaves]
    return jax.tree.unflatten(treedef, [put_each_replica(x, s) for x, s in
                                        zip(host, jax.tree.leaves(engine.shardings), strict=True)])

  for fn in (hflax_switch, naive_switch):  # warm up
    jax.block_until_ready(fn())
  hx, nv = [], []
  for _ in range(args.repeats):
    hx += timed(hflax_switch, 1)
    nv += timed(naive_switch, 1)

  train_held = shard_bytes(params)
  results = {name: host_staging(fn, params) for name, fn in
             (("hflax", hflax_switch), ("naive", naive_switch))}
  gen, naive_gen = results["hflax"][0], results["naive"][0]
  assert_same(gen, naive_gen)
  shards = sum(len(x.addressable_shards) for x in jax.tree.leaves(naive_gen))
  assert len(_buffers(naive_gen)) == shards, "naive replicas share buffers"
  gen_held = shard_bytes(gen)
  hx_t, nv_t = statistics.median(hx), statistics.median(nv)
  mib = 2 ** 20
  print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}; model "
        f"{CFG.num_params / 1e6:.0f}M params, {model_bytes / mib:.0f} MiB fp32; train: FSDP x8, "
        f"generate: tensor {args.tensor} x data {8 // args.tensor} (strided grouping)")
  print(f"{'switch':>8} | {'median s':>8} | {'reps':>28} | "
        f"{'train + generate shard MiB/device':>33} | {'host MiB':>8} | {'MiB written':>11}")
  for name, t, reps in (("hflax", hx_t, hx), ("naive", nv_t, nv)):
    out, host = results[name]
    held = shard_bytes(out)
    per_device = max(train_held[d] + held[d] for d in train_held)
    print(f"{name:>8} | {t:>8.3f} | {', '.join(f'{r:.3f}' for r in reps):>28} | "
          f"{per_device / mib:>33.1f} | {host / mib:>8.0f} | "
          f"{(_new_bytes(out, params) + host) / mib:>11.0f}")
  print("host MiB: peak host memory numpy allocated during a switch beyond the buffers its "
        "result keeps; MiB written: the result's new distinct buffers + that host memory")
  print(f"ratio hflax / naive time: {hx_t / nv_t:.2f}x (target <= 0.5x)")
  print(f"bytes moved per device (hflax, computed from the two shardings): "
        f"{engine.moved['max_per_device'] / mib:.1f} MiB = (tp - t_g)/(t_g tp) x sharded bytes; "
        f"train shard {max(train_held.values()) / mib:.1f} MiB + generate shard "
        f"{max(gen_held.values()) / mib:.1f} MiB per device, whole model {model_bytes / mib:.0f} MiB")


if __name__ == "__main__":
  main()
