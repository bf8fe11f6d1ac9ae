"""Reward code from a user's file runs in a worker process: its os._exit (at once, after
N calls, at import), segfault, hang or KeyboardInterrupt at import ends the worker, never
the trainer, which reports one line naming the function, file and row and exits 2; the
checkpoints before it are intact and a rerun with a fixed reward resumes from them."""
import os
import subprocess
import sys

import pytest

from hflax.launch.__main__ import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "tiny_config.py")
HEAD = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
CALLS = "import os\nCALLS = [0]\n"  # rows a tiny step scores: 4 prompts x 2 samples
# Two steps with a checkpoint after each: a reward dying in step 2 (after its 10th row,
# that step's row 2) leaves checkpoint 1, and a rerun resumes from it to finish step 2.
STEPS = ("--config.trainer.total_steps=2", "--config.trainer.save_every=1")

BODIES = {
    "exit_at_once": (HEAD + "  import os\n  os._exit(0)\n",
                     "reward function compute_score (exit_at_once.py) ended its worker "
                     "process (exit status 0, as os._exit(0) gives) on row 0"),
    "exit_after_calls": (CALLS + HEAD + "  CALLS[0] += 1\n  if CALLS[0] > 10:\n    os._exit(0)\n"
                         "  return 1.0\n",
                         "reward function compute_score (exit_after_calls.py) ended its "
                         "worker process (exit status 0, as os._exit(0) gives) on row 2"),
    "exit_at_import": ("import os\nos._exit(0)\n" + HEAD + "  return 1.0\n",
                       "exit_at_import.py): importing it ended its worker process (exit "
                       "status 0, as os._exit(0) gives)"),
    "segfault": (HEAD + "  import ctypes\n  ctypes.string_at(0)\n",
                 "reward function compute_score (segfault.py) ended its worker process "
                 "(killed by SIGSEGV) on row 0"),
    "interrupt_at_import": ("raise KeyboardInterrupt\n" + HEAD + "  return 1.0\n",
                            "interrupt_at_import.py): importing it raised KeyboardInterrupt() "
                            "(interrupt_at_import.py:1)"),
    "hang": (HEAD + "  import time\n  time.sleep(600)\n",
             "reward function compute_score (hang.py) took longer than timeout_s=3 s on a "
             "batch of 8 responses (at row 0; its worker process was killed)"),
    "raises": (HEAD + "  return 1 / 0\n",
               "reward function compute_score (raises.py) raised ZeroDivisionError: division "
               "by zero (raises.py:2) on row 0"),
}


def _args(tmp_path, name, *more):
  return ["--config", TINY, f"--config.trainer.run_dir={tmp_path}/run",
          f"--config.reward.custom_fn.path={tmp_path}/{name}.py", "--config.reward.timeout_s=3",
          *STEPS, *more]


@pytest.mark.parametrize("name", list(BODIES))
def test_user_reward_faults_are_one_line_and_exit_2(name, tmp_path, capsys):
  body, message = BODIES[name]
  (tmp_path / f"{name}.py").write_text(body)
  code = cli(_args(tmp_path, name))
  err = capsys.readouterr().err.strip()
  assert code == 2, err
  assert len(err.splitlines()) == 1 and err.startswith("error: ") and message in err, err


def test_checkpoints_before_a_dying_reward_are_kept_and_a_fixed_reward_resumes(tmp_path,
                                                                             capsys):
  body, _ = BODIES["exit_after_calls"]
  (tmp_path / "exit_after_calls.py").write_text(body)
  assert cli(_args(tmp_path, "exit_after_calls")) == 2  # dies in step 2's scoring
  capsys.readouterr()
  assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["1"]
  (tmp_path / "exit_after_calls.py").write_text(HEAD + "  return 1.0\n")
  assert cli(_args(tmp_path, "exit_after_calls")) == 0
  assert "resumed from step 1" in capsys.readouterr().out
  assert sorted(os.listdir(tmp_path / "run" / "checkpoints"))[-1] == "2"


def test_through_python_m_hflax_launch_the_status_is_2_not_0(tmp_path):
  body, message = BODIES["exit_after_calls"]
  (tmp_path / "exit_after_calls.py").write_text(body)
  env = {**os.environ, "PYTHONPATH": ROOT}
  done = subprocess.run([sys.executable, "-m", "hflax.launch", *_args(tmp_path, "exit_after_calls")],
                        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
  assert done.returncode == 2, done.stderr
  assert done.stderr.strip().splitlines()[-1] == f"error: {message}"


MEMORY_BOMB = (CALLS + HEAD + "  CALLS[0] += 1\n  if CALLS[0] > 10:  # step 2's scoring\n"
               "    hoard = []\n    while True:\n      hoard.append(bytearray(64 * 2**20))\n"
               "  return 1.0\n")


def test_a_reward_allocating_without_bound_stops_at_its_memory_limit_then_resumes(tmp_path):
  """Through python -m hflax.launch: the worker's address-space limit
  (reward.memory_limit_gb) turns the blow-up into one line naming the function and file,
  exit 2, checkpoint 1 intact; the same command with a fixed reward resumes from it."""
  (tmp_path / "memory_bomb.py").write_text(MEMORY_BOMB)
  env = {**os.environ, "PYTHONPATH": ROOT}
  command = [sys.executable, "-m", "hflax.launch", *_args(tmp_path, "memory_bomb"),
             "--config.reward.memory_limit_gb=0.5", "--config.reward.timeout_s=120",
             "--config.trainer.export_hf=False"]
  done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 2, done.stderr
  assert "Traceback" not in done.stderr, done.stderr
  last = done.stderr.strip().splitlines()[-1]
  assert last.startswith("error: reward function compute_score (memory_bomb.py) raised "
                         "MemoryError (memory_bomb.py:"), last
  assert last.endswith("over its worker's memory limit, reward.memory_limit_gb=0.5 on row 2"), last
  assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["1"]
  (tmp_path / "memory_bomb.py").write_text(HEAD + "  return 1.0\n")
  done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True,
                        timeout=600)
  assert done.returncode == 0, done.stderr
  assert "resumed from step 1" in done.stdout, done.stdout
  assert sorted(os.listdir(tmp_path / "run" / "checkpoints"))[-1] == "2"


def test_memory_limit_gb_is_checked(tmp_path, capsys):
  for bad in ("-1", "0.1", "nan", "inf"):
    code = cli(["--config", TINY, f"--config.trainer.run_dir={tmp_path}/run",
                f"--config.reward.memory_limit_gb={bad}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, err
    assert "error: config.reward.memory_limit_gb: must be " in err, err
