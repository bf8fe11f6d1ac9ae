"""verl's per-batch data metrics (compute_data_metrics) and perf/throughput.

Computed by one jitted function on device, on numpy or (possibly sharded) JAX arrays; the
results stay device scalars until MetricsLogger.log converts the whole step at once.
Token statistics are over valid response tokens; an empty mask gives 0, as in
hflax.algorithms.masked.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from hflax.algorithms.losses import explained_variance
from hflax.algorithms.masked import f32, masked_mean


def _mean_max_min(prefix, x, mask=None):
  if mask is None:
    return {f"{prefix}/mean": jnp.mean(x), f"{prefix}/max": jnp.max(x),
            f"{prefix}/min": jnp.min(x)}
  valid = mask > 0
  empty = ~jnp.any(valid)
  return {f"{prefix}/mean": masked_mean(x, mask),
          f"{prefix}/max": jnp.where(empty, 0.0, jnp.max(jnp.where(valid, x, -jnp.inf))),
          f"{prefix}/min": jnp.where(empty, 0.0, jnp.min(jnp.where(valid, x, jnp.inf)))}


@jax.jit
def _reduce(scores, rewards, advantages, returns, values, response_mask, prompt_mask,
            max_response_length, max_prompt_length):
  response_mask, prompt_mask = f32(response_mask), f32(prompt_mask)
  response_length = response_mask.sum(-1)
  prompt_length = prompt_mask.sum(-1)
  out = {
      **_mean_max_min("critic/score", f32(scores)),
      # verl: a response's reward is its token-level rewards summed (score - KL penalty).
      **_mean_max_min("critic/rewards", (f32(rewards) * response_mask).sum(-1)),
      **_mean_max_min("critic/advantages", f32(advantages), response_mask),
      **_mean_max_min("critic/returns", f32(returns), response_mask),
      **_mean_max_min("response_length", response_length),
      "response_length/clip_ratio": jnp.mean(response_length >= max_response_length),
      **_mean_max_min("prompt_length", prompt_length),
  }
  if values is not None:
    out.update(_mean_max_min("critic/values", f32(values), response_mask))
    out["critic/vf_explained_var"] = explained_variance(values, returns, response_mask)
  if max_prompt_length is not None:
    out["prompt_length/clip_ratio"] = jnp.mean(prompt_length >= max_prompt_length)
  return out


def reduce_batch_metrics(*, scores, token_level_rewards, advantages, returns, response_mask,
                         prompt_mask, max_response_length: int, values=None,
                         max_prompt_length: int | None = None) -> dict:
  """verl-named batch metrics as 0-d JAX arrays.

  scores [B] (sequence scores), token_level_rewards / advantages / returns / values
  [B, T], response_mask [B, T], prompt_mask [B, P] (1 on real tokens).
  Keyword-only: most arguments are same-shaped arrays, easy to swap by position.
  Gives critic/{score,rewards,advantages,returns}/{mean,max,min},
  response_length/{mean,max,min,clip_ratio}, prompt_length/{mean,max,min}; with values,
  critic/values/{mean,max,min} and critic/vf_explained_var; with max_prompt_length,
  prompt_length/clip_ratio (clip ratios: the fraction of rows at the length limit).
  """
  return _reduce(scores, token_level_rewards, advantages, returns, values, response_mask,
                 prompt_mask, max_response_length, max_prompt_length)


def throughput(tokens, seconds, devices):
  """verl's perf/throughput: tokens per second per device.

  tokens: every prompt and response token of the step's batch; seconds: the step time.
  """
  return tokens / (seconds * devices)


