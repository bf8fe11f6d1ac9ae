"""A pool of spawned worker processes that run user code and survive nothing it does.

    pool = ProcessPool(workers=1)
    outcome = pool.call("my_pkg.module:function", arg, timeout_s=30)   # or a picklable fn
    outcome.value if outcome.ok else outcome.describe()

Workers are started with multiprocessing's 'spawn' context (no copy of the caller's
threads, locks or JAX state) and reused call after call, so an import is paid once per
worker. Each call's Outcome is one of:
- returned: `value` holds what the target returned;
- raised: the target raised (SystemExit and KeyboardInterrupt included): `error_type`,
  `message` and `where`, the file:line in user code it came from. The worker lives on;
- died: the worker process ended mid-call (os._exit, a segfault, a signal, the kernel's
  OOM killer): `exitcode`, negative for a signal, as multiprocessing reports it;
- timed_out: the call took longer than timeout_s; the worker is killed.
A dead or killed worker is replaced by a fresh one at the next call. A target may call
report_progress(x) as it goes (e.g. the row it is on): `progress` holds the last value
reported, which names the row at fault when a worker dies or hangs.

Workers ignore SIGINT: Ctrl-C is the caller's to handle (KeyboardInterrupt while waiting
kills the busy worker and propagates), never a failure of the user's code.
"""
from __future__ import annotations

import dataclasses
import importlib
import multiprocessing
import multiprocessing.connection
import os
import queue
import signal
import threading
import time
import traceback
from typing import Any, Callable

_HFLAX_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclasses.dataclass(frozen=True)
class Outcome:
  kind: str  # "returned", "raised", "died" or "timed_out"
  value: Any = None
  error_type: str = ""
  message: str = ""
  where: str = ""  # "reward.py:12": the innermost frame of user code
  exitcode: int | None = None  # died: the exit status, or -signal number
  progress: Any = None  # the last report_progress() value of the call
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
_channel = None  # the worker's end of its pipe, for report_progress


def report_progress(value) -> None:
  """From inside a target: records `value` as the call's progress (no-op in the caller's
  own process, so a target also runs unpooled)."""
  if _channel is not None:
    _channel.send(("progress", value))


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


def _serve(conn, memory_limit_bytes: int | None):
  global _channel
  signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C belongs to the caller
  if memory_limit_bytes:
    import resource
    resource.setrlimit(resource.RLIMIT_AS, (memory_limit_bytes, memory_limit_bytes))
  _channel = conn
  while True:
    try:
      target, args, kwargs = conn.recv()
    except (EOFError, OSError):  # the caller closed the pool or died: nothing left to do
      return
    try:
      reply = ("returned", _resolve(target)(*args, **kwargs))
    except BaseException as e:  # noqa: BLE001 - SystemExit too: the caller decides
      reply = ("raised", type(e).__name__, " ".join(str(e).split()), _where(e.__traceback__))
    try:
      conn.send(reply)
    except Exception as e:  # noqa: BLE001 - a result pickle cannot carry
      conn.send(("raised", type(e).__name__, f"its result cannot be sent back: {e}", ""))


# -- the caller's side ----------------------------------------------------------------------
class _Worker:
  def __init__(self, ctx, memory_limit_bytes):
    self.conn, child = ctx.Pipe()
    # daemon: multiprocessing ends it at the caller's exit; a caller killed with -9 closes
    # the pipe, and the worker's recv() ends it.
    self.process = ctx.Process(target=_serve, args=(child, memory_limit_bytes), daemon=True,
                               name="hflax-sandbox")
    self.process.start()
    child.close()

  def kill(self):
    if self.process.is_alive():
      self.process.kill()
    self.process.join(5)
    self.conn.close()


class ProcessPool:
  """`workers` spawned processes; call() may be used from several threads at once (each
  call takes an idle worker, waiting for one when all are busy)."""

  def __init__(self, workers: int = 1, memory_limit_bytes: int | None = None):
    if workers < 1:
      raise ValueError(f"a process pool needs workers >= 1, got {workers}")
    self._ctx = multiprocessing.get_context("spawn")
    self._memory = memory_limit_bytes
    self._idle: queue.Queue = queue.Queue()
    self._all: list[_Worker] = []
    self._lock = threading.Lock()
    self.closed = False
    for _ in range(workers):  # started now: their start-up overlaps the caller's own
      self._idle.put(self._start())

  def _start(self) -> _Worker:
    worker = _Worker(self._ctx, self._memory)
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
    try:
      worker.conn.send(request)
    except (BrokenPipeError, EOFError, OSError):  # died between calls
      worker.process.join(5)
      return Outcome("died", exitcode=worker.process.exitcode)
    progress = None
    deadline = began + timeout_s if timeout_s else None
    while True:
      left = None if deadline is None else max(0.0, deadline - time.monotonic())
      ready = multiprocessing.connection.wait([worker.conn, worker.process.sentinel], left)
      seconds = time.monotonic() - began
      if worker.conn in ready:
        try:
          message = worker.conn.recv()
        except (EOFError, OSError):
          ready = [worker.process.sentinel]
        else:
          if message[0] == "progress":
            progress = message[1]
            continue
          if message[0] == "returned":
            return Outcome("returned", value=message[1], progress=progress, seconds=seconds)
          _, error_type, text, where = message
          return Outcome("raised", error_type=error_type, message=text, where=where,
                         progress=progress, seconds=seconds)
      if ready:  # the sentinel alone: the process ended without answering
        worker.process.join(5)
        return Outcome("died", exitcode=worker.process.exitcode, progress=progress,
                       seconds=seconds)
      return Outcome("timed_out", progress=progress, seconds=timeout_s)

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
