"""One run per run directory: `python -m hflax.launch` holds an exclusive lock on
<run_dir>/.lock for the run's life.

fcntl.flock belongs to the open file, so the operating system drops it when the process
ends however it ends (kill -9 included): a lock is never stale, and the pid and host
written inside only say who holds it now. The run directory's layout is checked here
too, before any step runs, so a file where a directory belongs stops the run at once.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket

LOCK_NAME = ".lock"


class RunDirBusy(ValueError):
  """Another live process holds the run directory (one line, exit status 2)."""


def check_run_dir_layout(run_dir: str) -> None:
  """Paths in run_dir (itself checked by config.validate) that the run writes into."""
  checkpoints = os.path.join(run_dir, "checkpoints")
  if os.path.exists(checkpoints) and not os.path.isdir(checkpoints):
    raise ValueError(f"config.trainer.run_dir: {checkpoints} is a file, not a directory; "
                     "move it aside (checkpoints are written there)")


def lock_run_dir(run_dir: str):
  """The open lock file (keep it open for the run's life), or RunDirBusy naming the
  holder. Creates run_dir if needed."""
  check_run_dir_layout(run_dir)
  os.makedirs(run_dir, exist_ok=True)
  path = os.path.join(run_dir, LOCK_NAME)
  # O_CREAT without truncation: the holder's pid stays readable until we own the lock.
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    holder = _read_holder(fd)
    os.close(fd)
    raise RunDirBusy(f"config.trainer.run_dir: {run_dir} is in use by another run "
                     f"({holder}); wait for it to end, or use another run_dir") from None
  except OSError as e:  # a filesystem without locks: say so rather than run unprotected
    os.close(fd)
    raise ValueError(f"config.trainer.run_dir: cannot lock {path} ({e.strerror})") from None
  os.ftruncate(fd, 0)
  os.pwrite(fd, f"pid {os.getpid()} on host {socket.gethostname()}\n".encode(), 0)
  return os.fdopen(fd, "r+")


@contextlib.contextmanager
def holding_run_dir(run_dir: str):
  """lock_run_dir for the life of a `with` block. A run directory the lock created and the
  run left empty (its input refused before any work) is removed again: a refused run
  leaves nothing behind."""
  created = not os.path.exists(run_dir)
  lock = lock_run_dir(run_dir)
  try:
    with lock:
      yield lock
  finally:
    if created and os.listdir(run_dir) == [LOCK_NAME]:
      os.remove(os.path.join(run_dir, LOCK_NAME))
      os.rmdir(run_dir)


def _read_holder(fd: int) -> str:
  text = os.pread(fd, 200, 0).decode(errors="replace").strip()
  return text or "pid unknown: it has not written its pid yet"


def resume_hint(cfg) -> str:
  """What an interrupted run left: the checkpoint the same command resumes from."""
  if cfg is None:
    return "before the config was read; nothing ran"
  run_dir = cfg.trainer.run_dir
  checkpoints = os.path.join(run_dir, "checkpoints")
  steps = sorted(int(n) for n in (os.listdir(checkpoints) if os.path.isdir(checkpoints) else ())
                 if n.isdigit() and os.path.isdir(os.path.join(checkpoints, n)))
  if not steps:
    return f"no checkpoint saved in {run_dir} yet; the same command starts afresh"
  return (f"the same command resumes from the checkpoint of step {steps[-1]} in "
          f"{checkpoints}")
