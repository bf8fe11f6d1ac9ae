"""A mistyped verl-style name gets a did-you-mean; Ctrl-C before the config is read is one
line and exit status 130. (Ctrl-C and SIGTERM during a run, through python -m hflax.launch:
tests/test_interrupt_resume.py.)"""
import gc
import os
import signal
import sys

import pytest

from hflax.launch.__main__ import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "tiny_config.py")


def test_an_unknown_verl_name_gets_a_did_you_mean(tmp_path, capsys):
  code = cli(["--config", TINY, f"--config.trainer.run_dir={tmp_path}/run",
              "actor_rollout_ref.actor.optim.lrr=1e-5"])
  err = capsys.readouterr().err.strip()
  assert code == 2 and len(err.splitlines()) == 1, err
  assert ("actor_rollout_ref.actor.optim.lrr: not a verl name hflax knows; did you mean "
          "actor_rollout_ref.actor.optim.lr (hflax's actor.optim.lr)?") in err, err
  assert not (tmp_path / "run").exists()


def test_interrupted_before_the_config_is_read(monkeypatch, capsys):
  def interrupt(argv):
    raise KeyboardInterrupt
  monkeypatch.setattr("hflax.launch.__main__.load_config", interrupt)
  assert cli(["--config", TINY]) == 130
  assert capsys.readouterr().err == "interrupted: before the config was read; nothing ran\n"


def test_a_signal_whose_exception_python_swallowed_is_raised_between_steps(monkeypatch):
  """Python drops an exception raised inside __del__ or a garbage-collection callback
  ("Exception ignored in ..." and a traceback); a SIGTERM landing there is only kept, and
  the trainer's raise_pending() between steps raises it (a run hit this at a random SIGINT:
  it went on to the end and exited 0; another printed the traceback on its way out)."""
  from hflax.launch import interrupts
  saved = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}

  class SignalledWhileDeleted:
    def __del__(self):
      os.kill(os.getpid(), signal.SIGTERM)
      for _ in range(100_000):  # the handler runs in here, and its exception is dropped
        pass

  dropped = []  # what Python reports as "Exception ignored in ..."
  monkeypatch.setattr(sys, "unraisablehook", dropped.append)
  try:
    interrupts.install()
    interrupts.raise_pending()  # nothing pending yet
    SignalledWhileDeleted()  # deleted at once; no exception comes out of this line
    with pytest.raises(interrupts.Terminated):
      interrupts.raise_pending()
    assert not dropped  # not raised where Python would drop it
  finally:
    interrupts.clear()
    for s, handler in saved.items():
      signal.signal(s, handler)


def test_a_signal_inside_a_gc_callback_is_kept_not_raised():
  from hflax.launch import interrupts
  seen = []

  def callback(phase, info):
    seen.append(interrupts._swallowed_at(sys._getframe()))

  gc.callbacks.append(callback)
  try:
    gc.collect()
  finally:
    gc.callbacks.remove(callback)
  assert seen and all(seen)
  assert not interrupts._swallowed_at(sys._getframe())
