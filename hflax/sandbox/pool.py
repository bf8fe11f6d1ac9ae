"""A pool of spawned worker processes that run user code and survive nothing it does.

    pool = ProcessPool(workers=1)
    outcome = pool.call("my_pkg.module:function", arg, timeout_s=30)   # or a picklable fn
    outcome.value if outcome.ok else outcome.describe()

Workers are spawned, fresh interpreters (no copy of the caller's threads, locks or JAX
state; see _Worker for why not through multiprocessing) reused call after call, so an
import is paid once per worker. Each call's Outcome is one of:
- returned: `value` holds what the target returned;
- raised: the target raised (SystemExit and KeyboardInterrupt included): `error_type`,
  `message` and `where`, the file:line in user code it came from. The worker lives on;
- died: the worker process ended mid-call (os._exit, a segfault, a signal, the kernel's
  OOM killer): `exitcode`, negative for a signal (as subprocess reports it);
- timed_out: the call took longer than timeout_s; the worker is killed.
A dead or killed worker is replaced by a fresh one at the next call. A target may call
report_progress(n) as it goes (n an int >= 0, e.g. the row it is on): `progress` holds
the last one, which names the row at fault even when a worker dies or hangs. It is a
store into memory shared with the caller (no message, no wake-up), so reporting every
row costs nothing measurable.

Workers run in a session of their own and ignore SIGINT: Ctrl-C is the caller's to
handle (KeyboardInterrupt while waiting kills the busy worker and propagates), never a
failure of the user's code. They end with the caller: at its exit (the pipe closes) or
its death (on Linux, the kernel's parent-death signal, even mid-call).
"""
from __future__ import annotations

import dataclasses
import importlib
import mmap
import os
import queue
import signal
import struct
import subprocess
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection, wait
from typing import Any, Callable

_PROGRESS = struct.Struct("q")  # a call's last report_progress(n); -1: none yet
_HFLAX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Outcome:
  kind: str  # "returned", "raised", "died" or "timed_out"
  value: Any = None
  error_type: str = ""
  message: str = ""
  where: str = ""  # "reward.py:12": the innermost frame of user code
  exitcode: int | None = None  # died: the exit status, or -signal number
  progress: int | None = None  # the last report_progress() value of the call
  seconds: float = 0.0

  @property
  def ok(self) -> bool:
    return self.kind == "returned"

  def describe(self) -> str:
    """One line: 'raised ZeroDivisionError: division by zero (reward.py:4)',
    'died (killed by SIGSEGV)', 'timed out after 5 s'."""
    if self.kind == "returned":
      return "returned"
    if self.kind == "raised":
      at = f" ({self.where})" if self.where else ""
      text = f": {self.message}" if self.message else ""
      return f"raised {self.error_type}{text}{at}"
    if self.kind == "died":
      return f"ended its worker process ({exit_status(self.exitcode)})"
    return f"timed out after {self.seconds:g} s (its worker process was killed)"


def exit_status(code: int | None) -> str:
  if code is None:
    return "exit status unknown"
  if code < 0:
    try:
      return f"killed by {signal.Signals(-code).name}"
    except ValueError:
      return f"killed by signal {-code}"
  return f"exit status {code}" + (", as os._exit(0) gives" if code == 0 else "")


# -- the worker side ------------------------------------------------------------------------
_progress = None  # the worker's view of its shared progress word


def report_progress(n: int) -> None:
  """From inside a target: records n (an int >= 0) as the call's progress (a no-op
  outside a worker, so a target also runs unpooled)."""
  if _progress is not None:
    _PROGRESS.pack_into(_progress, 0, n)


def _shared_word():
  """(fd, mmap) of 8 bytes the caller and its worker both map."""
  fd = os.memfd_create("hflax-sandbox-progress") if hasattr(os, "memfd_create") \
      else _unlinked_tempfile()
  os.ftruncate(fd, _PROGRESS.size)
  return fd, mmap.mmap(fd, _PROGRESS.size)


