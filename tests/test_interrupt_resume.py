"""SIGINT and SIGTERM at a random moment of a run, and in the middle of a checkpoint write
(its files in orbax's temporary directory, not yet committed: the test pause
HFLAX_TEST_PAUSE holds it there), through python -m hflax.launch: one line, exit status
130 / 143, no traceback, naming the checkpoint a rerun resumes from; the same command then
resumes from it (interrupted at random first, its rerun is the one interrupted mid-write)
and finishes the run, and its metrics (less timings) and its exported model's files are
identical to an uninterrupted run's. kill -9 likewise, mid-run and then
mid-export, with a second launcher on the same run_dir refused at once while the first
holds it.

Every test compares against one uninterrupted run (a module fixture)."""
import hashlib
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest

from hflax.launch import atomic_export

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "tiny_config.py")
STEPS = 4  # tiny_config saves every 2 steps: a run with a checkpoint before its last
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
  logging step STEPS - 1 (the span a random interrupt is drawn from: model build, compile,
  the steps before the first checkpoint, its write, and the step after it)."""
  run_dir = tmp_path_factory.mktemp("uninterrupted") / "run"
  proc = subprocess.Popen(_command(run_dir), env=ENV, cwd=run_dir.parent,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  _wait(proc, _holds_lock(proc, run_dir), "run_dir lock")
  began = time.monotonic()
  _wait(proc, lambda: _logged(run_dir) >= STEPS - 1, f"step {STEPS - 1} logged")
  span = time.monotonic() - began
  _, err = proc.communicate(timeout=600)
  assert proc.returncode == 0, err
  return _records(run_dir), _md5s(run_dir / "hf_actor"), span


def _interrupted(proc, signum, status, said, run_dir, moment_said):
  """Sends signum; checks the one line the launcher says and its exit status. Returns its
  stdout, that line, and the step of the checkpoint it names (None: none saved yet)."""
  proc.send_signal(signum)
  out, err = proc.communicate(timeout=120)
  assert proc.returncode == status, (moment_said, err)
  assert "Traceback" not in err and "Error" not in err, (moment_said, err)
  lines = err.strip().splitlines()
  assert len(lines) == 1 and lines[0].startswith(f"{said}: "), (moment_said, err)
  if "resumes from the checkpoint of step " in lines[0]:
    step = int(lines[0].split("step ")[1].split()[0])
    assert step >= 2 and os.path.isdir(run_dir / "checkpoints" / str(step)), (moment_said, err)
    return out, lines[0], step
  assert lines[0] == (f"{said}: no checkpoint saved in {run_dir} yet; the same command "
                      "starts afresh"), (moment_said, err)
  return out, lines[0], None


@pytest.mark.parametrize("signum, status, said", [(signal.SIGINT, 130, "interrupted"),
                                                  (signal.SIGTERM, 143, "terminated (SIGTERM)")])
def test_interrupted_at_random_then_mid_checkpoint_write_then_resumed_equals_uninterrupted(
    uninterrupted, tmp_path, signum, status, said):
  """Three launches of one command on one run_dir. The first is interrupted at a random
  moment; the second resumes from the checkpoint the first named (or starts afresh) and is
  interrupted while checkpoint 4 is written, step 2's committed; the third resumes from
  step 2 and finishes equal to the uninterrupted run, no write left over."""
  run_dir = tmp_path / "run"
  checkpoints = run_dir / "checkpoints"
  seed = random.randrange(2**32)
  rng = random.Random(seed)
  proc = subprocess.Popen(_command(run_dir), env=ENV, cwd=tmp_path, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  # A moment drawn from the uninterrupted run's span: model build, compile, steps ...
  delay = rng.uniform(0, uninterrupted[2])
  _wait(proc, _holds_lock(proc, run_dir), "run_dir lock")
  began = time.monotonic()
  # ... and before step STEPS - 1 at the latest, should this run go faster.
  _wait(proc, lambda: time.monotonic() - began >= delay or _logged(run_dir) >= STEPS - 1,
        "the moment")
  moment_said = (f"{time.monotonic() - began:.3f} s after the lock (drawn {delay:.3f} s, "
                 f"seed {seed}), step {_logged(run_dir)} logged")
  _, _, step = _interrupted(proc, signum, status, said, run_dir, moment_said)

  # The same command again, each checkpoint write held 3 s before its commit.
  env = {**ENV, "HFLAX_TEST_PAUSE": "checkpoint=3", "PYTHONUNBUFFERED": "1"}
  proc = subprocess.Popen(_command(run_dir), env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                          stderr=subprocess.PIPE, text=True)
  _wait(proc, lambda: checkpoints.is_dir() and any(
      n.startswith("4.orbax-checkpoint-tmp") for n in os.listdir(checkpoints)),
      "temporary directory of checkpoint 4")
  time.sleep(0.5)
  out, line, _ = _interrupted(proc, signum, status, said, run_dir,
                              "during the write of checkpoint 4")
  assert line == (f"{said}: the same command resumes from the checkpoint of step 2 in "
                  f"{checkpoints}"), (moment_said, line)
  if step is None:
    assert "resumed from step" not in out, (moment_said, out)
  else:
    assert f"resumed from step {step} " in out, (moment_said, out)

  done = subprocess.run(_command(run_dir), env=ENV, cwd=tmp_path, capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, (moment_said, done.stderr)
  assert "resumed from step 2 " in done.stdout, (moment_said, done.stdout)
  metrics, md5s, _ = uninterrupted
  assert _records(run_dir) == metrics, moment_said
  assert _md5s(run_dir / "hf_actor") == md5s, moment_said
  assert sorted(os.listdir(checkpoints)) == ["2", "4"], moment_said  # no write left over


def test_second_launcher_refused_kill_9_mid_run_and_mid_export_then_resume_equals_uninterrupted(
    uninterrupted, tmp_path):
  """While the first launcher holds the run_dir, a second exits 2 at once naming it. kill -9
  after step 3 (past the checkpoint of step 2, before the last) frees the lock; the same
  command resumes, and kill -9 again while its export is half written (HFLAX_TEST_PAUSE
  holds it after the weights, before the tokenizer) leaves no hf_actor, only
  hf_actor.incomplete-<pid>/ marked INCOMPLETE. The same command then resumes at the last
  step, exports whole, removes the leftovers, and ends as the uninterrupted run."""
  run_dir = tmp_path / "run"
  kill_after = random.randint(3, STEPS - 1)
  first = subprocess.Popen(_command(run_dir), env=ENV, cwd=tmp_path, stdout=subprocess.DEVNULL,
                           stderr=subprocess.PIPE, text=True)
  _wait(first, _holds_lock(first, run_dir), "run_dir lock")
  began = time.monotonic()
  second = subprocess.run(_command(run_dir), env=ENV, cwd=tmp_path, capture_output=True,
                          text=True, timeout=120)
  assert second.returncode == 2, second.stderr
  assert f"in use by another run (pid {first.pid} on host " in \
      second.stderr.strip().splitlines()[-1], second.stderr
  assert time.monotonic() - began < 30, "the second launcher did not stop at once"
  _wait(first, lambda: _logged(run_dir) >= kill_after, f"step {kill_after} logged")
  first.send_signal(signal.SIGKILL)
  first.communicate(timeout=60)
  assert first.returncode == -signal.SIGKILL
  assert not (run_dir / "hf_actor").exists()

  exporting = subprocess.Popen(_command(run_dir), env={**ENV, "HFLAX_TEST_PAUSE": "export=120",
                                                             "PYTHONUNBUFFERED": "1"},
                               cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)

  def half_written():
    found = [p for p in os.listdir(run_dir) if p.startswith(f"hf_actor{atomic_export._PARTIAL}")]
    return found and (run_dir / found[0] / "model.safetensors").is_file()
  _wait(exporting, half_written, "the export's weights")
  exporting.send_signal(signal.SIGKILL)
  out, _ = exporting.communicate(timeout=60)
  assert exporting.returncode == -signal.SIGKILL
  assert "resumed from step " in out, (kill_after, out)
  assert not (run_dir / "hf_actor").exists()
  (partial,) = [run_dir / p for p in os.listdir(run_dir)
                if p.startswith(f"hf_actor{atomic_export._PARTIAL}")]
  assert (partial / atomic_export.INCOMPLETE).is_file() and not atomic_export.is_complete(partial)

  done = subprocess.run(_command(run_dir), env=ENV, cwd=tmp_path, capture_output=True,
                        text=True, timeout=600)
  assert done.returncode == 0, (kill_after, done.stderr)
  assert f"resumed from step {STEPS} " in done.stdout, done.stdout
  assert "exported the actor to" in done.stdout, done.stdout
  export = run_dir / "hf_actor"
  assert atomic_export.is_complete(export) and not (export / atomic_export.INCOMPLETE).exists()
  assert {"model.safetensors", "config.json", "hflax_tokenizer.json"} <= set(os.listdir(export))
  assert [p for p in os.listdir(run_dir) if p.startswith("hf_actor")] == ["hf_actor"]
  metrics, md5s, _ = uninterrupted
  assert _records(run_dir) == metrics, kill_after
  assert _md5s(export) == md5s, kill_after
