#!/usr/bin/env python
"""Hybrid engine vs a naive switch: training layout -> generation layout on 8 CPU devices.

The model is a ~160M-parameter Llama-style decoder (fp32) trained FSDP over all 8 devices
and generating with tensor parallelism of width t_g. Side by side, alternating:
  hflax:  HybridEngine.to_generate: on CPU devices (which share host memory) each distinct
          generate shard is written once from the training shards in place, and its
          replicas over the data axis share that buffer; on accelerators, device-to-device
          copies of the missing pieces only;
  naive:  gather the full parameters to the host, then put them in the generate layout.
Prints median times, their ratio, and peak parameter bytes per device (and on the host).

  python bench/reshard.py [--tensor 2] [--repeats 5]
"""
import argparse
import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from hflax.models import ModelConfig, create_abstract  # noqa: E402
from hflax.sharding.hybrid_engine import HybridEngine, shard_bytes  # noqa: E402
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
    return jax.device_put(jax.device_get(params), engine.shardings)

  for fn in (hflax_switch, naive_switch):  # warm up
    jax.block_until_ready(fn())
  hx, nv = [], []
  for _ in range(args.repeats):
    hx += timed(hflax_switch, 1)
    nv += timed(naive_switch, 1)

  gen = hflax_switch()
  train_held, gen_held = shard_bytes(params), shard_bytes(gen)
  peak_device = max(train_held[d] + gen_held[d] for d in train_held)
  naive_gen = naive_switch()
  np.testing.assert_array_equal(np.asarray(jax.tree.leaves(gen)[0]),
                                np.asarray(jax.tree.leaves(naive_gen)[0]))
  written = {"hflax": _new_bytes(gen, params), "naive": _new_bytes(naive_gen, params) + model_bytes}
  hx_t, nv_t = statistics.median(hx), statistics.median(nv)
  mib = 2 ** 20
  print(f"devices: {jax.device_count()} x {jax.devices()[0].platform}; model "
        f"{CFG.num_params / 1e6:.0f}M params, {model_bytes / mib:.0f} MiB fp32; train: FSDP x8, "
        f"generate: tensor {args.tensor} x data {8 // args.tensor} (strided grouping)")
  print(f"{'switch':>8} | {'median s':>8} | {'reps':>28} | {'peak param MiB/device':>21} | host MiB")
  print(f"{'hflax':>8} | {hx_t:>8.3f} | {', '.join(f'{t:.3f}' for t in hx):>28} | "
        f"{peak_device / mib:>21.1f} | {0:>8}")
  print(f"{'naive':>8} | {nv_t:>8.3f} | {', '.join(f'{t:.3f}' for t in nv):>28} | "
        f"{peak_device / mib:>21.1f} | {model_bytes / mib:>8.0f}")
  print("bytes written per switch (new distinct buffers, and naive's host copy): "
        + ", ".join(f"{k} {v / mib:.0f} MiB" for k, v in written.items()))
  print(f"ratio hflax / naive time: {hx_t / nv_t:.2f}x (target <= 0.5x)")
  print(f"bytes moved per device (hflax, computed from the two shardings): "
        f"{engine.moved['max_per_device'] / mib:.1f} MiB = (tp - t_g)/(t_g tp) x sharded bytes; "
        f"train shard {max(train_held.values()) / mib:.1f} MiB + generate shard "
        f"{max(gen_held.values()) / mib:.1f} MiB per device, whole model {model_bytes / mib:.0f} MiB")


if __name__ == "__main__":
  main()