def _unlinked_tempfile() -> int:
  import tempfile
  fd, path = tempfile.mkstemp(prefix="hflax-sandbox-")
  os.unlink(path)
  return fd


def _resolve(target):
  if not isinstance(target, str):
    return target
  module, _, name = target.partition(":")
  obj = importlib.import_module(module)
  for part in name.split("."):
    obj = getattr(obj, part)
  return obj


def _where(tb) -> str:
  """file:line of the innermost frame outside hflax's own package and the standard
  library (the user's code), else the innermost frame."""
  frames = traceback.extract_tb(tb)
  stdlib = os.path.dirname(os.__file__)
  user = [f for f in frames if not f.filename.startswith((_HFLAX_DIR + os.sep, stdlib))]
  frame = (user or frames or [None])[-1]
  return f"{os.path.basename(frame.filename)}:{frame.lineno}" if frame else ""


def _die_with_parent():
  """Linux: SIGKILL this worker when its caller dies, even one stuck in user code (a closed
  pipe is only noticed between calls)."""
  try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
  except (OSError, AttributeError):  # not Linux: the closed pipe still ends an idle worker
    pass


def serve(read_fd: int, write_fd: int, progress_fd: int, memory_limit_bytes: int) -> None:
  """A worker's loop (what `python -c` runs in it): one request, one reply, until the
  caller closes its end or dies."""
  global _progress
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the caller
  _die_with_parent()
  if memory_limit_bytes:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
  requests = Connection(read_fd, writable=False)
  replies = Connection(write_fd, readable=False)
  _progress = mmap.mmap(progress_fd, _PROGRESS.size)
  while True:
    try:
      target, args, kwargs = requests.recv()
    except (EOFError, OSError):  # the caller closed the pool or died: nothing left to do
      return
    try:
      reply = ("returned", _resolve(target)(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - SystemExit too: the caller decides
      reply = ("raised", type(e).__name__, " ".join(str(e).split()), _where(e.__traceback__))
    try:
      replies.send(reply)
    except Exception as e:  # noqa: BLE001 - a result pickle cannot carry
      replies.send(("raised", type(e).__name__, f"its result cannot be sent back: {e}", ""))


# -- the caller's side ----------------------------------------------------------------------
class _Worker:
  """A fresh interpreter (`python -c`, in a session of its own, so a terminal's Ctrl-C
  reaches only the caller) talking over two pipes. Not multiprocessing's spawn: that
  re-runs the caller's main script in the worker, which a training script without an
  `if __name__ == "__main__"` guard cannot survive."""

  def __init__(self, memory_limit_bytes: int | None):
    from_caller, to_worker = os.pipe()  # (read end, write end)
    from_worker, to_caller = os.pipe()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path)}
    progress_fd, self._progress = _shared_word()
    code = (f"import hflax.sandbox.pool as p; p.serve({from_caller}, {to_caller}, "
            f"{progress_fd}, {int(memory_limit_bytes or 0)})")
    self.process = subprocess.Popen([sys.executable, "-c", code], env=env,
                                     pass_fds=(from_caller, to_caller, progress_fd),
                                     start_new_session=True)
    for fd in (from_caller, to_caller, progress_fd):
      os.close(fd)
    self.requests = Connection(to_worker, readable=False)
    self.replies = Connection(from_worker, writable=False)

  def reset_progress(self):
    _PROGRESS.pack_into(self._progress, 0, -1)

  def progress(self) -> int | None:
    n = _PROGRESS.unpack_from(self._progress, 0)[0]
    return None if n < 0 else n

  def exitcode(self) -> int | None:
    """The worker's exit status once it has ended (negative: the signal)."""
    try:
      return self.process.wait(5)
    except subprocess.TimeoutExpired:
      return None

  def kill(self):
    if self.process.poll() is None:
      self.process.kill()
    self.process.wait()
    self.requests.close()
    self.replies.close()
    self._progress.close()


