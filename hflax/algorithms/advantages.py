"""Advantage estimators: GAE, GRPO (and Dr.GRPO), RLOO, REINFORCE++ (+ baseline), ReMax.

Every estimator returns (advantages_BxT, returns_BxT), both 0 outside the response.
Responses are [B, T] with `response_mask_BxT` (1 on real tokens, the end token
included). Outcome scores are [B] (one number per response, e.g. the sum of its
token-level rewards, see `sequence_scores`). Groups of samples of the same prompt are
`group_ids_B` with a static `num_groups` (None: the batch size, always a valid bound).

All functions are pure and jit-friendly; hyper-parameters (gamma, lam, flags) are
Python scalars.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from hflax.algorithms.masked import f32, group_count, group_sum, masked_whiten

GRPO_EPS = 1e-6


def _group_deviations(scores_B, group_ids_B, num_groups=None):
  """Per sample: (score - its group mean, unbiased group std, group size), each [B].

  The mean is taken of the scores shifted by the group's largest score, and the deviation
  is shifted the same way: (s - top) - mean(s - top). The shift changes nothing
  mathematically, but a group of equal scores then gives deviations of exactly 0, where
  s - mean(s) would not: three float32 scores of 0.9 sum to a value whose third is one
  rounding step off 0.9 (and verl's float32 code, which subtracts the plain mean, has
  that flaw). A group of one sample gets its own score as deviation and std 1 (verl's
  convention: its score then passes through unchanged).
  """
  scores_B = f32(scores_B)
  G = group_ids_B.shape[0] if num_groups is None else num_groups
  top_B = jax.ops.segment_max(scores_B, group_ids_B, G)[group_ids_B]
  shifted_B = scores_B - top_B  # exactly 0 for every member of an all-equal group
  count_B = group_count(group_ids_B, num_groups)
  centered_B = shifted_B - group_sum(shifted_B, group_ids_B, num_groups) / count_B
  sq_B = group_sum(centered_B * centered_B, group_ids_B, num_groups)
  std_B = jnp.sqrt(sq_B / jnp.maximum(count_B - 1, 1.0))
  single = count_B < 2
  return jnp.where(single, scores_B, centered_B), jnp.where(single, 1.0, std_B), count_B


def sequence_scores(token_level_rewards_BxT, response_mask_BxT):
  """Outcome score per response [B]: its token-level rewards summed over the response."""
  return jnp.sum(f32(token_level_rewards_BxT) * f32(response_mask_BxT), axis=-1)


def _broadcast(scores_B, response_mask_BxT):
  return f32(scores_B)[:, None] * f32(response_mask_BxT)


def discounted_returns(token_level_rewards_BxT, response_mask_BxT, gamma: float = 1.0):
  """Return-to-go sum_{s>=t} gamma^(s-t) r_s over the response, 0 on padding: [B, T]."""
  mask_BxT = f32(response_mask_BxT)

  def step(running_B, x):
    reward_B, mask_B = x
    ret_B = reward_B * mask_B + gamma * running_B
    # Padding resets the sum, so a row's tail of padding never leaks into its response.
    return ret_B * mask_B, ret_B * mask_B

  _, returns_TxB = jax.lax.scan(step, jnp.zeros(mask_BxT.shape[:1], jnp.float32),
                                (f32(token_level_rewards_BxT).T, mask_BxT.T), reverse=True)
  return returns_TxB.T


def gae_advantage(token_level_rewards_BxT, values_BxT, response_mask_BxT,
                  gamma: float = 1.0, lam: float = 1.0):
  """Generalised advantage estimation over valid tokens; advantages whitened.

  The recursion runs backwards and steps over masked tokens without resetting (their
  value and TD error are skipped), so masked gaps inside a response (e.g. tool
  observations) do not cut it. returns = raw advantages + values; advantages are then
  whitened over all valid tokens of the batch (mean shifted to 0, unbiased variance).
  """
  rewards_BxT, values_BxT = f32(token_level_rewards_BxT), f32(values_BxT)
  mask_BxT = f32(response_mask_BxT)

  def step(carry, x):
    next_value_B, last_gae_B = carry
    reward_B, value_B, mask_B = x
    delta_B = reward_B + gamma * next_value_B - value_B
    gae_B = delta_B + gamma * lam * last_gae_B
    valid_B = mask_B > 0
    next_value_B = jnp.where(valid_B, value_B, next_value_B)
    last_gae_B = jnp.where(valid_B, gae_B, last_gae_B)
    return (next_value_B, last_gae_B), last_gae_B

  zeros_B = jnp.zeros(mask_BxT.shape[:1], jnp.float32)
  _, advantages_TxB = jax.lax.scan(step, (zeros_B, zeros_B),
                                   (rewards_BxT.T, values_BxT.T, mask_BxT.T), reverse=True)
  advantages_BxT = advantages_TxB.T
  returns_BxT = (advantages_BxT + values_BxT) * mask_BxT
  advantages_BxT = masked_whiten(advantages_BxT, mask_BxT) * mask_BxT
  return advantages_BxT, returns_BxT


def grpo_advantage(scores_B, response_mask_BxT, group_ids_B, num_groups=None, *,
                   norm_by_std: bool = True, eps: float = GRPO_EPS):
  """GRPO: (score - group mean) / (group std + eps), broadcast over the response.

  std is the unbiased sample std. A group of one sample keeps its score (mean 0,
  std 1). norm_by_std=False gives Dr.GRPO (no division by the std).

  A group whose scores are all equal gets advantage exactly 0, also when the score is not
  representable in float32 (see _group_deviations). verl computes score - mean in
  float32 and has the flaw this avoids: three scores of 0.9 give about 0.056 each with
  std normalisation (the rounding error of the mean divided by std + eps, both tiny),
  eight scores of 9.9 about -0.47, all of one sign, so the group pushes its policy.
  """
  advantage_B, std_B, _ = _group_deviations(scores_B, group_ids_B, num_groups)
  if norm_by_std:
    advantage_B = advantage_B / (std_B + eps)
  advantages_BxT = _broadcast(advantage_B, response_mask_BxT)
  return advantages_BxT, advantages_BxT


def rloo_advantage(scores_B, response_mask_BxT, group_ids_B, num_groups=None):
  """RLOO: score minus the mean score of the other samples of its group.

  A group of one sample has no others and keeps its score. Computed as
  n / (n - 1) * (score - group mean), with the deviation from the mean taken so that a
  group of equal scores gets exactly 0 (verl's float32 leave-one-out mean leaves a
  rounding residue there; see _group_deviations).
  """
  centered_B, _, count_B = _group_deviations(scores_B, group_ids_B, num_groups)
  advantage_B = jnp.where(count_B > 1, centered_B * count_B / jnp.maximum(count_B - 1, 1.0),
                          centered_B)
  advantages_BxT = _broadcast(advantage_B, response_mask_BxT)
  return advantages_BxT, advantages_BxT


def reinforce_plus_plus_advantage(token_level_rewards_BxT, response_mask_BxT,
                                  gamma: float = 1.0):
  """REINFORCE++: discounted return-to-go per token, whitened over all valid tokens.

  The returns are the un-whitened return-to-go.
  """
  returns_BxT = discounted_returns(token_level_rewards_BxT, response_mask_BxT, gamma)
  mask_BxT = f32(response_mask_BxT)
  return masked_whiten(returns_BxT, mask_BxT) * mask_BxT, returns_BxT


def reinforce_plus_plus_baseline_advantage(scores_B, response_mask_BxT, group_ids_B,
                                           num_groups=None):
  """REINFORCE++-baseline: score minus its group mean, broadcast, then whitened.

  Whitening runs over all valid tokens of the batch, so longer responses weigh more
  in its mean and variance (as in verl). A group of one keeps its score before
  whitening. A group of equal scores is centred to exactly 0 (verl's float32 group mean
  leaves a rounding residue there; see _group_deviations).
  """
  centered_B, _, _ = _group_deviations(scores_B, group_ids_B, num_groups)
  mask_BxT = f32(response_mask_BxT)
  centered_BxT = _broadcast(centered_B, mask_BxT)
  advantages_BxT = masked_whiten(centered_BxT, mask_BxT) * mask_BxT
  return advantages_BxT, advantages_BxT


def remax_advantage(token_level_rewards_BxT, reward_baselines_B, response_mask_BxT):
  """ReMax: undiscounted return-to-go minus the greedy response's score.

  returns = reverse cumulative sum of the token rewards over the response;
  advantages = returns - baseline (broadcast over the response). With an outcome
  reward on the last token this is score - baseline on every token.
  """
  mask_BxT = f32(response_mask_BxT)
  rewards_BxT = f32(token_level_rewards_BxT) * mask_BxT
  # A plain suffix sum: unlike REINFORCE++, masked gaps inside a response don't reset it.
  returns_BxT = jnp.flip(jnp.cumsum(jnp.flip(rewards_BxT, -1), -1), -1) * mask_BxT
  advantages_BxT = returns_BxT - _broadcast(reward_baselines_B, response_mask_BxT)
  return advantages_BxT, returns_BxT
