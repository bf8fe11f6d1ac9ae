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

from hflax.algorithms.masked import f32, group_count, group_mean_std, group_sum, masked_whiten

GRPO_EPS = 1e-6


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
  """
  mean_B, std_B, _ = group_mean_std(scores_B, group_ids_B, num_groups)
  advantage_B = f32(scores_B) - mean_B
  if norm_by_std:
    advantage_B = advantage_B / (std_B + eps)
  advantages_BxT = _broadcast(advantage_B, response_mask_BxT)
  return advantages_BxT, advantages_BxT


def rloo_advantage(scores_B, response_mask_BxT, group_ids_B, num_groups=None):
  """RLOO: score minus the mean score of the other samples of its group.

  A group of one sample has no others and keeps its score.
  """
  scores_B = f32(scores_B)
  count_B = group_count(group_ids_B, num_groups)
  others_mean_B = (group_sum(scores_B, group_ids_B, num_groups) - scores_B) / jnp.maximum(
      count_B - 1, 1.0)
  advantage_B = jnp.where(count_B > 1, scores_B - others_mean_B, scores_B)
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
  whitening.
  """
  mean_B, _, _ = group_mean_std(scores_B, group_ids_B, num_groups)
  mask_BxT = f32(response_mask_BxT)
  centered_BxT = _broadcast(f32(scores_B) - mean_B, mask_BxT)
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
