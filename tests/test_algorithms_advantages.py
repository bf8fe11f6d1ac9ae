"""Advantage estimators against plain-Python references written from verl's semantics."""
import math

import jax
import numpy as np
import pytest

from hflax import algorithms as A

ATOL = 1e-5

# Rows: varied lengths, a single-token response, a gap inside a response (a masked
# observation span), and a fully masked row.
MASK = np.array([[1, 1, 1, 1, 0],
                 [1, 1, 0, 0, 0],
                 [1, 0, 0, 0, 0],
                 [1, 1, 1, 1, 1],
                 [1, 1, 0, 1, 0],
                 [0, 0, 0, 0, 0],
                 [1, 1, 1, 0, 0]], np.float32)
# Group 0: varied scores; group 1: all equal; group 2: a single sample; group 3: two.
GROUP_IDS = np.array([0, 0, 0, 1, 1, 2, 3], np.int32)
NUM_GROUPS = 4


def _rewards(seed=0):
  rng = np.random.default_rng(seed)
  return (rng.normal(size=MASK.shape) * MASK).astype(np.float32)


def _outcome_rewards(scores):
  """Token rewards with each score on the last valid token (fully masked rows: none)."""
  rewards = np.zeros(MASK.shape, np.float32)
  for b in range(MASK.shape[0]):
    valid = [t for t in range(MASK.shape[1]) if MASK[b, t]]
    if valid:
      rewards[b, valid[-1]] = scores[b]
  return rewards


def ref_whiten(x, mask):
  vals = [x[b, t] for b in range(x.shape[0]) for t in range(x.shape[1]) if mask[b, t]]
  n = len(vals)
  mean = sum(vals) / max(n, 1)
  var = sum((v - mean) ** 2 for v in vals) / (n - 1) if n > 1 else 0.0
  return (x - mean) / math.sqrt(var + 1e-8) * mask


def ref_groups(scores, group_ids):
  groups = {}
  for i, g in enumerate(group_ids):
    groups.setdefault(int(g), []).append(float(scores[i]))
  return groups


def ref_gae(rewards, values, mask, gamma, lam):
  B, T = mask.shape
  adv = np.zeros((B, T))
  for b in range(B):
    next_value, last = 0.0, 0.0
    for t in reversed(range(T)):
      if mask[b, t]:
        last = rewards[b, t] + gamma * next_value - values[b, t] + gamma * lam * last
        next_value = values[b, t]
        adv[b, t] = last
  return ref_whiten(adv, mask), (adv + values) * mask


@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.9, 0.8)])
def test_gae(gamma, lam):
  rewards, values = _rewards(0), np.random.default_rng(1).normal(size=MASK.shape)
  values = values.astype(np.float32)
  adv, ret = A.gae_advantage(rewards, values, MASK, gamma, lam)
  want_adv, want_ret = ref_gae(rewards, values, MASK, gamma, lam)
  np.testing.assert_allclose(adv, want_adv, atol=ATOL)
  np.testing.assert_allclose(ret, want_ret, atol=ATOL)
  # Whitened over valid tokens: zero mean there.
  assert abs(float(np.sum(np.asarray(adv) * MASK))) < 1e-4


def test_gae_gap_does_not_cut_recursion():
  # Row 4 has a masked token at t=2: the reward at t=3 must still reach t=0 and t=1.
  rewards = np.zeros(MASK.shape, np.float32)
  rewards[4, 3] = 1.0
  _, ret = A.gae_advantage(rewards, np.zeros_like(rewards), MASK, 1.0, 1.0)
  np.testing.assert_allclose(np.asarray(ret)[4], [1, 1, 0, 1, 0], atol=ATOL)


def ref_group_adv(scores, norm_by_std):
  groups = ref_groups(scores, GROUP_IDS)
  out = []
  for i, g in enumerate(GROUP_IDS):
    vals = groups[int(g)]
    mean, std = (0.0, 1.0) if len(vals) == 1 else (np.mean(vals), np.std(vals, ddof=1))
    out.append((scores[i] - mean) / (std + 1e-6) if norm_by_std else scores[i] - mean)
  return np.array(out)


