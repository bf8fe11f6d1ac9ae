"""Ctrl-C and SIGTERM end a run with one line and exit status 130 / 143 (no traceback),
naming the checkpoint a rerun resumes from; a mistyped verl-style name gets a did-you-mean."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from hflax.launch.__main__ import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "tiny_config.py")


def _steps_logged(path):
  try:
    return [json.loads(line)["step"] for line in open(path)]
  except (OSError, ValueError, KeyError):
    return []


@pytest.mark.parametrize("signum, status, said", [(signal.SIGINT, 130, "interrupted"),
                                                  (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_sigint_and_sigterm_are_one_line_and_a_status_then_the_run_resumes(
    tmp_path, signum, status, said):
  run_dir = tmp_path / "run"
  args = [sys.executable, "-m", "hflax.launch", "--config", TINY,
          f"--config.trainer.run_dir={run_dir}", "--config.trainer.total_steps=40",
          "--config.trainer.export_hf=False"]
  env = {**os.environ, "PYTHONPATH": ROOT}
  proc = subprocess.Popen(args, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 400
  # Step 4 is logged just before its checkpoint is written (save_every=2): the interrupt
  # lands during or right before that write.
  while max(_steps_logged(run_dir / "metrics.jsonl"), default=0) < 4:
    assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
    time.sleep(0.2)
  proc.send_signal(signum)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == status, err
  assert "Traceback" not in err, err
  last = err.strip().splitlines()[-1]
  assert last.startswith(f"{said}: the same command resumes from the checkpoint of step "), err
  step = int(last.split("step ")[1].split()[0])
  assert step >= 2 and os.path.isdir(run_dir / "checkpoints" / str(step))
  args[args.index("--config.trainer.total_steps=40")] = f"--config.trainer.total_steps={step + 1}"
  done = subprocess.run(args, env=env, cwd=tmp_path, capture_output=True, text=True,
                        timeout=400)
  assert done.returncode == 0, done.stderr
  assert f"resumed from step {step} " in done.stdout, done.stdout


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
