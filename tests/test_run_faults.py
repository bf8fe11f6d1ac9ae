"""Faults during a run: a non-finite value stops it loudly (the step and stage named,
nothing of it saved or exported, a rerun continues from the last good checkpoint), and a
damaged checkpoint is skipped for the one before."""
import os

import jax.numpy as jnp
import numpy as np
import pytest

from hflax import algorithms as alg
from tiny_config import get_config as tiny_config
from hflax.launch.hooks import NonFinite
from hflax.launch.trainer import Trainer

CALLS = {"n": 0}


@alg.register_advantage_estimator("nan_on_third_call", override=True)
def _nan_on_third_call(batch, cfg):
  """GRPO's advantages, except that the third call (step 3) returns NaN."""
  CALLS["n"] += 1
  advantages, returns = alg.get_advantage_estimator("grpo")(batch, cfg)
  if CALLS["n"] == 3:
    advantages = advantages * jnp.nan
  return advantages, returns


def config(tmp_path, **trainer):
  c = tiny_config()  # tests/tiny_config.py: a small model, 4 prompts x 2 samples
  c.algorithm.adv_estimator = "nan_on_third_call"
  c.trainer.update(total_steps=4, run_dir=str(tmp_path / "run"), **trainer)
  return c


def test_a_nan_advantage_stops_the_run_before_it_is_saved_or_exported(tmp_path):
  CALLS["n"] = 0
  trainer = Trainer(config(tmp_path), log=lambda *_: None)
  with pytest.raises(NonFinite, match=r"step 3: critic/advantages/\w+ is nan \(advantage "
                                      r"stage\); nothing of this step was saved or exported, "
                                      r"the last checkpoint is step 2"):
    trainer.fit()
  assert trainer.ckpt.all_steps() == [2]
  assert not os.path.exists(tmp_path / "run" / "hf_actor")
  # The rerun continues from step 2 (the estimator is healthy again) and finishes.
  CALLS["n"] = 3
  again = Trainer(config(tmp_path), log=lambda *_: None)
  again.fit()
  assert again.ckpt.latest_step() == 4
  assert os.path.isdir(tmp_path / "run" / "hf_actor")


def test_the_cli_reports_it_in_one_line_with_status_2(tmp_path, capsys, monkeypatch):
  from hflax.launch import trainer as trainer_module
  from hflax.launch.__main__ import cli
  CALLS["n"] = 0
  c = config(tmp_path)
  monkeypatch.setattr(trainer_module, "validate", lambda cfg: None)  # the config is given
  monkeypatch.setattr("hflax.launch.__main__.load_config", lambda argv: c)
  assert cli([]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and err[0].startswith("error: step 3: critic/advantages/")


def _largest_data_file(step_dir):
  files = [os.path.join(d, f) for d, _, fs in os.walk(step_dir) for f in fs
           if os.sep + "host" + os.sep not in os.path.join(d, f) + os.sep]
  return max(files, key=os.path.getsize)


def test_a_flipped_checkpoint_is_skipped_and_the_run_ends_where_an_uninterrupted_one_does(
    tmp_path):
  """Step 4's arrays damaged on disk: the rerun warns, sets it aside, resumes from step 2
  and retrains 3 and 4 to the uninterrupted run's exported weights."""
  from safetensors.numpy import load_file

  def tiny(run):
    c = config(tmp_path)
    c.algorithm.adv_estimator = "grpo"
    c.trainer.update(run_dir=str(tmp_path / run), keep=None)
    return c
  Trainer(tiny("straight"), log=lambda *_: None).fit()
  Trainer(tiny("damaged"), log=lambda *_: None).fit()
  path = _largest_data_file(tmp_path / "damaged" / "checkpoints" / "4")
  data = bytearray(open(path, "rb").read())
  middle = len(data) // 2
  data[middle - 2048:middle + 2048] = bytes(b ^ 0xFF for b in data[middle - 2048:middle + 2048])
  open(path, "wb").write(bytes(data))
  lines = []
  again = Trainer(tiny("damaged"), log=lines.append)
  again.fit()
  assert any(line.startswith("warning: skipping checkpoint") and "/4" in line for line in lines)
  assert any("resumed from step 2" in line for line in lines)
  assert os.path.isdir(tmp_path / "damaged" / "checkpoints" / "4.corrupt")
  a = load_file(str(tmp_path / "straight" / "hf_actor" / "model.safetensors"))
  b = load_file(str(tmp_path / "damaged" / "hf_actor" / "model.safetensors"))
  assert a.keys() == b.keys()
  for name in a:
    np.testing.assert_array_equal(a[name], b[name])
