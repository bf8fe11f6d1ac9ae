"""cuDNN flash attention for teacher-forced passes on GPUs (jax.nn.dot_product_attention)."""
from __future__ import annotations

import jax
import jax.numpy as jnp


def fits(q_dtype, head_dim: int, *, teacher_forced: bool, packed: bool) -> bool:
  """Whether cuDNN's kernel takes this call: teacher forced, no packed segments (it takes
  causal masks and sequence lengths only), 16-bit queries and head_dim a multiple of 8 up
  to 128."""
  return (teacher_forced and not packed and jnp.dtype(q_dtype) in (jnp.bfloat16, jnp.float16)
          and head_dim % 8 == 0 and head_dim <= 128)


def cudnn(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, kv_valid_BxS, fallback, *,
          implementation="cudnn"):
  """Teacher-forced attention (query t in slot t, S == T) by jax.nn.dot_product_attention.

  cuDNN's flash attention takes causal masking and right padding (sequence lengths) but
  no mask array short of a quadratic bias, so each row is rotated to start at its first
  valid slot; a row whose valid slots are not one contiguous run (or are none) sends the
  whole call to `fallback(q, k, v)` (the caller's blockwise attention) instead.
  `implementation="xla"` runs the same arguments on any backend (the tests check the
  rotation that way).
  """
  B, T, H, Dh = q_BxTxHxDh.shape
  start_B = jnp.argmax(kv_valid_BxS, axis=1).astype(jnp.int32)
  length_B = jnp.sum(kv_valid_BxS, axis=1, dtype=jnp.int32)
  t = jnp.arange(T)
  run_BxS = (t >= start_B[:, None]) & (t < (start_B + length_B)[:, None])
  contiguous = jnp.all(run_BxS == kv_valid_BxS) & jnp.all(length_B > 0)

  def rotate(x_BxTx___, sign):
    return jax.vmap(lambda row, s: jnp.roll(row, sign * s, axis=0))(x_BxTx___, start_B)

  def flash(q, k, v):
    out = jax.nn.dot_product_attention(
        rotate(q, -1), rotate(k.transpose(0, 3, 1, 2), -1), rotate(v.transpose(0, 2, 1, 3), -1),
        is_causal=True, query_seq_lengths=length_B, key_value_seq_lengths=length_B,
        implementation=implementation)
    return jnp.where(kv_valid_BxS[:, :, None, None], rotate(out, 1), 0).astype(q.dtype)

  return jax.lax.cond(contiguous, flash, fallback, q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh)
