"""Rotary position embeddings with the scalings Llama 3 and Qwen checkpoints use."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from hflax.models.config import ModelConfig
from hflax.models.tracing import traced_once


def inverse_frequencies(cfg: ModelConfig) -> tuple[np.ndarray, float]:
  """Returns (inv_freq of shape [head_dim // 2], attention factor applied to cos/sin)."""
  dim, base = cfg.head_dim, cfg.rope_theta
  inv_freq = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
  scaling = cfg.rope_scaling_dict
  kind = scaling.get("rope_type", "default")
  if kind == "default":
    return inv_freq, 1.0
  factor = scaling.get("factor")
  original = scaling.get("original_max_position_embeddings", cfg.max_position_embeddings)
  if kind == "linear":
    return inv_freq / factor, 1.0
  if kind == "llama3":
    return _llama3(inv_freq, factor, scaling["low_freq_factor"], scaling["high_freq_factor"],
                   original), 1.0
  if kind == "yarn":
    return _yarn(cfg, scaling, factor, original)
  raise ValueError(f"unsupported rope_type {kind!r}")


def _llama3(inv_freq, factor, low_freq_factor, high_freq_factor, original):
  # Long wavelengths are interpolated by `factor`, short ones kept, the band between blended.
  wavelen = 2 * math.pi / inv_freq
  low_freq_wavelen = original / low_freq_factor
  high_freq_wavelen = original / high_freq_factor
  scaled = np.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
  smooth = (original / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
  blended = (1 - smooth) * scaled / factor + smooth * scaled
  medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
  return np.where(medium, blended, scaled)


def _yarn(cfg, scaling, factor, original):
  dim, base = cfg.head_dim, cfg.rope_theta
  if factor is None:
    factor = cfg.max_position_embeddings / original

  def mscale(scale, m=1.0):
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

  attention_factor = scaling.get("attention_factor")
  if attention_factor is None:
    m, m_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
    attention_factor = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)

  def correction_dim(rotations):
    return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(base))

  low = correction_dim(scaling.get("beta_fast") or 32)
  high = correction_dim(scaling.get("beta_slow") or 1)
  if scaling.get("truncate", True):
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, dim - 1)
  if low == high:
    high += 0.001
  ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
  extrapolate = 1 - ramp
  pos_freqs = base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)
  inv_freq = (1 / (factor * pos_freqs)) * (1 - extrapolate) + (1 / pos_freqs) * extrapolate
  return inv_freq, float(attention_factor)


# Tables for up to this many positions are built at trace time (two of 8 MB at head_dim
# 128); longer ones would make the compiled program carry large constants, and there the
# attention over so many keys dwarfs recomputing cos and sin.
MAX_TABLE_POSITIONS = 1 << 15


def rope_tables(cfg: ModelConfig, positions_BxT: jnp.ndarray, num_positions: int):
  """cos and sin of shape [B, T, head_dim] for integer positions in [0, num_positions).

  Up to MAX_TABLE_POSITIONS they are looked up in tables built once at trace time.
  Computed in the graph instead, XLA fuses cos and sin into every layer's q and k rotation
  and evaluates them again for each head, which made bench/generate.py's calls slower on
  CPU. A position outside the table reads NaN rather than a wrong rotation.
  """
  inv_freq, attention_factor = inverse_frequencies(cfg)
  inv_freq = inv_freq.astype(np.float32)
  if num_positions > MAX_TABLE_POSITIONS:
    angles = positions_BxT.astype(jnp.float32)[..., None] * inv_freq
    angles = jnp.concatenate([angles, angles], axis=-1)
    return jnp.cos(angles) * attention_factor, jnp.sin(angles) * attention_factor
  # float32 angles, as the reference computes them; cos and sin rounded once from float64.
  angles = np.arange(num_positions, dtype=np.float32)[:, None] * inv_freq
  tables = [(f(angles.astype(np.float64)) * attention_factor).astype(np.float32)
            for f in (np.cos, np.sin)]

  # take() would wrap a negative index around like numpy; send it out of range instead.
  index = jnp.where(positions_BxT >= 0, positions_BxT, num_positions)

  def look_up(table):
    half = jnp.take(jnp.asarray(table), index, axis=0, mode="fill", fill_value=jnp.nan)
    return jnp.concatenate([half, half], axis=-1)

  return look_up(tables[0]), look_up(tables[1])


@jax.custom_vjp
def _apply_rope(x_BxTxNxD: jnp.ndarray, cos_BxTxD: jnp.ndarray, sin_BxTxD: jnp.ndarray):
  """x rotated by the angles whose cos and sin are given, in float32, cast back to x's
  dtype. Differentiable in x only (the tables come from integer positions)."""
  cos, sin = cos_BxTxD[:, :, None, :], sin_BxTxD[:, :, None, :]
  x = x_BxTxNxD.astype(jnp.float32)
  return (x * cos + _rotate_half(x) * sin).astype(x_BxTxNxD.dtype)


def _rotate_half(x):
  half = x.shape[-1] // 2
  return jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def _rope_forward(x, cos, sin):
  return _apply_rope(x, cos, sin), (cos, sin)


def _rope_backward(saved, g):
  """The rotation's adjoint, g cos - rotate_half(g sin), as one more rotation-shaped pass:
  autodiff's transpose of the slices and the concatenation took about ten times the
  forward's time on XLA:CPU."""
  cos, sin = saved
  g32 = g.astype(jnp.float32)  # g has x's dtype, the output's
  dx = g32 * cos[:, :, None, :] - _rotate_half(g32 * sin[:, :, None, :])
  return dx.astype(g.dtype), None, None


_apply_rope.defvjp(_rope_forward, _rope_backward)
apply_rope = traced_once()(_apply_rope)