SCORES = np.array([1.0, 0.0, 0.5, 1.0, 1.0, 0.7, -0.3], np.float32)


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo(norm_by_std):
  adv, ret = A.grpo_advantage(SCORES, MASK, GROUP_IDS, NUM_GROUPS, norm_by_std=norm_by_std)
  want = ref_group_adv(SCORES, norm_by_std)[:, None] * MASK
  np.testing.assert_allclose(adv, want, atol=ATOL)
  np.testing.assert_array_equal(adv, ret)
  adv = np.asarray(adv)
  assert np.all(adv[3:5] == 0.0)  # all-equal rewards: no signal
  assert np.all(adv[5] == 0.0)  # fully masked row
  assert np.isfinite(adv).all()


def test_grpo_group_of_one_keeps_score():
  adv, _ = A.grpo_advantage(np.array([0.7, 2.0], np.float32), np.ones((2, 3), np.float32),
                            np.array([0, 1]), 2)
  np.testing.assert_allclose(adv, [[0.7] * 3, [2.0] * 3], rtol=1e-5)


def test_grpo_default_num_groups_is_batch_size():
  adv, _ = A.grpo_advantage(SCORES, MASK, GROUP_IDS)
  np.testing.assert_allclose(adv, ref_group_adv(SCORES, True)[:, None] * MASK, atol=ATOL)


def test_rloo():
  adv, ret = A.rloo_advantage(SCORES, MASK, GROUP_IDS, NUM_GROUPS)
  groups = ref_groups(SCORES, GROUP_IDS)
  want = []
  for i, g in enumerate(GROUP_IDS):
    vals = groups[int(g)]
    others = list(vals)
    others.remove(float(SCORES[i]))
    want.append(SCORES[i] - np.mean(others) if others else SCORES[i])
  np.testing.assert_allclose(adv, np.array(want)[:, None] * MASK, atol=ATOL)
  np.testing.assert_array_equal(adv, ret)


