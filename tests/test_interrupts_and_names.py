"""A mistyped verl-style name gets a did-you-mean; Ctrl-C before the config is read is one
line and exit status 130. (Ctrl-C and SIGTERM during a run, through python -m hflax.launch:
tests/test_interrupt_resume.py.)"""
import os

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
