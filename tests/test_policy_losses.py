"""CISPO, SAPO and GMPO against hand computations of their papers' formulas: per-token
values, metrics, gradients (through every aggregation mode), masks, the on-policy case;
their registry names and defaults, config validation, and the launcher's config path."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from ml_collections import FrozenConfigDict

from hflax import algorithms as A
from hflax.launch.config import base_config, validate

from test_algorithms_losses import ATOL, MASK, B, T  # the same masks as the older losses


def _data(seed=0, per_sequence=False):
  rng = np.random.default_rng(seed)
  old = rng.normal(-1.5, 0.5, size=(B, T)).astype(np.float32)
  # Log-ratios up to +-0.6: past every clip bound used here, and inside them.
  logp = (old + rng.uniform(-0.6, 0.6, size=(B, T))).astype(np.float32)
  adv = rng.normal(size=(B, 1) if per_sequence else (B, T)).astype(np.float32)
  return logp, old, np.broadcast_to(adv, (B, T)).copy()


def _sigmoid(x):
  return 1.0 / (1.0 + math.exp(-x))


def agg_coefficients(mask, mode):
  """d aggregate_loss / d loss[b, t], by hand: what each mode weighs a token with."""
  lengths = mask.sum(-1)
  rows = (lengths > 0).sum()
  per_token = {"token-mean": np.full(B, 1.0 / mask.sum()),
               "seq-mean-token-sum": np.full(B, 1.0 / rows),
               "seq-mean-token-mean": 1.0 / (rows * np.maximum(lengths, 1)),
               "seq-mean-token-sum-norm": np.full(B, 1.0 / (rows * T))}[mode]
  return per_token[:, None] * mask


def check_through_aggregation(loss_fn, logp, want_loss_BxT, want_grad_of_token_loss):
  """Every mode: the aggregate equals sum(coefficient * hand loss) and its gradient the
  hand-derived one. want_grad_of_token_loss(coef_BxT) -> d aggregate / d log_probs."""
  for mode in A.LOSS_AGG_MODES:
    coef = agg_coefficients(MASK, mode)
    value, grad = jax.value_and_grad(
        lambda lp: A.aggregate_loss(loss_fn(lp)[0], MASK, mode))(jnp.asarray(logp))
    np.testing.assert_allclose(value, np.sum(coef * want_loss_BxT), atol=ATOL, err_msg=mode)
    np.testing.assert_allclose(grad, want_grad_of_token_loss(coef), rtol=1e-4, atol=1e-7,
                               err_msg=mode)


def check_masked_tokens_ignored(loss_fn, logp, old, adv):
  """Garbage outside the mask changes nothing: loss, metrics, gradient."""
  off = MASK == 0
  wild = [np.where(off, 7.0, x).astype(np.float32) for x in (logp, old)]
  wild_adv = np.where(off, -50.0, adv).astype(np.float32)
  for args in ((wild[0], old, adv), (logp, wild[1], adv), (logp, old, wild_adv)):
    loss, metrics = loss_fn(*args)
    clean, clean_metrics = loss_fn(logp, old, adv)
    assert np.all(np.asarray(loss)[off] == 0.0)
    np.testing.assert_allclose(loss, clean, atol=1e-6)
    for k in clean_metrics:
      np.testing.assert_allclose(metrics[k], clean_metrics[k], atol=1e-6, err_msg=k)
    grad = jax.grad(lambda lp: jnp.sum(loss_fn(lp, *args[1:])[0]))(jnp.asarray(args[0]))
    assert np.all(np.asarray(grad)[off] == 0.0)


# -- CISPO ---------------------------------------------------------------------------------

@pytest.mark.parametrize("low,high", [(1.0, 0.2), (0.2, 0.28), (0.1, 0.05)])
def test_cispo_against_the_paper(low, high):
  logp, old, adv = _data(0)
  loss_fn = lambda lp, o=old, a=adv: A.cispo_loss(lp, o, a, MASK, clip_ratio_low=low,
                                                  clip_ratio_high=high)
  loss, metrics = loss_fn(logp)
  want, weight = np.zeros((B, T)), np.zeros((B, T))
  clipped = kl = 0.0
  for b, t in zip(*np.nonzero(MASK)):
    ratio = math.exp(logp[b, t] - old[b, t])
    weight[b, t] = min(max(ratio, 1 - low), 1 + high)  # clip(r, 1 - eps_low, 1 + eps_high)
    want[b, t] = -weight[b, t] * adv[b, t] * logp[b, t]  # -sg(r_hat) * A * log pi
    clipped += weight[b, t] != ratio
    kl += old[b, t] - logp[b, t]
  n = MASK.sum()
  np.testing.assert_allclose(loss, want, atol=ATOL)
  np.testing.assert_allclose(metrics["pg_clipfrac"], clipped / n, atol=1e-6)
  np.testing.assert_allclose(metrics["ppo_kl"], kl / n, atol=1e-6)
  assert float(metrics["pg_clipfrac_lower"]) == 0.0
  if low < 1:
    assert 0 < clipped < n
  # Stop-gradient on the weight: d/d log pi of -w A log pi is -w A, clipped tokens included
  # (capped, never zeroed as PPO's are).
  check_through_aggregation(loss_fn, logp, want, lambda coef: -coef * weight * adv)
  check_masked_tokens_ignored(
      lambda lp, o, a: A.cispo_loss(lp, o, a, MASK, clip_ratio_low=low, clip_ratio_high=high),
      logp, old, adv)


def test_cispo_without_lower_bound_keeps_small_weights():
  # The paper's setting (eps_low large): a ratio of 0.1 keeps its weight 0.1.
  lp, old = np.log([[0.1, 5.0]]).astype(np.float32), np.zeros((1, 2), np.float32)
  adv, mask = np.array([[1.0, 1.0]], np.float32), np.ones((1, 2), np.float32)
  grad = jax.grad(lambda x: jnp.sum(A.cispo_loss(x, old, adv, mask, clip_ratio_low=1.0,
                                                 clip_ratio_high=0.2)[0]))(jnp.asarray(lp))
  np.testing.assert_allclose(grad, [[-0.1, -1.2]], rtol=1e-5)


# -- SAPO ----------------------------------------------------------------------------------

@pytest.mark.parametrize("tau_pos,tau_neg", [(1.0, 1.05), (2.0, 4.0), (0.5, 0.5)])
def test_sapo_against_the_paper(tau_pos, tau_neg):
  logp, old, adv = _data(1)
  loss_fn = lambda lp, o=old, a=adv: A.sapo_loss(lp, o, a, MASK, tau_pos=tau_pos,
                                                 tau_neg=tau_neg)
  loss, metrics = loss_fn(logp)
  want, dgate = np.zeros((B, T)), np.zeros((B, T))
  for b, t in zip(*np.nonzero(MASK)):
    ratio = math.exp(logp[b, t] - old[b, t])
    tau = tau_pos if adv[b, t] > 0 else tau_neg
    s = _sigmoid(tau * (ratio - 1))
    want[b, t] = -(4 / tau) * s * adv[b, t]  # -f(r) A, f(r) = sigmoid(tau (r - 1)) 4 / tau
    dgate[b, t] = 4 * s * (1 - s) * ratio  # d f / d log pi = (4 / tau) tau s (1 - s) r
  np.testing.assert_allclose(loss, want, atol=ATOL)
  np.testing.assert_allclose(metrics["ppo_kl"], np.sum((old - logp) * MASK) / MASK.sum(),
                             atol=1e-6)
  assert float(metrics["pg_clipfrac"]) == float(metrics["pg_clipfrac_lower"]) == 0.0
  check_through_aggregation(loss_fn, logp, want, lambda coef: -coef * dgate * adv)
  check_masked_tokens_ignored(
      lambda lp, o, a: A.sapo_loss(lp, o, a, MASK, tau_pos=tau_pos, tau_neg=tau_neg),
      logp, old, adv)


def test_sapo_gate_is_soft_and_temperature_sharpens_it():
  # d loss / d log pi = -w r A with w = 4 s (1 - s), where PPO's unclipped term has w = 1:
  # w is 1 at r = 1, below 1 away from it, and lower for the larger temperature (tau_neg).
  old, mask = np.zeros((1, 1), np.float32), np.ones((1, 1), np.float32)

  def weight(ratio, a, tau_pos=1.0, tau_neg=3.0):
    lp = jnp.log(jnp.array([[ratio]], jnp.float32))
    grad = jax.grad(lambda x: jnp.sum(A.sapo_loss(
        x, old, np.array([[a]], np.float32), mask, tau_pos=tau_pos, tau_neg=tau_neg)[0]))(lp)
    return float(grad[0, 0]) / (-a * ratio)

  assert weight(1.0, 1.0) == pytest.approx(1.0, rel=1e-6)
  assert weight(1.0, -1.0) == pytest.approx(1.0, rel=1e-6)
  assert weight(1.2, 1.0) == pytest.approx(4 * _sigmoid(0.2) * (1 - _sigmoid(0.2)), rel=1e-5)
  assert 0 < weight(2.0, 1.0) < weight(1.2, 1.0) < 1 and 0 < weight(0.5, 1.0) < 1
  assert weight(2.0, -1.0) < weight(2.0, 1.0)  # tau_neg = 3 > tau_pos = 1
  assert weight(20.0, 1.0) < 1e-6  # far off-policy: almost no gradient, yet no hard edge


# -- GMPO ----------------------------------------------------------------------------------

def ref_gmpo(logp, old, adv, low, high):
  """Per sequence: -A_i * (prod_t r_hat_t)^(1/|o_i|), r_hat_t = min(r, clip(r, e^-low,
  e^high)) for A_i > 0, max(...) otherwise; returns loss per token, d loss_i / d log pi_t,
  the clipped token mask."""
  loss, dloss, clipped = np.zeros((B, T)), np.zeros((B, T)), np.zeros((B, T), bool)
  for b in range(B):
    cells = [t for t in range(T) if MASK[b, t]]
    if not cells:
      continue
    a = sum(float(adv[b, t]) for t in cells) / len(cells)
    product, free = 1.0, []
    for t in cells:
      ratio = math.exp(logp[b, t] - old[b, t])
      bounded = min(max(ratio, math.exp(-low)), math.exp(high))
      r_hat = min(ratio, bounded) if a > 0 else max(ratio, bounded)
      clipped[b, t] = r_hat != ratio
      if not clipped[b, t]:
        free.append(t)
      product *= r_hat
    seq_ratio = product ** (1.0 / len(cells))
    for t in cells:
      loss[b, t] = -a * seq_ratio
    for t in free:  # d/d log pi_t of -a exp(mean_t log r_hat) where r_hat_t = r_t
      dloss[b, t] = -a * seq_ratio / len(cells)
  return loss, dloss, clipped


@pytest.mark.parametrize("low,high", [(0.4, 0.4), (0.2, 0.3), (1.0, 0.1)])
def test_gmpo_against_the_paper(low, high):
  logp, old, adv = _data(2, per_sequence=True)
  loss_fn = lambda lp, o=old, a=adv: A.gmpo_loss(lp, o, a, MASK, clip_ratio_low=low,
                                                 clip_ratio_high=high)
  loss, metrics = loss_fn(logp)
  want, dloss, clipped = ref_gmpo(logp, old, adv, low, high)
  np.testing.assert_allclose(loss, want, atol=ATOL)
  np.testing.assert_allclose(metrics["pg_clipfrac"], clipped.sum() / MASK.sum(), atol=1e-6)
  np.testing.assert_allclose(metrics["ppo_kl"], np.sum((old - logp) * MASK) / MASK.sum(),
                             atol=1e-6)
  if (low, high) == (0.2, 0.3):
    assert 0 < clipped.sum() < MASK.sum()
  # seq-mean-token-mean is the paper's mean over sequences.
  rows = [b for b in range(B) if MASK[b].any()]
  np.testing.assert_allclose(A.aggregate_loss(loss, MASK, "seq-mean-token-mean"),
                             np.mean([want[b, np.nonzero(MASK[b])[0][0]] for b in rows]),
                             atol=ATOL)
  # Every valid token carries its sequence's loss: the aggregate's gradient through a
  # token is the row's total coefficient times d loss_i / d log pi_t.
  check_through_aggregation(loss_fn, logp, want,
                            lambda coef: coef.sum(-1, keepdims=True) * dloss)
  check_masked_tokens_ignored(
      lambda lp, o, a: A.gmpo_loss(lp, o, a, MASK, clip_ratio_low=low, clip_ratio_high=high),
      logp, old, adv)


def test_gmpo_geometric_mean_resists_an_outlier_token():
  # One token's ratio of 20 would make an arithmetic mean of the ratios 5.75; GMPO's
  # geometric mean of ratios clipped in log space stays within e^(high / 4) of 1 here.
  lp = np.log([[20.0, 1.0, 1.0, 1.0]]).astype(np.float32)
  zeros, ones = np.zeros((1, 4), np.float32), np.ones((1, 4), np.float32)
  loss, metrics = A.gmpo_loss(lp, zeros, ones, ones, clip_ratio_low=0.4, clip_ratio_high=0.4)
  np.testing.assert_allclose(loss, -math.exp(0.4 / 4) * ones, rtol=1e-6)
  assert float(metrics["pg_clipfrac"]) == 0.25


# -- the on-policy step --------------------------------------------------------------------

@pytest.mark.parametrize("name", ["cispo", "sapo", "gmpo"])
def test_on_policy_gradient_is_reinforce(name):
  # ratio 1: every loss's gradient is the REINFORCE / PPO one, -A per token weighted by the
  # aggregation (GMPO with a sequence's advantage, as it averages A over the sequence).
  _, old, adv = _data(3, per_sequence=name == "gmpo")
  fields = lambda lp: {"log_probs": lp, "old_log_probs": old, "advantages": adv,
                       "response_mask": MASK}
  loss, metrics = jax.jit(lambda b: A.get_policy_loss(name)(b, {}))(fields(old))
  assert float(metrics["ppo_kl"]) == 0.0 and float(metrics["pg_clipfrac"]) == 0.0
  want_value = {"cispo": -adv * old,  # -1 * A * log pi: REINFORCE's surrogate
                "sapo": -adv * 2 / np.where(adv > 0, 1.0, 1.05),  # -f(1) A = -2 A / tau
                "gmpo": -adv}[name]  # -A * 1: PPO's value
  np.testing.assert_allclose(loss, want_value * MASK, atol=1e-6)
  for mode in A.LOSS_AGG_MODES:
    if name == "gmpo" and mode != "seq-mean-token-mean":
      continue  # GMPO's objective is a mean over sequences (the config insists on it)
    grad = jax.grad(lambda lp: A.aggregate_loss(
        A.get_policy_loss(name)(fields(lp), {})[0], MASK, mode))(jnp.asarray(old))
    ppo = jax.grad(lambda lp: A.aggregate_loss(
        A.get_policy_loss("ppo")(fields(lp), {})[0], MASK, mode))(jnp.asarray(old))
    np.testing.assert_allclose(grad, ppo, rtol=1e-5, atol=1e-7, err_msg=mode)
    np.testing.assert_allclose(grad, -agg_coefficients(MASK, mode) * adv, rtol=1e-5,
                               atol=1e-7, err_msg=mode)


# -- registry, config, launcher ------------------------------------------------------------

def test_registry_names_and_config_defaults():
  assert {"cispo", "sapo", "gmpo", "geo_mean"} <= set(A.policy_loss_names())
  logp, old, adv = _data(4, per_sequence=True)
  batch = {"log_probs": logp, "old_log_probs": old, "advantages": adv, "response_mask": MASK}
  actor = base_config().actor  # clip_ratio_low / high unset: each loss's own defaults
  expected = {
      "cispo": A.cispo_loss(logp, old, adv, MASK, clip_ratio_low=1.0, clip_ratio_high=0.2),
      "sapo": A.sapo_loss(logp, old, adv, MASK, tau_pos=1.0, tau_neg=1.05),
      "gmpo": A.gmpo_loss(logp, old, adv, MASK, clip_ratio_low=0.4, clip_ratio_high=0.4),
      "geo_mean": A.gmpo_loss(logp, old, adv, MASK, clip_ratio_low=0.4, clip_ratio_high=0.4),
  }
  for name, (want, _) in expected.items():
    loss, metrics = jax.jit(lambda b, name=name: A.get_policy_loss(name)(b, actor))(batch)
    np.testing.assert_allclose(loss, want, atol=1e-6, err_msg=name)
    assert set(metrics) == {"pg_clipfrac", "pg_clipfrac_lower", "ppo_kl"}
  # Set fields reach the losses.
  cfg = {"clip_ratio_low": 0.1, "clip_ratio_high": 0.05, "tau_pos": 2.0, "tau_neg": 3.0}
  for name, want in (
      ("cispo", A.cispo_loss(logp, old, adv, MASK, clip_ratio_low=0.1, clip_ratio_high=0.05)),
      ("sapo", A.sapo_loss(logp, old, adv, MASK, tau_pos=2.0, tau_neg=3.0)),
      ("gmpo", A.gmpo_loss(logp, old, adv, MASK, clip_ratio_low=0.1, clip_ratio_high=0.05))):
    np.testing.assert_allclose(A.get_policy_loss(name)(batch, cfg)[0], want[0], atol=1e-6)
  # CISPO's upper bound follows clip_ratio when clip_ratio_high is unset.
  np.testing.assert_allclose(
      A.get_policy_loss("cispo")(batch, {"clip_ratio": 0.3})[0],
      A.cispo_loss(logp, old, adv, MASK, clip_ratio_low=1.0, clip_ratio_high=0.3)[0], atol=1e-6)


@pytest.mark.parametrize("settings,message", [
    ({"policy_loss": "gmpo"}, "config.actor.loss_agg_mode: 'token-mean' with policy_loss='gmpo'"),
    ({"policy_loss": "geo_mean", "loss_agg_mode": "seq-mean-token-sum-norm"},
     "config.actor.loss_agg_mode: 'seq-mean-token-sum-norm' with policy_loss='geo_mean'"),
    ({"policy_loss": "sapo", "tau_pos": 0.0}, "config.actor.tau_pos: must be a finite number > 0"),
    ({"policy_loss": "sapo", "tau_neg": -1.0}, "config.actor.tau_neg: must be a finite number > 0"),
    ({"policy_loss": "cispo", "clip_ratio_low": 1.5}, "config.actor.clip_ratio_low: CISPO"),
    ({"policy_loss": "cispo", "clip_ratio_high": 0.0}, "config.actor.clip_ratio_high: must be > 0"),
    ({"policy_loss": "cispoo"}, "config.actor.policy_loss: 'cispoo' is not one of"),
])
def test_config_refuses_bad_loss_parameters(settings, message):
  c = base_config()
  c.actor.update(settings)
  with pytest.raises(ValueError, match=message) as error:
    validate(c)
  assert "\n" not in str(error.value)


@pytest.mark.parametrize("settings", [
    {"policy_loss": "cispo"}, {"policy_loss": "cispo", "clip_ratio_low": 1.0},
    {"policy_loss": "sapo", "tau_pos": 0.5, "tau_neg": 2.0},
    {"policy_loss": "gmpo", "loss_agg_mode": "seq-mean-token-mean"},
    {"policy_loss": "sapo", "loss_agg_mode": "seq-mean-token-sum-norm"}])
def test_config_accepts_the_losses(settings):
  c = base_config()
  c.actor.update(settings)
  validate(c)


def test_launcher_builds_the_cispo_objective_from_verl_names():
  """The launch path without training: verl's command-line names -> validated config ->
  the actor's TrainPlan -> the objective its worker differentiates."""
  from hflax.algorithms.objectives import actor_loss
  from hflax.launch.cli import load_config
  from hflax.launch.roles import _train
  c = load_config(["--config", "grpo.py", "actor_rollout_ref.actor.policy_loss.loss_mode=cispo",
                   "actor_rollout_ref.actor.clip_ratio_high=0.3",
                   "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
                   "algorithm.norm_adv_by_std_in_grpo=False"])
  validate(c)
  assert c.actor.policy_loss == "cispo"
  plan = _train(c.actor, c.rollout.n, c.model)
  loss = actor_loss(plan.loss)
  logp, old, adv = _data(5)
  fields = {"old_log_probs": old, "advantages": adv, "response_mask": MASK,
            "ref_log_prob": old}
  total, metrics = jax.jit(lambda lp: loss(lp, jnp.zeros((B, T)), fields))(jnp.asarray(logp))
  # CISPO with the paper's open lower bound and the command line's upper one, summed per
  # sequence over the constant horizon (Dr. GRPO's aggregation).
  per_token, _ = A.cispo_loss(logp, old, adv, MASK, clip_ratio_low=1.0, clip_ratio_high=0.3)
  pg_loss = A.aggregate_loss(per_token, MASK, "seq-mean-token-sum-norm")
  np.testing.assert_allclose(metrics["pg_loss"], pg_loss, atol=1e-6)
  kl = c.actor.kl_loss_coef * metrics["kl_loss"] if c.actor.use_kl_loss else 0.0
  np.testing.assert_allclose(total, pg_loss + kl, atol=1e-6)


