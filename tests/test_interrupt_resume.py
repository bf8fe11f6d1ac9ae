"""SIGINT and SIGTERM at a random moment of a run, and in the middle of a checkpoint write
(its files in orbax's temporary directory, not yet committed: the test pause
HFLAX_TEST_PAUSE holds it there), through python -m hflax.launch: one line, exit status
130 / 143, no traceback; the same command then finishes the run, and its metrics (less
timings) and its exported model's files are identical to an uninterrupted run's."""
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "tiny_config.py")
STEPS = 6  # tiny_config saves every 2 steps
ENV = {**os.environ, "PYTHONPATH": ROOT}
ENV.pop("HFLAX_TEST_PAUSE", None)


def _command(run_dir):
  return [sys.executable, "-m", "hflax.launch", "--config", TINY,
          f"--config.trainer.run_dir={run_dir}", f"--config.trainer.total_steps={STEPS}"]


def _records(run_dir) -> dict:
  """step -> its metrics as last logged (a resumed run logs the steps after its checkpoint
  again), less the fields that measure time."""
  steps = {}
  for line in open(run_dir / "metrics.jsonl"):
    try:
      record = json.loads(line)
    except ValueError:  # a line cut short by the interrupt
      continue
    steps[record["step"]] = {k: v for k, v in record.items()
                             if not k.startswith("timing_s/") and "throughput" not in k}
  return steps


def _md5s(export) -> dict:
  return {name: hashlib.md5((export / name).read_bytes()).hexdigest()
          for name in sorted(os.listdir(export)) if name != "EXPORT_COMPLETE"}  # a timestamp


def _logged(run_dir) -> int:
  try:
    return max((json.loads(line)["step"] for line in open(run_dir / "metrics.jsonl")),
               default=0)
  except (OSError, ValueError, KeyError):
    return 0


def _wait(proc, ready, what):
  deadline = time.monotonic() + 400
  while not ready():
    assert proc.poll() is None, f"ended before {what}: {proc.communicate()}"
    assert time.monotonic() < deadline, f"no {what} in 400 s"
    time.sleep(0.01)


def _holds_lock(proc, run_dir):
  lock = run_dir / ".lock"
  return lambda: lock.is_file() and f"pid {proc.pid} " in lock.read_text()


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
  """Its metrics, its export's md5s, and the seconds from taking the run_dir lock to
  logging step STEPS - 2 (the span a random interrupt is drawn from)."""
  run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
  proc = subprocess.Popen(_command(run_dir), env=ENV, cwd=run_dir.parent,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  _wait(proc, _holds_lock(proc, run_dir), "run_dir lock")
  began = time.monotonic()
  _wait(proc, lambda: _logged(run_dir) >= STEPS - 2, f"step {STEPS - 2} logged")
  span = time.monotonic() - began
  _, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, err
  return _records(run_dir), _md5s(run_dir / "hf_actor"), span


@pytest.mark.parametrize("moment", ["random", "checkpoint_write"])
@pytest.mark.parametrize("signum, status, said", [(signal.SIGINT, 130, "interrupted"),
                                                  (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_interrupted_then_resumed_equals_uninterrupted(uninterrupted, tmp_path, moment, signum,
                                                       status, said):
  run_dir = tmp_path / "run"
  env = dict(ENV)
  seed = random.randrange(2**32)
  rng = random.Random(seed)
  if moment == "checkpoint_write":
    env["HFLAX_TEST_PAUSE"] = "checkpoint=3"  # each write waits 3 s before its commit
  proc = subprocess.Popen(_command(run_dir), env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  checkpoints = run_dir / "checkpoints"
  if moment == "checkpoint_write":  # step 4's write, with step 2's committed before it
    _wait(proc, lambda: checkpoints.is_dir() and any(
        n.startswith("4.orbax-checkpoint-tmp") for n in os.listdir(checkpoints)),
        "temporary directory of checkpoint 4")
    time.sleep(0.5)
    moment_said = "during the write of checkpoint 4"
  else:  # a moment drawn from the uninterrupted run's span: model build, compile, steps
    delay = rng.uniform(0, uninterrupted[2])
    _wait(proc, _holds_lock(proc, run_dir), "run_dir lock")
    began = time.monotonic()
    # ... and before step STEPS - 2 at the latest, should this run go faster.
    _wait(proc, lambda: time.monotonic() - began >= delay or _logged(run_dir) >= STEPS - 2,
          "the moment")
    moment_said = (f"{time.monotonic() - began:.3f} s after the lock (drawn {delay:.3f} s, "
                   f"seed {seed}), step {_logged(run_dir)} logged")
  proc.send_signal(signum)
  _, err = proc.communicate(timeout=120)
  assert proc.returncode == status, (moment_said, err)
  assert "Traceback" not in err and "Error" not in err, (moment_said, err)
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"{said}: "), (moment_said, err)
  if moment == "checkpoint_write":
    assert lines[0] == (f"{said}: the same command resumes from the checkpoint of step 2 in "
                        f"{checkpoints}"), err
  done = subprocess.run(_command(run_dir), env=ENV, cwd=tmp_path, capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, (moment_said, done.stderr)
  metrics, md5s, _ = uninterrupted
  assert _records(run_dir) == metrics, moment_said
  assert _md5s(run_dir / "hf_actor") == md5s, moment_said
  assert sorted(os.listdir(checkpoints)) == ["4", "6"], moment_said  # no write left over
