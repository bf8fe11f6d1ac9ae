"""Exports that are whole or absent: written into a temporary sibling directory, marked
complete last, then renamed into place.

A rename within one filesystem is atomic, so `hf_actor/` is either the previous complete
export or the new one; an export killed half-way leaves only `hf_actor.incomplete-<pid>/`,
whose INCOMPLETE file says what it is (a loader refuses it: refuse_incomplete), and which
the next export removes. The marker written last (EXPORT_COMPLETE) lets a reader tell a
finished hflax export from one copied out of a temporary directory by hand.
"""
from __future__ import annotations

import contextlib
import glob
import json
import os
import shutil
import time

COMPLETE = "EXPORT_COMPLETE"
INCOMPLETE = "INCOMPLETE"
_PARTIAL = ".incomplete-"


@contextlib.contextmanager
def atomic_directory(final: str):
  """Yields a fresh temporary directory beside `final`; when the block ends without an
  exception it is marked complete and replaces `final`, otherwise it is removed."""
  final = os.path.normpath(final)
  for stale in glob.glob(glob.escape(final) + _PARTIAL + "*"):  # a killed export's leftovers
    shutil.rmtree(stale, ignore_errors=True)
  partial = f"{final}{_PARTIAL}{os.getpid()}"
  os.makedirs(partial)
  with open(os.path.join(partial, INCOMPLETE), "w") as f:
    f.write(f"an unfinished export of {os.path.basename(final)}: do not load it\n")
  try:
    yield partial
    os.remove(os.path.join(partial, INCOMPLETE))
    with open(os.path.join(partial, COMPLETE), "w") as f:
      json.dump({"written_at": time.time(), "pid": os.getpid()}, f)
      f.flush()
      os.fsync(f.fileno())
    _replace(partial, final)
  except BaseException:
    shutil.rmtree(partial, ignore_errors=True)
    raise


def _replace(partial: str, final: str):
  """partial -> final; an earlier export there is set aside first and removed after, so
  no moment leaves final half old and half new."""
  old = None
  if os.path.lexists(final):
    old = f"{final}.old-{os.getpid()}"
    os.rename(final, old)
  os.rename(partial, final)
  if old is not None:
    shutil.rmtree(old, ignore_errors=True) if os.path.isdir(old) else os.remove(old)


def is_complete(path: str) -> bool:
  return os.path.isfile(os.path.join(path, COMPLETE))


def refuse_incomplete(path: str) -> None:
  """ValueError for a directory an hflax export left unfinished (a loader's check)."""
  if os.path.isfile(os.path.join(path, INCOMPLETE)):
    raise ValueError(f"{path} is an unfinished export (it holds {INCOMPLETE}, no "
                     f"{COMPLETE}); rerun the job that writes it")
