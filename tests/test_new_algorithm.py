"""A new algorithm from test code alone: a driver and its description, registered by name,
runs through the main loop with the built-in side jobs and a hook of its own."""
import json

import jax.numpy as jnp
import pytest

from hflax.algorithms.drivers import Algorithm, register_algorithm, unregister_algorithm
from hflax.controller.batch import Batch
from hflax.launch.config import validate
from tiny_config import get_config as tiny_config
from hflax.launch.trainer import Trainer

SEEN = []


def mean_baseline_step(roles, prompts, cfg, state):
  """REINFORCE with the batch's mean score as the baseline: no reference, no critic."""
  actor = roles.actor
  batch = actor.generate_sequences(prompts)
  batch = batch.union(roles.reward.compute_reward(batch))
  batch = batch.union(actor.old_log_probs(batch))
  scores = batch["token_level_scores"].sum(axis=1)
  advantages = (scores - scores.mean())[:, None] * batch["response_mask"]
  batch = batch.union(Batch({"token_level_rewards": batch["token_level_scores"],
                             "advantages": advantages, "returns": advantages}))
  SEEN.append((state.step, len(batch), cfg.train_batch_size))
  return batch.union(actor.update_actor(batch))


def needs_two_samples(c, fail):
  if c.rollout.n < 2:
    fail("rollout.n", "mean_baseline compares samples: use n >= 2")


@pytest.fixture
def mean_baseline():
  register_algorithm(Algorithm(name="mean_baseline", step=mean_baseline_step,
                               check=needs_two_samples))
  yield
  unregister_algorithm("mean_baseline")


def config(tmp_path):
  c = tiny_config()  # tests/tiny_config.py: a small model, 4 prompts x 2 samples
  c.algorithm.update(name="mean_baseline", adv_estimator="grpo")
  c.actor.use_kl_loss = False
  c.trainer.update(total_steps=2, save_every=2, val_every=2, run_dir=str(tmp_path / "run"),
                   export_hf=False)
  return c


def test_a_registered_algorithm_runs_two_steps_through_the_main_loop(tmp_path, mean_baseline):
  SEEN.clear()
  trainer = Trainer(config(tmp_path), log=lambda *_: None)
  assert trainer.plan.placed_roles == ("actor",) and trainer.roles.critic is None
  hooked = []
  trainer.add_hook(lambda info: hooked.append((info.step, "actor/pg_loss" in info.metrics)),
                   every=1)
  result = trainer.fit()
  assert SEEN == [(0, 8, 4), (1, 8, 4)]  # the driver saw the step state and its own config
  assert hooked == [(1, True), (2, True)]
  assert result["after"] is not None  # validation ran at the last step
  rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  steps = [r["step"] for r in rows if "actor/pg_loss" in r]
  assert steps == [1, 2]
  assert all(jnp.isfinite(r["actor/pg_loss"]) for r in rows if "actor/pg_loss" in r)
  assert trainer.ckpt.latest_step() == 2


def test_its_config_check_runs_before_any_work(tmp_path, mean_baseline):
  c = config(tmp_path)
  c.rollout.n = 1
  with pytest.raises(ValueError, match="config.rollout.n: mean_baseline compares samples"):
    validate(c)


def test_an_unregistered_name_is_refused_with_the_registered_ones(tmp_path):
  c = config(tmp_path)
  with pytest.raises(ValueError, match=r"config.algorithm.name: 'mean_baseline' is not one of "
                                       r"\('dapo', 'grpo', 'ppo'"):
    validate(c)
