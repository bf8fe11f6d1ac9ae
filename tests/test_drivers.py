"""Every algorithm's driver runs full steps on a tiny model over 8 devices."""
import itertools
import math

import numpy as np
import pytest

from hflax.algorithms.drivers import get_algorithm, init_state
from hflax.algorithms.drivers.common import step_metrics, timed_roles
from hflax.launch.config import base_config, validate
from hflax.launch.roles import build_roles, policy_model, step_config
from hflax.models.tokenizer import ByteTokenizer
from ppo_step import prompts_batch

TOKENIZER = ByteTokenizer()
ALGORITHMS = {
    # An entropy bonus and the adaptive KL controller ride along on the PPO run.
    "ppo": dict(adv_estimator="gae", use_kl_in_reward=True, n=2, entropy_coeff=0.01,
                kl_ctrl=dict(type="adaptive", kl_coef=0.05, target_kl=0.1, horizon=32)),
    "grpo": dict(adv_estimator="grpo", use_kl_loss=True, n=4),
    "rloo": dict(adv_estimator="rloo", n=4),
    "remax": dict(adv_estimator="remax", n=2),
    "reinforce_pp": dict(adv_estimator="reinforce_plus_plus", use_kl_in_reward=True, n=2),
    "dapo": dict(adv_estimator="grpo", n=4, policy_loss="clip_higher",
                 loss_agg_mode="token-mean", overlong_buffer_len=2),
    "safe_rlhf": dict(adv_estimator="gae", n=2),
}


def config(name, n=2, adv_estimator="gae", use_kl_loss=False, use_kl_in_reward=False,
           recompute_log_prob=False, entropy_coeff=0.0, kl_ctrl=None,
           policy_loss="vanilla", loss_agg_mode="token-mean", overlong_buffer_len=0,
           dtype="float32"):
  c = base_config()
  c.model.dtype = dtype
  c.actor.entropy_coeff = entropy_coeff
  c.algorithm.kl_ctrl.update(kl_ctrl or {})
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
    algorithm = get_algorithm(name)
    arg = prompts if algorithm.takes_prompt_iterator else next(prompts)
    batch = algorithm.step(roles, arg, step_config(c), state)
    # The trainer's batch statistics too (critic/advantages/mean, critic/vf_explained_var).
    step = {**batch.meta["metrics"], **step_metrics(batch, c.data.max_response_length)}
    history.append({**{k: float(v) for k, v in step.items()}, **metrics})
    state.step += 1
  return history, batch, state, roles


def assert_finite_and_on_policy(metrics):
  """Finite metrics, and the first mini-batch trains on exactly the rollout's log-probs."""
  assert all(math.isfinite(v) for v in metrics.values()), metrics
  assert metrics["actor/pg_clipfrac_first_minibatch"] == pytest.approx(0, abs=1e-6)
  assert metrics["actor/ppo_kl_first_minibatch"] == pytest.approx(0, abs=1e-6)


@pytest.mark.parametrize("name", [n for n in ALGORITHMS if n not in ("dapo", "safe_rlhf")])
def test_two_steps_with_finite_metrics(name):
  history, batch, _, roles = run(name)
  for metrics in history:
    assert_finite_and_on_policy(metrics)
    assert metrics["timing_s/gen"] > 0 and "actor/grad_norm" in metrics
  assert len(batch) == 8 * ALGORITHMS[name]["n"]
  if name == "grpo":
    assert "actor/kl_loss" in history[-1]
  if name in ("ppo", "reinforce_pp"):
    assert "actor/reward_kl_penalty" in history[-1]
  if name == "ppo":
    assert "critic/vf_loss" in history[-1] and "critic/vf_clipfrac" in history[-1]
    check_ppo_extras(history, batch, roles)
  if name == "remax":
    assert "reward_baselines" in batch


