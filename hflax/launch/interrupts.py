"""Ctrl-C and SIGTERM for the launcher: each raises in the main thread, and is also kept as
pending, because Python drops an exception raised while it runs a garbage-collection
callback or a __del__ ("Exception ignored in ..."): a signal landing there would be lost
and the run would carry on. The trainer calls raise_pending() between steps."""
import signal


class Terminated(KeyboardInterrupt):
  """SIGTERM, raised in the main thread as Ctrl-C's KeyboardInterrupt is, so both unwind
  the run the same way (the trainer closes its backend, the lock is released)."""


_pending: list[type[KeyboardInterrupt]] = []


def _on_signal(signum, frame):
  kind = Terminated if signum == signal.SIGTERM else KeyboardInterrupt
  _pending.append(kind)
  raise kind()


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
