"""The main job on the Ray backend (python -m hflax.launch ... --config.cluster.backend=ray)
when a worker process is killed mid-run: without restarts the driver names the dead role
and exits non-zero within 60 s leaving no process behind; with restarts it resumes from
the latest checkpoint and finishes, and (LoRA with a KL loss) logs what the local backend
logs for the same job.

Each Ray job costs a cluster start, two worker processes and their compiles (about half a
minute of CPU here), so the restart and the LoRA comparison share one job.

Runs only inside a loopback-only network namespace (../shared/bin/netless), else skips.
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

from ray_cluster import on_loopback_only  # noqa: E402

pytestmark = on_loopback_only()

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOTAL_STEPS = 4  # checkpoint 2, the kill in step 3, then steps 3 and 4 again
CONFIG = f'''
from hflax.launch.config import base_config


def get_config():
  c = base_config()
  c.algorithm.name, c.algorithm.adv_estimator = "grpo", "grpo"  # the actor alone: few compiles
  c.actor.use_kl_loss = False
  c.rollout.n = 2
  c.data.train_batch_size, c.data.max_response_length = 4, 6
  c.actor.ppo_mini_batch_size = c.critic.ppo_mini_batch_size = 2
  c.data.builtin.update(num_train=64, num_val=8)
  c.model.builtin.update(hidden_size=32, intermediate_size=64, num_layers=1)
  c.trainer.update(total_steps={TOTAL_STEPS}, save_every=2, val_every=0, val_before_train=False,
                   devices=2, log=("jsonl",), export_hf=False)
  c.cluster.processes_per_pool = 2  # the backend stays local here: the CLI picks Ray
  return c
'''


# This project's test setting (users get Ray's defaults): a private loopback cluster.
TEST_CLUSTER = ("--config.cluster.require_loopback=True", "--config.cluster.log_to_driver=False")
# Ray prestarts an idle worker per CPU for tasks; hflax starts only actors with an
# environment of their own, which never use them (about a second of CPU each).
NO_IDLE_WORKERS = {"RAY_prestart_worker_first_driver": "0"}


class Job:
  """The CLI in a subprocess; every process it starts carries a tag in its environment."""

  def __init__(self, tmp_path, *overrides):
    (tmp_path / "tiny_grpo.py").write_text(CONFIG)
    self.tag, self.run_dir = uuid.uuid4().hex, tmp_path / "run"
    # os.environ carries the run's compilation cache (conftest): restarted workers (and the
    # second job) load what the first ones compiled.
    env = {**os.environ, "PYTHONPATH": ROOT, "HFLAX_RAY_TEST_TAG": self.tag,
           "PYTHONUNBUFFERED": "1", **NO_IDLE_WORKERS}
    self.proc = subprocess.Popen(
        [sys.executable, "-m", "hflax.launch", "--config", str(tmp_path / "tiny_grpo.py"),
         f"--config.trainer.run_dir={self.run_dir}", *TEST_CLUSTER, *overrides],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    self.lines: list[str] = []
    self._reader = threading.Thread(target=self._read, daemon=True)
    self._reader.start()

  def _read(self):
    for line in self.proc.stdout:
      self.lines.append(line)

  @property
  def output(self) -> str:
    return "".join(self.lines)

  def wait_for(self, predicate, timeout: float, what: str):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
      if predicate():
        return
      if self.proc.poll() is not None:
        raise AssertionError(f"the job exited ({self.proc.returncode}) before {what}:\n"
                             + self.output[-4000:])
      time.sleep(0.05)
    self.proc.kill()
    raise AssertionError(f"timed out waiting for {what}:\n" + self.output[-4000:])

  def member_pid(self, process: int) -> int:
    for line in self.lines:
      if line.startswith("ray: pool 'all'"):
        return int(line.split(f"process {process} pid ")[1].split()[0])
    raise AssertionError("the driver did not log the worker pids:\n" + self.output)

  def checkpointed(self, step: int) -> bool:
    return (self.run_dir / "checkpoints" / str(step)).is_dir()

  def finish(self, timeout: float) -> int:
    try:
      return self.proc.wait(timeout)
    finally:
      if self.proc.poll() is None:
        self.proc.kill()
      self._reader.join(5)

  def leftover_processes(self) -> list[str]:
    """Processes (Ray's and the workers) whose environment carries this job's tag."""
    found = []
    needle = f"HFLAX_RAY_TEST_TAG={self.tag}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc")):
      try:
        with open(f"/proc/{pid}/environ", "rb") as f:
          if needle in f.read():
            with open(f"/proc/{pid}/cmdline", "rb") as f:
              command = f.read().replace(b"\0", b" ").decode(errors="replace")
            found.append(f"{pid}: {command[:120]}")
      except OSError:
        continue
    return found


def _steps(run_dir) -> list[int]:
  """The steps in metrics.jsonl so far (complete lines only)."""
  try:
    with open(run_dir / "metrics.jsonl") as f:
      return sorted({json.loads(line)["step"] for line in f if line.endswith("\n")})
  except FileNotFoundError:
    return []


def _kill_worker(job: Job, after, delay: float = 0.0) -> float:
  """SIGKILLs process 1 of the pool `delay` s after `after()` holds (then mid-step)."""
  job.wait_for(lambda: any(line.startswith("ray: pool") for line in job.lines), 180,
               "the worker groups")
  pid = job.member_pid(1)
  job.wait_for(after, 180, "the kill point")
  time.sleep(delay)
  os.kill(pid, signal.SIGKILL)
  return time.monotonic()


def _assert_nothing_left(job: Job):
  deadline = time.monotonic() + 10  # Ray's own daemons may take a moment after exit
  while job.leftover_processes() and time.monotonic() < deadline:
    time.sleep(0.2)
  assert not job.leftover_processes(), job.leftover_processes()


# LoRA with a KL loss: the actor's Ray handle also serves the reference log-probs.
LORA = ("--config.model.lora_rank=4", "--config.actor.use_kl_loss=True",
        "--config.actor.optim.lr=1e-2")


def _metrics(run_dir) -> dict:
  """step -> its logged row (the last one logged for a step)."""
  with open(run_dir / "metrics.jsonl") as f:
    return {row["step"]: row for row in map(json.loads, f)}


def test_lora_on_ray_restarts_a_killed_worker_from_the_checkpoint_and_matches_local(tmp_path):
  """With cluster.max_restarts=1, worker process 1 SIGKILLed after checkpoint 2 (so in step
  3): the driver names the death, starts new worker groups, resumes from checkpoint 2,
  finishes every step and leaves no process behind. Every step it logged, before the kill
  and after the resume, matches the same LoRA job on the local backend (run alongside)."""
  for backend in ("ray", "local"):
    (tmp_path / backend).mkdir()
  local = Job(tmp_path / "local", "--config.cluster.backend=local", *LORA)
  try:
    job = Job(tmp_path / "ray", "--config.cluster.backend=ray",
              "--config.cluster.max_restarts=1", *LORA)
    _kill_worker(job, after=lambda: job.checkpointed(2))  # the run is in step 3
    code = job.finish(timeout=240)
    assert code == 0, job.output[-4000:]
    assert "worker process died" in job.output and "restart 1 of 1" in job.output
    resumed = [line for line in job.lines if line.startswith("resumed from step")]
    assert resumed and int(resumed[-1].split()[3]) >= 2, job.output[-3000:]
    assert _steps(job.run_dir)[-1] == TOTAL_STEPS
    _assert_nothing_left(job)
  except BaseException:
    local.proc.kill()
    raise
  assert local.finish(timeout=240) == 0, local.output[-4000:]
  ray_rows, local_rows = _metrics(job.run_dir), _metrics(local.run_dir)
  assert sorted(ray_rows) == sorted(local_rows) == list(range(1, TOTAL_STEPS + 1))
  assert ray_rows[2]["actor/kl_loss"] > 0  # the adapters moved off the base
  for step in ray_rows:
    ray_row, local_row = ray_rows[step], local_rows[step]
    assert "timing_s/ref" in ray_row
    for key in ("actor/pg_loss", "actor/kl_loss", "critic/score/mean", "response_length/mean"):
      assert ray_row[key] == pytest.approx(local_row[key], rel=1e-4, abs=1e-6), (step, key)


def test_killed_worker_fails_the_run_cleanly(tmp_path):
  job = Job(tmp_path, "--config.cluster.backend=ray")  # the launch line
  # Step 1 starts right after the roles are built, and compiles for many seconds.
  built = lambda: any(line.startswith("ray: roles") for line in job.lines)  # noqa: E731
  killed = _kill_worker(job, after=built, delay=1.0)
  code = job.finish(timeout=90)
  took = time.monotonic() - killed
  assert code != 0, job.output
  assert took < 60, f"the driver took {took:.0f} s to exit after the kill"
  assert "worker process died" in job.output and "process 1 of 2 in pool 'all'" in job.output
  assert "(roles actor, pid" in job.output, job.output[-3000:]
  _assert_nothing_left(job)
  assert _steps(job.run_dir) == []  # died in step 1
  assert "died during actor." in job.output  # in one of the step's calls
