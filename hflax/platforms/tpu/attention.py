"""The Pallas splash attention kernel for teacher-forced passes on TPUs."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def fits(queries: int, *, teacher_forced: bool, prefix: bool) -> bool:
  """Whether the splash kernel takes this call: teacher forced, a multiple of 128 queries,
  no prefix ids (it takes no such mask), and jax ships the kernel."""
  return teacher_forced and not prefix and queries % 128 == 0 and importable()


@functools.cache
def importable() -> bool:
  try:
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel  # noqa: F401
  except ImportError:
    return False
  return True


def splash(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, kv_valid_BxS, q_seg_BxT=None, *,
           interpret: bool = False):
  """Teacher-forced attention (query t in slot t, S == T, T a multiple of 128) by the TPU
  Pallas splash kernel: causal, with segment ids for packing and padding (a pad, id 0,
  sees only pads, so it stays finite). One multi-query kernel per KV head serves its
  group of query heads. `interpret=True` runs the kernel on any backend (the tests)."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as kernels, splash_attention_mask as masks)
  B, T, H, Dh = q_BxTxHxDh.shape
  KV = k_BxKxDhxS.shape[1]
  G = H // KV
  block = 512 if T % 512 == 0 else 128
  sizes = kernels.BlockSizes(block_q=block, block_kv=block, block_kv_compute=block,
                             block_q_dkv=block, block_kv_dkv=block, block_kv_dkv_compute=block,
                             block_q_dq=block, block_kv_dq=block)
  kernel = kernels.make_splash_mqa(masks.MultiHeadMask([masks.CausalMask((T, T))] * G),
                                   block_sizes=sizes, head_shards=1, q_seq_shards=1,
                                   interpret=interpret)
  seg_BxT = kv_valid_BxS.astype(jnp.int32) if q_seg_BxT is None else q_seg_BxT
  q_BxKxGxTxDh = (q_BxTxHxDh * Dh ** -0.5).reshape(B, T, KV, G, Dh).transpose(0, 2, 3, 1, 4)

  def one_head(q_GxTxDh, k_DhxS, v_SxDh, seg_T):
    return kernel(q_GxTxDh, k_DhxS.T, v_SxDh, segment_ids=kernels.SegmentIds(q=seg_T, kv=seg_T))

  out = jax.vmap(jax.vmap(one_head, (0, 0, 0, None)))(
      q_BxKxGxTxDh, k_BxKxDhxS.astype(q_BxTxHxDh.dtype), v_BxKxSxDh.astype(q_BxTxHxDh.dtype),
      seg_BxT)
  return out.transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh).astype(q_BxTxHxDh.dtype)