def test_dr_grpo_lines_of_the_docs_validate_and_mean_what_they_say():
  """docs/losses.md's Dr. GRPO command line: no std in the advantage, each sequence's
  summed loss over the constant response width."""
  import pathlib
  import shlex
  from hflax.algorithms.objectives import actor_loss
  from hflax.launch.cli import load_config
  text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "losses.md").read_text()
  block = text.split("## Dr. GRPO")[1].split("```bash\n")[1].split("```")[0]
  argv = shlex.split(block.replace("\\\n", " "))
  assert argv[:3] == ["python", "-m", "hflax.launch"]
  c = load_config(argv[3:])
  validate(c)
  assert not c.algorithm.norm_adv_by_std_in_grpo and not c.actor.use_kl_loss
  # Outcome rewards on each row's last valid token (row 3 is empty: its score is 0).
  scores = np.array([1.0, 0.0, 0.0, 0.0, 1.0], np.float32)
  last = np.maximum(MASK.sum(-1).astype(int) - 1, 0)
  rewards = np.zeros((B, T), np.float32)
  rewards[np.arange(B), last] = scores
  adv, _ = A.get_advantage_estimator(c.algorithm.adv_estimator)(
      {"token_level_rewards": rewards * MASK, "response_mask": MASK,
       "group_ids": np.array([0, 0, 0, 1, 1])},
      {"norm_adv_by_std_in_grpo": c.algorithm.norm_adv_by_std_in_grpo, "num_groups": 2})
  # R - mean(group), no division by the group's std (which is 0.577 and 0.707 here).
  want_adv = np.array([2 / 3, -1 / 3, -1 / 3, -0.5, 0.5], np.float32)[:, None] * MASK
  np.testing.assert_allclose(adv, want_adv, atol=1e-6)
  logp, old, _ = _data(6)
  total, _ = actor_loss(FrozenConfigDict(c.actor))(
      jnp.asarray(logp), jnp.zeros((B, T)),
      {"old_log_probs": old, "advantages": adv, "response_mask": MASK})
  per_token, _ = A.ppo_clip_loss(logp, old, adv, MASK, clip_ratio=0.2, clip_ratio_c=3.0)
  rows = [b for b in range(B) if MASK[b].any()]
  np.testing.assert_allclose(total, np.mean([per_token[b].sum() / T for b in rows]), atol=1e-6)
