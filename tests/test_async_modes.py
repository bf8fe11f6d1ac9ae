"""trainer.mode = one_step_off (hflax.launch.modes) on the tiny GRPO config: its staleness-0
form is sync exactly, its batches lag one version and are corrected, and a run stopped
after a checkpoint resumes to the uninterrupted run's metrics and weights."""

import jax
import numpy as np
import pytest

from hflax.launch.config import validate
from hflax.launch.trainer import Trainer
from tiny_config import fit, mode_config, run_metrics as metrics
from trainer_hooks import Killed, kill_at


def config(tmp_path, run, mode="sync", **trainer):
  return mode_config(tmp_path, run, mode, **trainer)


def leaves(trainer):
  return [np.asarray(x) for x in jax.tree.leaves(trainer.roles.actor.params)]


def assert_same_run(a, b, ma, mb, steps):
  for x, y in zip(leaves(a), leaves(b)):
    np.testing.assert_array_equal(x, y)
  for step in steps:
    assert ma[step].keys() == mb[step].keys(), step
    for key in ma[step]:
      assert ma[step][key] == mb[step][key], (step, key)


def test_one_step_off_with_staleness_0_is_sync(tmp_path):
  sync = fit(config(tmp_path, "sync"))
  off = fit(config(tmp_path, "off", mode="one_step_off", max_staleness=0))
  assert_same_run(sync, off, metrics(tmp_path, "sync"), metrics(tmp_path, "off"), (1, 2, 3))


def test_one_step_off_batches_lag_one_version_and_are_corrected(tmp_path):
  c = config(tmp_path, "off", mode="one_step_off")
  c.actor.optim.lr = 3e-3  # updates large enough that one version's lag shows
  c.algorithm.rollout_correction.update(rollout_is="token", rollout_rs="token",
                                        rollout_rs_threshold=1.001)
  trainer = Trainer(c, log=lambda *_: None)
  versions = {}  # step -> the trained rows' rollout_version (the step's update made step)
  trainer.add_hook(lambda info: versions.update(
      {info.step: set(np.asarray(info.batch["rollout_version"]).tolist())}))
  trainer.fit()
  assert versions == {1: {0}, 2: {0}, 3: {1}}  # step k trains version k - 1 on version k - 2
  m = metrics(tmp_path, "off")
  assert m[1]["rollout/staleness_0"] == 1.0  # the first batch: sampled by the weights it trains
  assert m[1]["actor/rollout_corr/k3_kl"] < 1e-9
  assert m[1]["actor/rollout_corr/rollout_rs_masked_fraction"] == 0.0
  for step in (2, 3):  # then generated while the step before trained
    assert m[step]["rollout/staleness_1"] == 1.0 and m[step]["rollout/staleness_0"] == 0.0
    assert m[step]["rollout/staleness_max"] == 1.0
    for key in ("rollout_is_min", "rollout_is_mean", "rollout_is_max",
                "rollout_rs_masked_fraction"):
      assert np.isfinite(m[step][f"actor/rollout_corr/{key}"]), key
  # Step 1's update barely moves the policy (a fresh model's groups score alike, so its
  # advantages are ~0); step 2's does, and step 3's batch, sampled before it, shows it.
  assert m[3]["actor/rollout_corr/k3_kl"] > 1e-7
  assert m[3]["actor/rollout_corr/rollout_is_max"] > 1.001
  assert 0 < m[3]["actor/rollout_corr/rollout_rs_masked_fraction"] < 1


def test_one_step_off_resumes_to_the_uninterrupted_run(tmp_path):
  c = config(tmp_path, "straight", mode="one_step_off", total_steps=4)
  c.actor.optim.lr = 3e-3  # so that a batch sampled by other weights would show
  straight = fit(c)
  # Killed during step 3: the checkpoint of step 2 holds step 3's batch, sampled before
  # step 2's update, and the loader past its prompts.
  c.trainer.run_dir = str(tmp_path / "killed")
  killed = Trainer(c, log=lambda *_: None)
  killed.add_hook(kill_at(3))
  with pytest.raises(Killed):
    killed.fit()
  assert killed.ckpt.all_steps() == [2]
  resumed = fit(c)
  assert_same_run(straight, resumed, metrics(tmp_path, "straight"),
                  metrics(tmp_path, "killed"), (3, 4))
  assert metrics(tmp_path, "killed")[3]["rollout/staleness_1"] == 1.0
  # A finished run continued to more steps trains as one that had them from the start.
  c.trainer.update(run_dir=str(tmp_path / "extended"), total_steps=2)
  fit(c)
  c.trainer.total_steps = 4
  extended = fit(c)
  assert_same_run(straight, extended, metrics(tmp_path, "straight"),
                  metrics(tmp_path, "extended"), (3, 4))


@pytest.mark.parametrize("field,value,message", [
    ("trainer.mode", "fully_async", "config.trainer.mode: 'fully_async' is not one of"),
    ("trainer.max_staleness", 2, "config.trainer.max_staleness: one_step_off lags 1 version"),
    ("algorithm.name", "dapo", "config.trainer.mode: one_step_off pre-generates one batch")])
def test_bad_modes_name_the_field(tmp_path, field, value, message):
  c = config(tmp_path, "bad", mode="one_step_off")
  section, name = field.split(".")
  c[section][name] = value
  with pytest.raises(ValueError, match=message):
    validate(c)
