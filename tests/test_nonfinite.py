"""A non-finite value stops the run loudly: the step and stage named, nothing of it saved
or exported, and a rerun continues from the last good checkpoint."""
import os

import jax.numpy as jnp
import pytest

from hflax import algorithms as alg
from hflax.launch.config import base_config
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
  c = base_config()
  c.algorithm.update(name="grpo", adv_estimator="nan_on_third_call")
  c.rollout.n = 2
  c.data.train_batch_size = 4
  c.actor.ppo_mini_batch_size = 2
  c.data.builtin.update(num_train=32, num_val=8)
  c.data.val_batch_size = 8
  c.model.builtin.update(hidden_size=32, intermediate_size=64, num_layers=1)
  c.trainer.update(total_steps=4, save_every=2, val_every=0, val_before_train=False,
                   devices=2, run_dir=str(tmp_path / "run"), log=("jsonl",), **trainer)
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
