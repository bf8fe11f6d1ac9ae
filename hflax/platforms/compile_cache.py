"""JAX's persistent compilation cache for this process, on any backend: where it lives,
turning it on, and what it saved. Imports jax only when a function needs it, so the
process set-up can read default_compile_cache_dir before JAX starts."""
from __future__ import annotations

import os

MIN_COMPILE_TIME_VARIABLE = "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"
JAX_MIN_COMPILE_TIME_S = 1.0  # JAX's default for it


def default_compile_cache_dir() -> str:
  """$XDG_CACHE_HOME/hflax/jax, else ~/.cache/hflax/jax, with "~" left for each process
  (a Ray worker on another host too) to expand for itself."""
  return os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "hflax", "jax")


def use_compile_cache(path: str) -> str | None:
  """Points JAX's persistent compilation cache at `path` for this process and returns the
  directory in use (None: no cache). A rerun or a resume of the same job then reads its
  compiled programs back instead of compiling them again.

  A directory JAX already has (JAX_COMPILATION_CACHE_DIR, or jax.config set by the
  caller) is kept whatever `path` says, with its settings; "" leaves the cache off.
  Otherwise every program is written, not only those that took JAX's default of a second
  to compile (unless that setting was changed): a run compiles dozens of small programs
  whose compiles add up, and the whole cache stays small. Nothing is evicted: JAX's size
  limit writes an access-time file beside each entry, and a process killed between the
  two writes leaves that cache refusing every later entry. JAX writes an entry in place,
  so one killed mid-write is compiled afresh whenever it is needed (JAX warns that it
  could not read it). Deleting the directory at any time is safe."""
  import jax
  current = jax.config.jax_compilation_cache_dir
  if current:
    return current
  if not path:
    return None
  path = os.path.abspath(os.path.expanduser(path))
  if (MIN_COMPILE_TIME_VARIABLE not in os.environ
      and jax.config.jax_persistent_cache_min_compile_time_secs == JAX_MIN_COMPILE_TIME_S):
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_compilation_cache_dir", path)
  return path


def compile_cache_summary(path: str) -> str:
  """"N programs, X MB" held in a cache directory (0 where it does not exist yet)."""
  sizes = []
  if os.path.isdir(path):
    with os.scandir(path) as entries:
      sizes = [e.stat().st_size for e in entries if e.is_file() and not e.name.startswith(".")]
  return f"{len(sizes)} programs, {sum(sizes) / 1e6:.0f} MB"


class CompileCacheStats:
  """What this process's compiles found in the persistent cache, from JAX's monitoring
  events: programs looked up, programs read back, and the compile seconds that saved."""
  _LOOKUP, _HIT = ("/jax/compilation_cache/compile_requests_use_cache",
                   "/jax/compilation_cache/cache_hits")
  _SAVED = "/jax/compilation_cache/compile_time_saved_sec"

  def __init__(self):
    from jax import monitoring
    self.lookups = self.hits = 0
    self.saved_s = 0.0
    monitoring.register_event_listener(self._event)
    monitoring.register_event_duration_secs_listener(self._duration)

  def _event(self, event, **_):
    self.lookups += event == self._LOOKUP
    self.hits += event == self._HIT

  def _duration(self, event, seconds, **_):
    if event == self._SAVED:
      self.saved_s += seconds

  def close(self):
    from jax import monitoring
    monitoring.unregister_event_listener(self._event)
    monitoring.unregister_event_duration_listener(self._duration)

  def __str__(self):
    return (f"{self.hits} of {self.lookups} programs read back, "
            f"{self.saved_s:.1f} s of compiling saved")
