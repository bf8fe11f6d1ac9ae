"""Process settings a CPU run needs before JAX starts (this module must not import jax):
simulated host devices, so per-model meshes exist on a plain CPU, and a malloc that keeps
freed memory. Settings the user already made (XLA_FLAGS, glibc's MALLOC_* variables) are
left as they are."""
from __future__ import annotations

import ctypes
import importlib.util
import os

from hflax.platforms.cpu import settings

_DEVICES_FLAG = "--xla_force_host_platform_device_count"
# glibc mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_MALLOC_VARIABLES = ("MALLOC_ARENA_MAX", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                     "GLIBC_TUNABLES")
_ACCELERATOR_PLUGINS = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin",
                        "jax_rocm7_plugin", "libtpu")


def cpu_devices() -> int:
  """HFLAX_CPU_DEVICES (default 2): simulated CPU devices; a bad value is one line."""
  return settings.devices()


def configure_cpu(devices: int | None = None) -> str:
  """Adds the simulated device count to XLA_FLAGS (unless set), keeps freed host memory
  for reuse where JAX will compute on the CPU (see keep_freed_memory) and returns
  XLA_FLAGS.

  devices: None takes HFLAX_CPU_DEVICES (default 2).
  """
  flags = os.environ.get("XLA_FLAGS", "").split()
  if not any(f.startswith(_DEVICES_FLAG) for f in flags):
    count = devices if devices is not None else cpu_devices()
    flags.append(f"{_DEVICES_FLAG}={count}")
  os.environ["XLA_FLAGS"] = " ".join(flags)
  if not accelerator_expected():
    keep_freed_memory()
  return os.environ["XLA_FLAGS"]


def prepare_cpu_process() -> None:
  """A CPU process whose device count JAX's config sets (jax_num_cpu_devices: a Ray pool
  member), before JAX starts: CPU only, the simulated-device flag inherited through the
  environment dropped, freed memory kept as configure_cpu keeps it."""
  os.environ["JAX_PLATFORMS"] = "cpu"
  flags = os.environ.get("XLA_FLAGS", "").split()
  os.environ["XLA_FLAGS"] = " ".join(f for f in flags if not f.startswith(_DEVICES_FLAG))
  keep_freed_memory()  # before XLA's threads start allocating


def keep_freed_memory() -> bool:
  """Tells glibc to serve every thread from its one main heap, to take buffers up to 2 GiB
  from it, and to keep freed memory there for reuse instead of returning it to the OS.

  XLA:CPU allocates each program's intermediates with malloc on its worker threads. By
  default those threads get their own arenas, whose big buffers are mapped fresh and
  unmapped on free, so every training step touches new pages: hundreds of thousands of
  minor page faults a step even for a small model, paid in kernel time, and more right
  after other work freed memory. With these settings a steady step takes none. The cost:
  the process keeps its peak heap size.

  HFLAX_CPU_MALLOC=0, any MALLOC_* / GLIBC_TUNABLES variable, or a libc other than glibc
  leaves malloc as it is. Returns whether the settings were made."""
  if settings.turned_off(settings.MALLOC) or any(v in os.environ for v in _MALLOC_VARIABLES):
    return False
  try:
    mallopt = ctypes.CDLL("libc.so.6").mallopt
  except (OSError, AttributeError):
    return False
  # Some glibc builds refuse an mmap threshold above 32 MiB; that still covers most buffers.
  threshold = any(mallopt(_M_MMAP_THRESHOLD, v) for v in ((1 << 31) - 1, 32 << 20))
  # mallopt takes an int. Not -1 (glibc reads it as a size_t: never trim): a top freed
  # past 2 GiB then stays mapped, which saved the page faults but made bench/rl_step.py's
  # generation slower on both sides.
  trim = bool(mallopt(_M_TRIM_THRESHOLD, (1 << 31) - 1))
  return bool(mallopt(_M_ARENA_MAX, 1)) and threshold and trim


# cpuinfo words for bfloat16 arithmetic: x86's AVX512-BF16 and AMX-BF16, Arm's BF16.
_BF16_WORDS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
  """Whether this CPU has bfloat16 arithmetic instructions, read from cpuinfo's first
  flags (x86) or Features (Arm) line; None where it cannot tell (no such file or line).

  Without them XLA:CPU converts every bfloat16 operand to float32 and back, so a bf16
  matmul runs slower than a float32 one there, not faster."""
  try:
    with open(cpuinfo) as f:
      for line in f:
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
          return not _BF16_WORDS.isdisjoint(value.split())
  except OSError:
    pass
  return None


def accelerator_expected() -> bool:
  """Whether JAX will start on an accelerator, judged without importing it: JAX_PLATFORMS
  names one, or (JAX_PLATFORMS unset) a GPU or TPU plugin is installed."""
  platforms = os.environ.get("JAX_PLATFORMS", "").lower()
  if platforms:
    return platforms.split(",")[0].strip() not in ("cpu", "")
  return any(importlib.util.find_spec(name) is not None for name in _ACCELERATOR_PLUGINS)


def available_memory() -> int:
  """Bytes this process can still allocate: Linux's MemAvailable, or less where a
  container's memory limit (cgroup v2 or v1) leaves less; unbounded where unknown."""
  available = _read_int("/proc/meminfo", "MemAvailable:")
  free = [] if available is None else [available * 1024]
  for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                       ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                        "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
    cap, used = _read_int(limit), _read_int(usage)
    if cap is not None and used is not None:
      free.append(max(cap - used, 0))
  return min(free, default=2**62)


def _read_int(path: str, key: str | None = None) -> int | None:
  """The integer in a /proc or /sys file (after `key` where given); None if absent or
  not a number ("max": no limit)."""
  try:
    with open(path) as f:
      for line in f:
        if key is None or line.startswith(key):
          return int(line.split()[1 if key else 0])
  except (OSError, ValueError, IndexError):
    pass
  return None