def check_ppo_extras(history, batch, roles):
  mask = np.asarray(batch["response_mask"], np.float64)
  adv, ret = (np.asarray(batch[k], np.float64) for k in ("advantages", "returns"))
  residual = ret - np.asarray(batch["values"], np.float64)
  var = lambda x: np.var(x[mask > 0], ddof=1)  # noqa: E731
  assert history[-1]["critic/advantages/mean"] == pytest.approx(adv[mask > 0].mean(), abs=1e-5)
  assert history[-1]["critic/vf_explained_var"] == pytest.approx(
      1 - var(residual) / (var(ret) + 1e-5), abs=1e-4)
  # Adaptive controller (Ziegler et al.): coef *= 1 + clip(kl / target - 1, +-0.2) * rows / horizon.
  coefs = [m["actor/reward_kl_penalty_coeff"] for m in history]
  error = np.clip(history[0]["actor/reward_kl_penalty"] / 0.1 - 1, -0.2, 0.2)
  assert coefs[0] == pytest.approx(0.05) and coefs[1] != pytest.approx(coefs[0])
  assert coefs[1] == pytest.approx(0.05 * (1 + error * len(batch) / 32), rel=1e-6)
  # The loss the actor differentiates carries the entropy bonus: pg_loss - coeff * entropy.
  fields = {k: batch[k] for k in ("response_mask", "old_log_probs", "advantages")}
  entropy = np.linspace(0.5, 2.0, mask.size, dtype=np.float32).reshape(mask.shape)
  total, parts = roles.actor.loss_fn(batch["old_log_probs"] - 0.1, entropy, fields)
  hand_entropy = (entropy * mask).sum() / mask.sum()
  assert float(parts["entropy"]) == pytest.approx(hand_entropy, rel=1e-6)
  assert float(total) == pytest.approx(float(parts["pg_loss"]) - 0.01 * hand_entropy, abs=1e-6)


def test_recomputed_old_log_probs_agree_with_the_rollout():
  """On-policy: the trainer's log-probs of the rollout equal the sampler's."""
  history, batch, _, roles = run("grpo", steps=1, recompute_log_prob=True)
  assert roles.actor.recompute_log_prob and "timing_s/old_log_prob" in history[0]
  np.testing.assert_allclose(np.asarray(batch["old_log_probs"]),
                             np.asarray(batch["rollout_log_probs"]), atol=2e-5)
  assert_finite_and_on_policy(history[0])


def test_bfloat16_compute_recomputes_old_log_probs_and_stays_on_policy():
  # The KV-cache decode and the teacher-forced pass round differently in bfloat16.
  history, _, _, roles = run("grpo", steps=1, dtype="bfloat16")
  assert roles.actor.recompute_log_prob and "timing_s/old_log_prob" in history[0]
  assert_finite_and_on_policy(history[0])


def test_entropy_bonus_is_aggregated_like_the_policy_loss():
  from hflax.algorithms.objectives import actor_loss
  mask = np.array([[1, 1, 0], [1, 0, 0]], np.float32)
  entropy = np.array([[1, 1, 0], [4, 0, 0]], np.float32)
  zeros = np.zeros_like(mask)
  fields = {"response_mask": mask, "old_log_probs": zeros, "advantages": zeros}
  for mode, want in (("token-mean", 6 / 3), ("seq-mean-token-mean", (1 + 4) / 2),
                     ("seq-mean-token-sum", (2 + 4) / 2)):
    total, parts = actor_loss({"loss_agg_mode": mode, "entropy_coeff": 0.5})(
        zeros, entropy, fields)
    assert float(parts["entropy"]) == pytest.approx(want), mode
    assert float(total) == pytest.approx(-0.5 * want), mode


def test_dapo_dynamic_sampling_fills_the_batch():
  history, batch, _, _ = run("dapo", reward_fn=constant_for_even_prompts)
  for metrics in history:
    assert_finite_and_on_policy(metrics)
  assert len(batch) == 8 * 4  # full batch of prompt groups
  # Every kept group has varied rewards before overlong shaping (all-correct groups whose
  # lengths differ carry no signal about correctness).
  raw = np.asarray(constant_for_even_prompts(batch))
  assert (raw.reshape(8, 4).max(1) > raw.reshape(8, 4).min(1)).all()
  assert max(m["train/num_gen_batches"] for m in history) >= 2  # dropped groups were refilled
  # Groups from several rounds keep distinct ids, so GRPO normalises within each group.
  np.testing.assert_array_equal(batch["group_ids"], np.repeat(np.arange(8), 4))
  scores = np.asarray(batch["token_level_scores"]).sum(1).reshape(8, 4)
  z = (scores - scores.mean(1, keepdims=True)) / (scores.std(1, ddof=1, keepdims=True) + 1e-6)
  mask = np.asarray(batch["response_mask"])
  np.testing.assert_allclose(np.asarray(batch["advantages"]), z.reshape(-1, 1) * mask,
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cost,moves", [(1.0, "up"), (0.0, "down")])
def test_safe_rlhf_lambda_follows_the_cost_constraint(cost, moves):
  history, _, state, _ = run("safe_rlhf", cost_fn=lambda b: np.full(len(b), cost))
  lambdas = [1.0] + [m["safe/lambda"] for m in history]
  for metrics in history:
    assert_finite_and_on_policy(metrics)
  steps = np.diff(lambdas)
  assert (steps > 0).all() if moves == "up" else (steps < 0).all()
