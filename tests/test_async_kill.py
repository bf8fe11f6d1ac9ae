"""kill -9 of python -m hflax.launch in the asynchronous modes, then the same command again.

one_step_off: its schedule does not depend on timing and a checkpoint holds the pending
batch, so the resumed run's metrics (less timings) and exported weights equal an
uninterrupted run's. async: a checkpoint holds every untrained group (hflax.rollout.stream),
so every trajectory that had finished when the checkpoint was written is trained by the
resumed run (or dropped by the bound, and counted), none of its tokens changed; every one
in flight is continued from the tokens it had (not regenerated: its text and their
versions kept); and no trained token lags more than trainer.max_staleness versions."""
import json
import os
import signal
import subprocess
import sys

import numpy as np

from hflax.checkpoint import Checkpointer
from hflax.launch.config import tokenizer_spec
from hflax.models.tokenizer import load_tokenizer
from test_interrupt_resume import ENV, TINY, _logged, _md5s, _records, _wait
from tiny_config import get_config as tiny_config

STEPS = 6  # tiny_config saves every 2 steps
# async: three batches of groups in the pipeline, so a checkpoint holds finished ones
BOUND = 2


def _command(run_dir, *extra, steps=STEPS):
  return [sys.executable, "-m", "hflax.launch", "--config", TINY,
          f"--config.trainer.run_dir={run_dir}", f"--config.trainer.total_steps={steps}",
          *extra]


def _kill_after_step(command, run_dir, cwd, step):
  """Starts the launcher and SIGKILLs it once `step` is logged (the next step running)."""
  proc = subprocess.Popen(command, env=ENV, cwd=cwd, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True)
  _wait(proc, lambda: _logged(run_dir) >= step, f"step {step} logged")
  proc.send_signal(signal.SIGKILL)
  proc.communicate(timeout=60)
  assert proc.returncode == -signal.SIGKILL


def _finish(command, cwd):
  done = subprocess.run(command, env=ENV, cwd=cwd, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr
  return done


def test_one_step_off_killed_then_resumed_equals_uninterrupted(tmp_path):
  """Killed in step 4 of 4: the checkpoint of step 2 holds step 3's pre-generated batch,
  and the resumed run retrains steps 3 and 4 to the uninterrupted run's weights."""
  mode = ("--config.trainer.mode=one_step_off", "--config.actor.optim.lr=0.003")
  straight = tmp_path / "straight" / "run"
  straight.parent.mkdir()
  _finish(_command(straight, *mode, steps=4), straight.parent)
  killed = tmp_path / "killed" / "run"
  killed.parent.mkdir()
  _kill_after_step(_command(killed, *mode, steps=4), killed, killed.parent, 3)
  assert not (killed / "hf_actor").exists()
  _finish(_command(killed, *mode, steps=4), killed.parent)
  assert _records(killed) == _records(straight)
  assert _md5s(killed / "hf_actor") == _md5s(straight / "hf_actor")


def test_async_killed_then_resumed_keeps_its_finished_trajectories(tmp_path):
  run_dir, dumps = tmp_path / "run", tmp_path / "rollouts"
  command = _command(run_dir, "--config.trainer.mode=async", f"--config.trainer.max_staleness={BOUND}",
                     "--config.trainer.async_decode_steps=4", "--config.actor.optim.lr=0.003",
                     # every submitted sample in a slot: groups finish ahead of their step
                     f"--config.rollout.max_num_seqs={(BOUND + 1) * 4 * 2}",
                     f"--config.trainer.rollout_data_dir={dumps}")
  _kill_after_step(command, run_dir, tmp_path, 3)
  ckpt = Checkpointer(str(run_dir / "checkpoints"), keep=None, save_every=2)
  saved = ckpt.latest_step()
  assert saved in (2, 4)
  stream = ckpt.restore(saved)[1]["pending"]["stream"]
  tokenizer = load_tokenizer(tokenizer_spec(tiny_config()))

  def text(tokens):
    return tokenizer.decode_rows(np.asarray([tokens]), np.ones((1, len(tokens)), bool))[0]
  # The groups the checkpoint holds finished: (dataset row, each sample's text and versions).
  finished = [(g["row_index"], sorted((text(d["token_ids"]), sorted(set(d["versions"])))
                                      for d in g["done"]))
              for g in stream["groups"] if all(d is not None for d in g["done"])]
  assert finished, "the checkpoint holds no finished untrained group: nothing was tested"
  # Samples in flight: (dataset row, the text and versions of the tokens saved).
  in_flight = [(g["row_index"], text(p["token_ids"]).rstrip("\ufffd"), set(p["versions"]))
               for g in stream["groups"] for p in g["partial"] if p is not None]
  assert any(min(v) < saved for _, _, v in in_flight), "no saved token older than the weights"
  _finish(command, tmp_path)

  records = _records(run_dir)
  assert sorted(records) == list(range(1, STEPS + 1))
  trained = {}  # (step, dataset row) -> its samples' (text, versions)
  for step in range(saved + 1, STEPS + 1):
    for line in open(dumps / f"{step}.jsonl"):
      row = json.loads(line)
      # The bound: this step's update starts from version step - 1.
      assert (step - 1) - row["rollout_version"] <= BOUND, (step, row)
      assert min(row["versions"]) == row["rollout_version"]
      trained.setdefault((step, row["row_index"]), []).append((row["output"], row["versions"]))
  kept = [(r, s) for r, s in finished
          if any(sorted(v) == s for (_, row), v in trained.items() if row == r)]
  dropped = records[STEPS]["async/dropped_groups_total"] - stream["dropped"]
  assert len(finished) - len(kept) <= dropped, (finished, trained)
  assert len(kept) >= 1
  # A resumed sample starts with its saved tokens' text and keeps their (older) versions:
  # regenerated, its tokens would all carry the restored weights' version or later.
  continued = [(r, t, v) for r, t, v in in_flight
               if any(row == r and out.startswith(t) and v <= set(versions)
                      for (_, row), samples in trained.items() for out, versions in samples)]
  groups_in_flight = {r for r, _, _ in in_flight}
  assert len(groups_in_flight - {r for r, _, _ in continued}) <= dropped, in_flight
  assert any(min(v) < saved for _, _, v in continued)