def test_rloo_and_reinforce_pp_baseline_group_of_one_keeps_score():
  """Group 1 is one unmasked sample: no other samples, so its score is its own signal
  (the shared data's only singleton row is fully masked and shows nothing)."""
  scores = np.array([1.0, 0.0, 0.7, 2.0, 1.0], np.float32)
  group_ids = np.array([0, 0, 1, 2, 2], np.int32)
  mask = np.array([[1, 1, 1], [1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], np.float32)
  adv, _ = A.rloo_advantage(scores, mask, group_ids, 3)
  np.testing.assert_allclose(adv, np.array([[1.0], [-1.0], [0.7], [1.0], [-1.0]]) * mask,
                             atol=ATOL)
  adv, _ = A.reinforce_plus_plus_baseline_advantage(scores, mask, group_ids, 3)
  centered = np.array([[0.5], [-0.5], [0.7], [0.5], [-0.5]]) * mask
  np.testing.assert_allclose(adv, ref_whiten(centered, mask), atol=ATOL)


def ref_returns_to_go(rewards, mask, gamma):
  B, T = mask.shape
  out = np.zeros((B, T))
  for b in range(B):
    for t in range(T):
      if not mask[b, t]:
        continue
      # Sum up to the next masked token (REINFORCE++ restarts the sum there).
      total, k = 0.0, 0
      for s in range(t, T):
        if not mask[b, s]:
          break
        total += gamma ** k * rewards[b, s]
        k += 1
      out[b, t] = total
  return out


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_plus_plus(gamma):
  rewards = _rewards(2)
  adv, ret = A.reinforce_plus_plus_advantage(rewards, MASK, gamma)
  want_ret = ref_returns_to_go(rewards, MASK, gamma)
  np.testing.assert_allclose(ret, want_ret, atol=ATOL)
  np.testing.assert_allclose(adv, ref_whiten(want_ret, MASK), atol=ATOL)


def test_reinforce_plus_plus_baseline():
  adv, ret = A.reinforce_plus_plus_baseline_advantage(SCORES, MASK, GROUP_IDS, NUM_GROUPS)
  groups = ref_groups(SCORES, GROUP_IDS)
  centered = np.array([SCORES[i] - (np.mean(groups[int(g)]) if len(groups[int(g)]) > 1 else 0)
                       for i, g in enumerate(GROUP_IDS)])
  want = ref_whiten(centered[:, None] * MASK, MASK)
  np.testing.assert_allclose(adv, want, atol=ATOL)
  np.testing.assert_array_equal(adv, ret)


def test_remax():
  rewards = _outcome_rewards(SCORES)
  baselines = np.array([0.5, 0.5, 0.0, 1.0, 0.2, 0.3, 0.1], np.float32)
  adv, ret = A.remax_advantage(rewards, baselines, MASK)
  want_ret = np.zeros(MASK.shape)
  for b in range(MASK.shape[0]):
    for t in range(MASK.shape[1]):
      if MASK[b, t]:
        want_ret[b, t] = sum(rewards[b, s] for s in range(t, MASK.shape[1]))
  np.testing.assert_allclose(ret, want_ret, atol=ATOL)
  np.testing.assert_allclose(adv, (want_ret - baselines[:, None]) * MASK, atol=ATOL)
  # Outcome reward: score - baseline on every response token.
  np.testing.assert_allclose(adv, (SCORES - baselines)[:, None] * MASK, atol=ATOL)


def test_sequence_scores():
  np.testing.assert_allclose(A.sequence_scores(_outcome_rewards(SCORES), MASK),
                             SCORES * (MASK.sum(-1) > 0), atol=ATOL)


def test_estimators_under_jit_and_without_valid_tokens():
  rewards, values = _rewards(3), _rewards(4)
  calls = [
      lambda r, v, m: A.gae_advantage(r, v, m, 0.99, 0.95),
      lambda r, v, m: A.grpo_advantage(r.sum(-1), m, GROUP_IDS, NUM_GROUPS),
      lambda r, v, m: A.rloo_advantage(r.sum(-1), m, GROUP_IDS, NUM_GROUPS),
      lambda r, v, m: A.reinforce_plus_plus_advantage(r, m, 0.99),
      lambda r, v, m: A.reinforce_plus_plus_baseline_advantage(r.sum(-1), m, GROUP_IDS),
      lambda r, v, m: A.remax_advantage(r, v.sum(-1), m),
  ]
  for fn in calls:
    eager, jitted = fn(rewards, values, MASK), jax.jit(fn)(rewards, values, MASK)
    for e, j in zip(eager, jitted):
      np.testing.assert_allclose(j, e, atol=ATOL)
    # An entirely masked batch (dynamic sampling kept nothing): zeros, not NaN.
    for out in fn(rewards, values, np.zeros_like(MASK)):
      assert np.all(np.asarray(out) == 0.0)


def test_masked_whiten_single_valid_token_is_finite():
  mask = np.zeros((2, 3), np.float32)
  mask[0, 1] = 1
  out = A.masked_whiten(np.arange(6.0).reshape(2, 3), mask) * mask
  assert np.isfinite(np.asarray(out)).all() and float(np.abs(out).max()) == 0.0


@pytest.mark.parametrize("value,n", [(0.9, 3), (9.9, 8), (0.1, 5), (-3.3, 2)])
def test_group_of_equal_scores_not_exact_in_float32_has_zero_advantage(value, n):
  """Issue 25 point 10: the float32 group mean of equal scores can be one rounding step
  off the score (0.9 x 3: 0.0556 each with std normalisation; 9.9 x 8: -0.47); by the
  definition every sample's advantage is 0."""
  scores = np.full(n, value, np.float32)
  mask, ids = np.ones((n, 3), np.float32), np.zeros(n, np.int32)
  for norm_by_std in (True, False):
    adv, _ = A.grpo_advantage(scores, mask, ids, 1, norm_by_std=norm_by_std)
    assert np.all(np.asarray(adv) == 0.0), (norm_by_std, np.asarray(adv)[:, 0])
  adv, _ = A.rloo_advantage(scores, mask, ids, 1)
  assert np.all(np.asarray(adv) == 0.0), np.asarray(adv)[:, 0]
  # Beside a group of 0 and 1 the batch's centred values are symmetric around 0, so a
  # group centred to exactly 0 stays exactly 0 after whitening.
  mixed = np.concatenate([scores, np.array([0.0, 1.0], np.float32)])
  ids = np.concatenate([np.zeros(n, np.int32), np.ones(2, np.int32)])
  mask = np.ones((n + 2, 3), np.float32)
  adv = np.asarray(A.reinforce_plus_plus_baseline_advantage(mixed, mask, ids, 2)[0])
  assert np.all(adv[:n] == 0.0), adv[:n, 0]
  centered = np.array([0.0] * n + [-0.5, 0.5])[:, None] * mask
  np.testing.assert_allclose(adv, ref_whiten(centered, mask), atol=ATOL)
  adv = np.asarray(jax.jit(lambda s: A.grpo_advantage(s, mask, ids, 2)[0])(mixed))
  assert np.all(adv[:n] == 0.0)
  np.testing.assert_allclose(adv[n:, 0], [-np.sqrt(0.5), np.sqrt(0.5)], rtol=1e-5)  # +-0.5 / std
