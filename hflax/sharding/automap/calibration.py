"""A DeviceProfile measured on the devices at hand, cached as JSON.

Every measurement runs on all devices at once (one shard each), so devices that share
hardware (simulated CPU devices share cores; GPUs share a node's NICs) report what each
gets when all are busy, which is how plans use them. Measured rates are achieved rates,
so the profile's efficiency factors are 1.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import platform
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hflax import platforms
from hflax.platforms import cores
from hflax.sharding.automap.profile import DeviceProfile

CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "hflax")


def machine_key(devices) -> str:
  """What a measured profile depends on besides the devices' kind and count: the host,
  the cores this process may use (simulated CPU devices share them) and the JAX/XLA
  version. A change in any of them measures again."""
  parts = (platform.node(), cores(), jax.__version__, getattr(jax.lib, "__version__", ""),
           devices[0].client.platform_version)
  return hashlib.sha256(repr(parts).encode()).hexdigest()[:10]


def default_cache_path(devices) -> str:
  d = devices[0]
  kind = str(getattr(d, "device_kind", d.platform)).replace(" ", "_").replace("/", "_")
  return os.path.join(CACHE_DIR, f"profile-{d.platform}-{kind}-{len(devices)}-"
                      f"{machine_key(devices)}.json")


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
  on_cpu = platforms.all_cpu(devices[:1])
  small = on_cpu if small is None else small
  # CPUs compute in float32 here (hflax's CPU default); accelerators in bfloat16.
  dtype = jnp.float32 if on_cpu else jnp.bfloat16
  mesh = Mesh(np.asarray(devices), ("d",))
  split = NamedSharding(mesh, P("d"))

  def ones(*shape, dtype=jnp.float32):  # built in place, one shard per device
    return jax.jit(lambda: jnp.ones(shape, dtype), out_shardings=split)()

  side = 512 if small else 8192
  a = ones(n, side, side, dtype=dtype)
  matmul = jax.jit(lambda x, y: jnp.einsum("dij,djk->dik", x, y), out_shardings=split)
  all_busy = _best_time(matmul, a, a)
  flops = 2 * side ** 3 / all_busy
  one = jax.device_put(np.ones((1, side, side), dtype), devices[0])
  matmul_one = jax.jit(lambda x, y: jnp.einsum("dij,djk->dik", x, y))
  # Devices with their own hardware each run as fast with all of them busy as alone;
  # simulated CPU devices share the cores, so n of them take about n / cores times longer.
  shared = n > 1 and all_busy > 1.5 * _best_time(matmul_one, one, one)

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
  call, per_device = _call_overhead(devices)
  concurrency = _host_concurrency(devices) if shared else None
  return DeviceProfile(
      name=f"calibrated-{platform}-{n}", peak_flops=flops, memory_bandwidth=hbm,
      intra_node_bandwidth=link, inter_node_bandwidth=link, devices_per_node=n,
      memory_bytes=_memory_per_device(devices), compute_efficiency=1.0,
      bandwidth_efficiency=1.0, collective_latency=latency, shared_compute=shared,
      host_concurrency=concurrency,
      call_overhead=call, call_overhead_per_device=per_device,
      source=(f"hflax calibrate() on {n} x {getattr(d, 'device_kind', platform)}, "
              f"{jnp.dtype(dtype).name} matmul, {time.strftime('%Y-%m-%d %H:%M:%S')}"))


def _call_overhead(devices) -> tuple[float, float]:
  """Fixed and per-device time of one small controller call on a pool: rows from the host
  laid over the pool, a jitted reduction with a collective, the result waited for."""

  def call_time(pool) -> float:
    mesh = Mesh(np.asarray(pool), ("d",))
    rows = np.ones((8 * len(pool), 64), np.float32)
    fn = jax.jit(lambda x: jnp.sum(x * 2.0, axis=0), out_shardings=NamedSharding(mesh, P()))
    place = lambda: fn(jax.device_put(rows, NamedSharding(mesh, P("d"))))  # noqa: E731
    return _best_time(place, repeats=20)

  alone = call_time(devices[:1])
  if len(devices) == 1:
    return alone, 0.0
  return alone, max(0.0, (call_time(devices) - alone) / (len(devices) - 1))


def _host_concurrency(devices) -> float:
  """How much sooner two devices finish a small program each when dispatched together
  than in turn. The program (a chain of 64-row, 128-wide matmuls) is sized like the small
  models CPU pools run: too small for XLA to spread one op over the cores, so two pools
  can use two cores at once; programs big enough to fill the cores get no such gain."""
  chain = jax.jit(lambda x, w: jax.lax.fori_loop(0, 50, lambda i, h: jnp.tanh(h @ w), x))
  args = [(jax.device_put(np.ones((64, 128), np.float32), d),
           jax.device_put(np.eye(128, dtype=np.float32), d)) for d in devices[:2]]
  in_turn = _best_time(lambda: [jax.block_until_ready(chain(*args[0])) for _ in range(2)],
                       repeats=5)
  at_once = _best_time(lambda: [chain(*a) for a in args], repeats=5)
  # Two programs finish at most twice as soon, and no sooner than the cores allow; a
  # larger ratio is the in-turn run's extra host round trip or timer noise, not overlap.
  return min(max(1.0, in_turn / at_once), 2.0, float(cores()))


def calibrate(devices=None, path: str | None = None, *, refresh: bool = False) -> DeviceProfile:
  """The profile of `devices` (default: all), read from the JSON cache at `path`
  (default ~/.cache/hflax/profile-<platform>-<kind>-<n>-<machine_key>.json) unless missing or
  `refresh`; otherwise measured and written there."""
  devices = list(jax.devices() if devices is None else devices)
  path = path or default_cache_path(devices)
  if not refresh and os.path.exists(path):
    with open(path) as f:
      cached = json.load(f)
    # A cache written before the profile gained fields is measured again.
    if {f.name for f in dataclasses.fields(DeviceProfile)} <= set(cached):
      return DeviceProfile.from_json(cached)
  profile = measure(devices)
  profile.save(path)
  return profile
