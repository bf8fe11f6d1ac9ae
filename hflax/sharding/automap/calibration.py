"""A DeviceProfile measured on the devices at hand, cached as JSON.

Every measurement runs on all devices at once (one shard each), so devices that share
hardware (simulated CPU devices share cores; GPUs share a node's NICs) report what each
gets when all are busy, which is how plans use them. Measured rates are achieved rates,
so the profile's efficiency factors are 1.
"""
from __future__ import annotations

import math
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hflax.sharding.automap.profile import DeviceProfile

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "hflax")


def default_cache_path(devices) -> str:
  d = devices[0]
  kind = str(getattr(d, "device_kind", d.platform)).replace(" ", "_").replace("/", "_")
  return os.path.join(CACHE_DIR, f"profile-{d.platform}-{kind}-{len(devices)}.json")


def _best_time(fn, *args, repeats: int = 3) -> float:
  jax.block_until_ready(fn(*args))  # compile and warm up
  best = math.inf
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def _memory_per_device(devices) -> float:
  stats = devices[0].memory_stats() if hasattr(devices[0], "memory_stats") else None
  if stats and stats.get("bytes_limit"):
    return float(stats["bytes_limit"])
  # Host platforms report no limit: the devices share the machine's RAM.
  return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / len(devices)


def measure(devices, *, small: bool | None = None) -> DeviceProfile:
  """Runs the measurements (a few seconds) and returns the profile, uncached."""
  n = len(devices)
  platform = devices[0].platform
  small = platform == "cpu" if small is None else small
  # CPUs compute in float32 here (hflax's CPU default); accelerators in bfloat16.
  dtype = jnp.float32 if platform == "cpu" else jnp.bfloat16
  mesh = Mesh(np.asarray(devices), ("d",))
  split = NamedSharding(mesh, P("d"))

  def ones(*shape, dtype=jnp.float32):  # built in place, one shard per device
    return jax.jit(lambda: jnp.ones(shape, dtype), out_shardings=split)()

  side = 512 if small else 8192
  a = ones(n, side, side, dtype=dtype)
  matmul = jax.jit(lambda x, y: jnp.einsum("dij,djk->dik", x, y), out_shardings=split)
  flops = 2 * side ** 3 / _best_time(matmul, a, a)

  words = (4 << 20) if small else (256 << 20)  # elements per device
  x = ones(n, words)
  axpy = jax.jit(lambda v: v * 1.0001 + 1.0, out_shardings=split)
  hbm = 2 * words * 4 / _best_time(axpy, x)  # one read, one write per element

  link, latency = hbm, 1e-6
  if n > 1:
    psum = jax.jit(jax.shard_map(lambda v: jax.lax.psum(v, "d"), mesh=mesh,
                                 in_specs=P("d"), out_specs=P("d")))
    chunk = words // 4
    big = ones(n, chunk)
    # A ring all-reduce moves 2 (n - 1) / n of the buffer through each device's link.
    link = 2 * (n - 1) / n * chunk * 4 / _best_time(psum, big)
    tiny = ones(n, 8)
    latency = _best_time(psum, tiny, repeats=5) / math.ceil(math.log2(n))

  d = devices[0]
  return DeviceProfile(
      name=f"calibrated-{platform}-{n}", peak_flops=flops, memory_bandwidth=hbm,
      intra_node_bandwidth=link, inter_node_bandwidth=link, devices_per_node=n,
      memory_bytes=_memory_per_device(devices), compute_efficiency=1.0,
      bandwidth_efficiency=1.0, collective_latency=latency,
      source=(f"hflax calibrate() on {n} x {getattr(d, 'device_kind', platform)}, "
              f"{jnp.dtype(dtype).name} matmul, {time.strftime('%Y-%m-%d %H:%M:%S')}"))


def calibrate(devices=None, path: str | None = None, *, refresh: bool = False) -> DeviceProfile:
  """The profile of `devices` (default: all), read from the JSON cache at `path`
  (default ~/.cache/hflax/profile-<platform>-<kind>-<n>.json) unless missing or
  `refresh`; otherwise measured and written there."""
  devices = list(jax.devices() if devices is None else devices)
  path = path or default_cache_path(devices)
  if not refresh and os.path.exists(path):
    return DeviceProfile.load(path)
  profile = measure(devices)
  profile.save(path)
  return profile
