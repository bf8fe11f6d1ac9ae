"""One run per run directory: a second launcher on a locked run_dir exits 2 at once
naming the holder; the lock dies with its holder (kill -9 leaves none stale). Two
python -m hflax.launch runs on one run_dir, the first then killed with kill -9 and resumed:
tests/test_interrupt_resume.py."""
import os
import signal
import subprocess
import sys
import time

from hflax.launch.__main__ import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "tiny_config.py")

HOLD = ("import sys, time; from hflax.launch.run_lock import lock_run_dir; "
        "f = lock_run_dir(sys.argv[1]); print('locked', flush=True); time.sleep(600)")


def _holder(run_dir):
  proc = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE,
                          text=True, env={**os.environ, "PYTHONPATH": ROOT})
  assert proc.stdout.readline().strip() == "locked"
  return proc


def test_second_launcher_exits_2_naming_the_holder_then_runs_after_kill_9(tmp_path, capsys):
  run_dir = tmp_path / "run"
  holder = _holder(run_dir)
  try:
    began = time.monotonic()
    code = cli(["--config", TINY, f"--config.trainer.run_dir={run_dir}",
                "--config.trainer.total_steps=1"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert f"pid {holder.pid} on host " in err and "in use by another run" in err, err
    assert time.monotonic() - began < 30  # at once: no model was built
    assert not (run_dir / "checkpoints").exists()
  finally:
    holder.send_signal(signal.SIGKILL)
    holder.wait()
  # The OS released the dead holder's lock: the next launcher runs.
  code = cli(["--config", TINY, f"--config.trainer.run_dir={run_dir}",
              "--config.trainer.total_steps=1", "--config.trainer.export_hf=False"])
  assert code == 0, capsys.readouterr().err
  assert (run_dir / "checkpoints").is_dir()
  assert f"pid {os.getpid()} " in (run_dir / ".lock").read_text()


def test_lock_is_released_when_the_run_ends(tmp_path):
  from hflax.launch.run_lock import lock_run_dir
  with lock_run_dir(str(tmp_path)):
    pass
  with lock_run_dir(str(tmp_path)):  # the same process again: free
    pass


def test_checkpoints_that_is_a_file_is_one_line_before_any_step(tmp_path, capsys):
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  (run_dir / "checkpoints").write_text("not a directory")
  code = cli(["--config", TINY, f"--config.trainer.run_dir={run_dir}"])
  err = capsys.readouterr().err.strip()
  assert code == 2 and len(err.splitlines()) == 1, err
  assert f"{run_dir}/checkpoints is a file, not a directory" in err, err
  assert not (run_dir / "metrics.jsonl").exists()
