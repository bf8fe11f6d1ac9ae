"""Rollout correction (hflax.algorithms.correction) against hand computations in numpy,
its config checks, and its wiring into the actor's loss."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hflax.algorithms.correction import (RolloutCorrection, apply_correction, log_weights,
                                         mismatch_metrics, rejection_mask,
                                         staleness_histogram, truncated_weights)
from hflax.algorithms.objectives import actor_loss

# Two sequences: the first with 3 response tokens, the second with 2 (a pad at the end).
OLD = np.array([[-1.0, -0.5, -2.0], [-0.2, -3.0, -9.0]], np.float32)
ROLLOUT = np.array([[-1.5, -0.5, -0.4], [-0.2, -1.0, -1.0]], np.float32)
MASK = np.array([[1, 1, 1], [1, 1, 0]], np.float32)


def hand_log_w(level):
  token = (OLD - ROLLOUT) * MASK
  if level == "token":
    return token
  seq = token.sum(1)
  if level == "geometric":
    seq = seq / MASK.sum(1)
  return np.broadcast_to(seq[:, None], OLD.shape) * MASK


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_log_weights(level):
  np.testing.assert_allclose(log_weights(OLD, ROLLOUT, MASK, level), hand_log_w(level),
                             rtol=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_truncated_importance_weights(level):
  w = np.exp(hand_log_w(level))
  expected = np.minimum(w, 1.5) * MASK
  got = truncated_weights(OLD, ROLLOUT, MASK, level=level, threshold=1.5)
  np.testing.assert_allclose(got, expected, rtol=1e-6)
  # token level by hand: exp(.5) = 1.65 -> 1.5, exp(0) = 1, exp(-1.6) = 0.2019, exp(-2) ...
  if level == "token":
    np.testing.assert_allclose(got[0], [1.5, 1.0, np.exp(-1.6)], rtol=1e-6)
    np.testing.assert_allclose(got[1], [1.0, np.exp(-2.0), 0.0], rtol=1e-6)


@pytest.mark.parametrize("level", ["token", "sequence", "geometric"])
def test_masked_importance_sampling(level):
  w = np.exp(hand_log_w(level))
  expected = ((w >= 0.5) & (w <= 1.6)) * MASK
  got = rejection_mask(OLD, ROLLOUT, MASK, level=level, lower=0.5, upper=1.6)
  np.testing.assert_array_equal(got, expected)
  if level == "token":  # IcePop: 1.65 > 1.6 out, 0.20 < 0.5 out, exp(-2) out
    np.testing.assert_array_equal(got, [[0, 1, 0], [1, 0, 0]])


def test_mismatch_metrics():
  log_w = (OLD - ROLLOUT)[MASK > 0]
  w = np.exp(log_w)
  m = mismatch_metrics(OLD, ROLLOUT, MASK)
  np.testing.assert_allclose(m["rollout_corr/k3_kl"], np.mean(w - 1 - log_w), rtol=1e-6)
  np.testing.assert_allclose(m["rollout_corr/rollout_is_mean"], w.mean(), rtol=1e-6)
  np.testing.assert_allclose(m["rollout_corr/rollout_is_min"], w.min(), rtol=1e-6)
  np.testing.assert_allclose(m["rollout_corr/rollout_is_max"], w.max(), rtol=1e-6)
  # a micro-batch of padding only: on-policy values, nothing infinite
  empty = mismatch_metrics(OLD, ROLLOUT, np.zeros_like(MASK))
  assert all(np.isfinite(v) for v in jax.tree.leaves(empty))
  assert float(empty["rollout_corr/rollout_is_min"]) == 1.0


def test_apply_correction_tis_and_mis_together():
  loss = np.arange(6, dtype=np.float32).reshape(2, 3) + 1.0
  cfg = RolloutCorrection(rollout_is="token", rollout_is_threshold=1.5, rollout_rs="token",
                          rollout_rs_threshold=1.6, rollout_rs_threshold_lower=0.5)
  got, metrics = apply_correction(loss, OLD, ROLLOUT, MASK, cfg)
  w = np.exp((OLD - ROLLOUT) * MASK)
  keep = ((w >= 0.5) & (w <= 1.6)) * MASK
  np.testing.assert_allclose(got, loss * np.minimum(w, 1.5) * MASK * keep, rtol=1e-6)
  np.testing.assert_allclose(metrics["rollout_corr/rollout_rs_masked_fraction"], 3 / 5)


def test_on_policy_rows_are_untouched():
  loss = jnp.ones((2, 3))
  cfg = RolloutCorrection(rollout_is="sequence", rollout_rs="token")
  got, metrics = apply_correction(loss, OLD, OLD, MASK, cfg)
  np.testing.assert_array_equal(got, MASK)
  assert float(metrics["rollout_corr/k3_kl"]) == 0.0
  assert float(metrics["rollout_corr/rollout_rs_masked_fraction"]) == 0.0


def test_weights_carry_no_gradient():
  g = jax.grad(lambda old: truncated_weights(old, ROLLOUT, MASK, threshold=5.0).sum())(OLD)
  np.testing.assert_array_equal(g, np.zeros_like(OLD))


def test_staleness_histogram():
  h = staleness_histogram(np.array([5, 4, 4, 1, 5, 3]), 5, bins=3)
  # staleness 0, 1, 1, 4, 0, 2 -> bins 0: 2/6, 1: 2/6, 2+: 2/6
  np.testing.assert_allclose([h["rollout/staleness_0"], h["rollout/staleness_1"],
                              h["rollout/staleness_2+"]], [1 / 3, 1 / 3, 1 / 3])
  np.testing.assert_allclose(h["rollout/staleness_mean"], 8 / 6)
  assert float(h["rollout/staleness_max"]) == 4.0


@pytest.mark.parametrize("field,value", [
    ("rollout_is", "tokens"), ("rollout_rs", "seq"), ("rollout_is_threshold", 0.0),
    ("rollout_rs_threshold", -1.0), ("rollout_rs_threshold_lower", 3.0)])
def test_bad_settings_name_the_field(field, value):
  from hflax.launch.config import base_config, validate
  c = base_config()
  c.algorithm.rollout_correction[field] = value
  with pytest.raises(ValueError, match=rf"config.algorithm.rollout_correction.{field}:"):
    validate(c)


def test_actor_loss_applies_the_correction():
  """The actor's loss with correction: PPO's per-token loss times the TIS weights (the
  update's first mini-batch has ratio 1, so the loss is -A w token-mean)."""
  adv = np.array([[1.0, -1.0, 2.0], [0.5, 0.5, 0.0]], np.float32)
  fields = {"old_log_probs": OLD, "rollout_log_probs": ROLLOUT, "advantages": adv,
            "response_mask": MASK}
  cfg = {"policy_loss": "vanilla", "loss_agg_mode": "token-mean"}
  plain, _ = actor_loss(cfg)(OLD, np.zeros_like(OLD), fields)
  corrected, metrics = actor_loss(cfg, RolloutCorrection(rollout_is="token",
                                                         rollout_is_threshold=1.5))(
      OLD, np.zeros_like(OLD), fields)
  w = np.minimum(np.exp((OLD - ROLLOUT) * MASK), 1.5) * MASK
  np.testing.assert_allclose(plain, -(adv * MASK).sum() / MASK.sum(), rtol=1e-6)
  np.testing.assert_allclose(corrected, -(adv * w).sum() / MASK.sum(), rtol=1e-6)
  assert "rollout_corr/k3_kl" in metrics
