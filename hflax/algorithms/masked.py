"""Masked statistics over response tokens and per-group statistics over samples.

Masks are float or bool arrays broadcastable to the values; 1 marks a real response
token. Every reduction is guarded so that an all-zero mask gives 0, never NaN: a batch
where dynamic sampling dropped every row must not poison a jitted step.

Groups (the n samples drawn for one prompt) are integer ids `group_ids_B` in
[0, num_groups). `num_groups` must be static under jit; any upper bound works (the
batch size always does), since empty groups are never read back.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def f32(x):
  """x as a float32 array (masks may be bool or int)."""
  return jnp.asarray(x).astype(jnp.float32)


def masked_sum(values, mask, axis=None):
  return jnp.sum(f32(values) * f32(mask), axis=axis)


def masked_mean(values, mask, axis=None):
  """sum(values * mask) / sum(mask) over `axis`; 0 where the mask is empty."""
  count = jnp.sum(jnp.broadcast_to(f32(mask), jnp.shape(values)), axis=axis)
  return masked_sum(values, mask, axis) / jnp.maximum(count, 1.0)


def masked_var(values, mask, unbiased: bool = True):
  """Variance over all masked entries; Bessel-corrected unless fewer than two entries."""
  mask = jnp.broadcast_to(f32(mask), jnp.shape(values))
  centered = f32(values) - masked_mean(values, mask)
  variance = masked_mean(centered * centered, mask)
  if unbiased:
    # verl raises on counts 0 and 1; we keep the biased value (0) there so jit can run.
    count = jnp.sum(mask)
    variance = variance * jnp.where(count > 1, count / jnp.maximum(count - 1, 1.0), 1.0)
  return variance


def masked_whiten(values, mask, shift_mean: bool = True, eps: float = 1e-8):
  """(values - mean) / sqrt(var + eps) with mean and unbiased var over masked entries.

  With shift_mean=False the mean is added back (only the scale is normalised).
  Entries outside the mask are whitened too; callers multiply by the mask.
  """
  mean = masked_mean(values, mask)
  whitened = (f32(values) - mean) * jax.lax.rsqrt(masked_var(values, mask) + eps)
  return whitened if shift_mean else whitened + mean


def _num_groups(group_ids_B, num_groups):
  return group_ids_B.shape[0] if num_groups is None else num_groups


def group_count(group_ids_B, num_groups=None):
  """Samples per group, gathered back to every sample: [B] float32."""
  G = _num_groups(group_ids_B, num_groups)
  count_G = jax.ops.segment_sum(jnp.ones(group_ids_B.shape, jnp.float32), group_ids_B, G)
  return count_G[group_ids_B]


def group_sum(scores_B, group_ids_B, num_groups=None):
  """Sum of the scores of each sample's group, gathered back: [B]."""
  G = _num_groups(group_ids_B, num_groups)
  return jax.ops.segment_sum(f32(scores_B), group_ids_B, G)[group_ids_B]


def group_mean_std(scores_B, group_ids_B, num_groups=None):
  """Per-sample (group mean, unbiased group std, group size), each [B].

  A group of one sample gets mean 0 and std 1, verl's convention: its score then passes
  through GRPO unchanged instead of becoming 0.
  """
  scores_B = f32(scores_B)
  count_B = group_count(group_ids_B, num_groups)
  mean_B = group_sum(scores_B, group_ids_B, num_groups) / count_B
  centered_B = scores_B - mean_B
  sq_B = group_sum(centered_B * centered_B, group_ids_B, num_groups)
  std_B = jnp.sqrt(sq_B / jnp.maximum(count_B - 1, 1.0))
  single = count_B < 2
  return jnp.where(single, 0.0, mean_B), jnp.where(single, 1.0, std_B), count_B
