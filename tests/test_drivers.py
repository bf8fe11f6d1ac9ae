"""Every algorithm's driver runs full steps on a tiny model over 8 devices."""
import itertools
import math

import numpy as np
import pytest

from hflax.algorithms.drivers import DRIVERS, TAKES_PROMPT_ITERATOR, init_state
from hflax.algorithms.drivers.common import timed_roles
from hflax.launch.config import base_config, validate
from hflax.launch.roles import build_roles, policy_model
from hflax.models.tokenizer import ByteTokenizer
from ppo_step import prompts_batch

TOKENIZER = ByteTokenizer()
ALGORITHMS = {
    "ppo": dict(adv_estimator="gae", use_kl_in_reward=True, n=2),
    "grpo": dict(adv_estimator="grpo", use_kl_loss=True, n=4),
    "rloo": dict(adv_estimator="rloo", n=4),
    "remax": dict(adv_estimator="remax", n=2),
    "reinforce_pp": dict(adv_estimator="reinforce_plus_plus", use_kl_in_reward=True, n=2),
    "dapo": dict(adv_estimator="grpo", n=4, policy_loss="clip_higher",
                 loss_agg_mode="token-mean", overlong_buffer_len=2),
    "safe_rlhf": dict(adv_estimator="gae", n=2),
}


def config(name, n=2, adv_estimator="gae", use_kl_loss=False, use_kl_in_reward=False,
           recompute_log_prob=False,
           policy_loss="vanilla", loss_agg_mode="token-mean", overlong_buffer_len=0):
  c = base_config()
  c.algorithm.name, c.algorithm.adv_estimator = name, adv_estimator
  c.algorithm.use_kl_in_reward, c.algorithm.overlong_buffer_len = use_kl_in_reward, overlong_buffer_len
  c.actor.use_kl_loss, c.actor.policy_loss, c.actor.loss_agg_mode = use_kl_loss, policy_loss, loss_agg_mode
  c.rollout.n, c.actor.recompute_log_prob = n, bool(recompute_log_prob)
  c.data.train_batch_size, c.data.max_response_length = 8, 6
  c.actor.ppo_mini_batch_size = c.critic.ppo_mini_batch_size = 4
  c.actor.ppo_epochs = 2
  c.actor.optim.lr = c.critic.optim.lr = 1e-3
  c.rollout.generate_tensor = 2
  c.model.builtin.update(hidden_size=32, intermediate_size=64, num_layers=1)
  c.algorithm.cost_limit, c.algorithm.lambda_lr = 0.25, 0.5
  validate(c)
  return c


def parity_reward(batch):
  """1 per even response token, averaged: varies between samples of a prompt."""
  tokens, mask = batch["responses"], batch["response_mask"]
  return ((tokens % 2 == 0) * mask).sum(1) / np.maximum(mask.sum(1), 1)


def constant_for_even_prompts(batch):
  """Groups whose prompt starts with an even token all score 1: no signal for DAPO."""
  first = batch["prompts"][np.arange(len(batch)), np.argmax(batch["prompt_mask"], axis=1)]
  return np.where(first % 2 == 0, 1.0, parity_reward(batch))


def run(name, steps=2, reward_fn=parity_reward, cost_fn=None, **overrides):
  c = config(name, **{**ALGORITHMS[name], **overrides})
  policy = policy_model(c, TOKENIZER.vocab_size, TOKENIZER)
  metrics = {}
  roles = timed_roles(build_roles(c, policy, tokenizer=TOKENIZER, reward_fn=reward_fn,
                                  cost_fn=cost_fn), metrics)
  state = init_state(c.algorithm)
  prompts = (prompts_batch(c.data.train_batch_size, seed=s) for s in itertools.count())
  history = []
  for _ in range(steps):
    arg = prompts if name in TAKES_PROMPT_ITERATOR else next(prompts)
    batch = DRIVERS[name](roles, arg, c, state)
    history.append({**{k: float(v) for k, v in batch.meta["metrics"].items()}, **metrics})
    state.step += 1
  return history, batch, state, roles


@pytest.mark.parametrize("name", [n for n in ALGORITHMS if n not in ("dapo", "safe_rlhf")])
def test_two_steps_with_finite_metrics(name):
  history, batch, _, roles = run(name)
  for metrics in history:
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert metrics["actor/pg_clipfrac_first_minibatch"] == pytest.approx(0, abs=1e-6)
    assert metrics["actor/ppo_kl_first_minibatch"] == pytest.approx(0, abs=1e-6)
    assert metrics["timing_s/gen"] > 0 and "actor/grad_norm" in metrics
  assert len(batch) == 8 * ALGORITHMS[name]["n"]
  if name == "grpo":
    assert "actor/kl_loss" in history[-1]
  if name in ("ppo", "reinforce_pp"):
    assert "actor/reward_kl_penalty" in history[-1]
  if name == "ppo":
    assert "critic/vf_loss" in history[-1] and "critic/vf_clipfrac" in history[-1]
  if name == "remax":
    assert "reward_baselines" in batch


def test_recomputed_old_log_probs_agree_with_the_rollout():
  """On-policy: the trainer's log-probs of the rollout equal the sampler's."""
  history, batch, _, roles = run("grpo", steps=1, recompute_log_prob=True)
  assert roles.actor.recompute_log_prob and "timing_s/old_log_prob" in history[0]
  np.testing.assert_allclose(np.asarray(batch["old_log_probs"]),
                             np.asarray(batch["rollout_log_probs"]), atol=2e-5)
  assert history[0]["actor/ppo_kl_first_minibatch"] == pytest.approx(0, abs=1e-6)


def test_dapo_dynamic_sampling_fills_the_batch():
  history, batch, _, _ = run("dapo", reward_fn=constant_for_even_prompts)
  for metrics in history:
    assert all(math.isfinite(v) for v in metrics.values()), metrics
  assert len(batch) == 8 * 4  # full batch of prompt groups
  scores = np.asarray(batch["token_level_scores"]).sum(1).reshape(8, 4)
  assert (scores.max(1) > scores.min(1)).all()  # every kept group has varied rewards
  assert max(m["train/num_gen_batches"] for m in history) >= 2  # dropped groups were refilled


@pytest.mark.parametrize("cost,moves", [(1.0, "up"), (0.0, "down")])
def test_safe_rlhf_lambda_follows_the_cost_constraint(cost, moves):
  history, _, state, _ = run("safe_rlhf", cost_fn=lambda b: np.full(len(b), cost))
  lambdas = [1.0] + [m["safe/lambda"] for m in history]
  assert all(math.isfinite(v) for m in history for v in m.values())
  steps = np.diff(lambdas)
  assert (steps > 0).all() if moves == "up" else (steps < 0).all()