class ProcessPool:
  """`workers` spawned processes; call() may be used from several threads at once (each
  call takes an idle worker, waiting for one when all are busy)."""

  def __init__(self, workers: int = 1, memory_limit_bytes: int | None = None):
    if workers < 1:
      raise ValueError(f"a process pool needs workers >= 1, got {workers}")
    self._memory = memory_limit_bytes
    self._idle: queue.Queue = queue.Queue()
    self._all: list[_Worker] = []
    self._lock = threading.Lock()
    self.closed = False
    for _ in range(workers):  # started now: their start-up overlaps the caller's own
      self._idle.put(self._start())

  def _start(self) -> _Worker:
    worker = _Worker(self._memory)
    with self._lock:
      self._all.append(worker)
    return worker

  def _retire(self, worker: _Worker):
    worker.kill()
    with self._lock:
      self._all.remove(worker)

  def call(self, target: str | Callable, *args, timeout_s: float | None = None,
           **kwargs) -> Outcome:
    """Runs target(*args, **kwargs) in a worker: "module:name" (imported in the worker,
    once) or a picklable callable. timeout_s None or 0: no limit."""
    if self.closed:
      raise RuntimeError("this process pool is closed")
    worker = self._idle.get()
    began = time.monotonic()
    try:
      outcome = self._run(worker, (target, args, kwargs), timeout_s, began)
    except BaseException:  # KeyboardInterrupt while waiting: the worker's state is unknown
      self._retire(worker)
      self._idle.put(self._start())
      raise
    if outcome.kind in ("died", "timed_out"):
      self._retire(worker)
      worker = self._start()
    self._idle.put(worker)
    return outcome

  def _run(self, worker: _Worker, request, timeout_s, began) -> Outcome:
    worker.reset_progress()
    try:
      worker.requests.send(request)
    except OSError:  # died between calls (a broken pipe)
      return Outcome("died", exitcode=worker.exitcode())
    deadline = began + timeout_s if timeout_s else None
    while True:
      left = None if deadline is None else max(0.0, deadline - time.monotonic())
      if not wait([worker.replies], left):
        return Outcome("timed_out", progress=worker.progress(), seconds=timeout_s)
      seconds = time.monotonic() - began
      try:
        message = worker.replies.recv()
      except (EOFError, OSError):  # the pipe closed: the process ended without answering
        return Outcome("died", exitcode=worker.exitcode(), progress=worker.progress(),
                       seconds=seconds)
      if message[0] == "returned":
        return Outcome("returned", value=message[1], progress=worker.progress(),
                       seconds=seconds)
      _, error_type, text, where = message
      return Outcome("raised", error_type=error_type, message=text, where=where,
                     progress=worker.progress(), seconds=seconds)

  def close(self):
    """Ends every worker (idempotent)."""
    self.closed = True
    with self._lock:
      workers, self._all = self._all, []
    for worker in workers:
      worker.kill()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


def checked_pool(check: str | Callable, *args, failed: Callable[[Outcome], str],
                 workers: int = 1, memory_limit_bytes: int | None = None,
                 timeout_s: float | None = None) -> tuple[ProcessPool, object]:
  """A pool for a user's code, and what its start-up check returned.

  check(*args) runs in a worker and returns ("ok", value) or ("refused", why): a refusal
  the user reads as it is. Any other outcome (a crash, a hang, a raise) is worded by
  failed(outcome). Either failure closes the pool and raises one ValueError, so user code
  that cannot load is refused before the run does any device work."""
  pool = ProcessPool(workers=workers, memory_limit_bytes=memory_limit_bytes)
  out = pool.call(check, *args, timeout_s=timeout_s)
  if out.ok and out.value[0] == "ok":
    return pool, out.value[1]
  pool.close()
  raise ValueError(out.value[1] if out.ok else failed(out))

