"""Ctrl-C and SIGTERM for the launcher: each raises in the main thread and is also kept as
pending. Python drops an exception raised while it runs a garbage-collection callback
(jax registers one) or a __del__, printing "Exception ignored in ..." and a traceback, and
the run would carry on: a signal landing there is only kept, and the trainer raises it
before its next step (raise_pending), the launcher at the latest when the run ends."""
import gc
import signal


class Terminated(KeyboardInterrupt):
  """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is, so both unwind
  the run the same way (the trainer closes its backend, the lock is released)."""


_pending: list[type[KeyboardInterrupt]] = []


def _on_signal(signum, frame):
  kind = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
  _pending.append(kind)
  if not _swallowed_at(frame):
    raise kind()


def _swallowed_at(frame) -> bool:
  """Whether an exception raised at `frame` would be dropped: a __del__ or one of
  gc.callbacks is running there or in a caller."""
  callbacks = {getattr(cb, "__code__", None) for cb in gc.callbacks}
  while frame is not None:
    if frame.f_code.co_name == "__del__" or frame.f_code in callbacks:
      return True
    frame = frame.f_back
  return False


def install() -> None:
  """Main thread only (Python's rule for signal handlers)."""
  signal.signal(signal.SIGINT, _on_signal)
  signal.signal(signal.SIGTERM, _on_signal)


def raise_pending() -> None:
  """Raises a signal's exception that something swallowed (a no-op when none is)."""
  if _pending:
    raise _pending[0]()


def clear() -> None:
  """The interrupt was handled (the launcher reported it)."""
  _pending.clear()
