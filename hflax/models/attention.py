"""Masked attention over KV-cache slots.

K is stored as [B, kv_heads, head_dim, S] and V as [B, kv_heads, S, head_dim] (the cache's
layouts). Key slot s is visible to query t of row b iff kv_valid[b, s], s <= q_slot[b, t]
(the slot the query itself was written to) and, with packed sequences, both carry the
same nonzero segment id, or the key carries the query's prefix id (a prompt that several
packed responses share: hflax.controller.packing). Masks are never passed around as
[B, T, S] arrays: `visible` builds the part a computation needs from those [B, T] / [B, S]
vectors.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hflax import platforms
from hflax.models.tracing import traced_once
from hflax.platforms.attention import choose

MASKED = -1e30  # finite, so rows with no visible key (pad queries) stay NaN-free


def visible(kv_valid_BxS, q_slot_BxT, q_seg_BxT=None, k_seg_BxS=None, k_offset=0,
            q_prefix_BxT=None):
  """Boolean [B, T, S] (B may be 1) visibility of the keys at slots k_offset.. to the
  queries; with q_prefix a query also sees the keys of segment q_prefix (its prompt)."""
  S = kv_valid_BxS.shape[-1]
  slots_S = k_offset + jnp.arange(S)
  mask = kv_valid_BxS[:, None, :] & (slots_S[None, None, :] <= q_slot_BxT[:, :, None])
  if q_seg_BxT is not None:
    k_seg = k_seg_BxS[:, None, :]
    same = q_seg_BxT[:, :, None] == k_seg
    if q_prefix_BxT is not None:
      same |= q_prefix_BxT[:, :, None] == k_seg
    mask &= same & (q_seg_BxT[:, :, None] > 0)
  return mask


def reference(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, kv_valid_BxS, q_slot_BxT,
              q_seg_BxT=None, k_seg_BxS=None, q_prefix_BxT=None):
  """Dense attention, [B, T, H, Dh]: materialises [B, kv_heads, groups, T, S] fp32 scores."""
  B, T, H, Dh = q_BxTxHxDh.shape
  KV = k_BxKxDhxS.shape[1]
  q_BxKxGxTxDh = q_BxTxHxDh.reshape(B, T, KV, H // KV, Dh).transpose(0, 2, 3, 1, 4)
  mask = visible(kv_valid_BxS, q_slot_BxT, q_seg_BxT, k_seg_BxS,
                 q_prefix_BxT=q_prefix_BxT)[:, None, None]
  out_BxKxGxTxDh = _dense(q_BxKxGxTxDh, k_BxKxDhxS.astype(q_BxTxHxDh.dtype),
                          v_BxKxSxDh.astype(q_BxTxHxDh.dtype), mask)
  return out_BxKxGxTxDh.transpose(0, 3, 1, 2, 4).reshape(B, T, H, Dh).astype(q_BxTxHxDh.dtype)


def one_query(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, kv_valid_BxS, q_slot_BxT,
              q_seg_BxT=None, k_seg_BxS=None, q_prefix_BxT=None):
  """reference's result for one query per row (a decode step), its scores written as
  head_dim unrolled multiply-adds in float32 rather than a dot.

  Why: XLA:CPU runs the scores' dot as B x kv_heads separate [groups, head_dim] x
  [head_dim, S] matmul calls, each too small to stream its keys at memory speed; the
  unrolled sum fuses into one loop vectorized along S, which reads the keys at about
  memory speed. The weighted sum of values stays a dot: it already streams V at memory
  speed, and every unrolled form of it ran slower in the decode loop. Products are the
  dot's (a bfloat16 product is exact in float32), their order of summation is not.
  """
  B, T, H, Dh = q_BxTxHxDh.shape
  if T != 1:
    raise ValueError(f"one_query takes one query per row, got {T}")
  KV = k_BxKxDhxS.shape[1]
  dt = q_BxTxHxDh.dtype
  q = q_BxTxHxDh.reshape(B, KV, H // KV, Dh).astype(jnp.float32)
  k = k_BxKxDhxS.astype(dt).astype(jnp.float32)
  scores = sum(q[..., d, None] * k[:, :, None, d] for d in range(Dh)) * Dh ** -0.5
  mask = visible(kv_valid_BxS, q_slot_BxT, q_seg_BxT, k_seg_BxS,
                 q_prefix_BxT=q_prefix_BxT)[:, 0, None, None]
  probs = jax.nn.softmax(jnp.where(mask, scores, MASKED), axis=-1)
  out = jnp.einsum("bkgs,bksd->bkgd", probs.astype(dt), v_BxKxSxDh.astype(dt),
                   preferred_element_type=jnp.float32)
  return out.reshape(B, 1, H, Dh).astype(dt)


@jax.custom_vjp
def _dense(q_BxKxGxTxDh, k_BxKxDhxS, v_BxKxSxDh, mask):
  return _dense_forward(q_BxKxGxTxDh, k_BxKxDhxS, v_BxKxSxDh, mask)[0]


def _dense_forward(q, k, v, mask):
  """float32 output [B, K, G, T, Dh]; q, k, v in the compute dtype."""
  scores = jnp.einsum("bkgtd,bkds->bkgts", q, k,
                      preferred_element_type=jnp.float32) * q.shape[-1] ** -0.5
  probs = jax.nn.softmax(jnp.where(mask, scores, MASKED), axis=-1)
  # Batch-major output order keeps this a plain batched matmul (XLA's fast kernels);
  # asking for [b, t, ...] directly made it swap operands onto a slow generic dot.
  # float32 out: XLA:CPU's fast library takes bfloat16 operands only with a float32 result.
  out = jnp.einsum("bkgts,bksd->bkgtd", probs.astype(q.dtype), v,
                   preferred_element_type=jnp.float32)
  return out, (q, k, v, mask, probs, out)


def _dense_backward(residuals, d_out):
  """The softmax Jacobian's correction as rowsum(dO * O) over head_dim, not autodiff's
  sum(dP * P) over the keys: XLA:CPU handed that [.., T, S] multiply-reduce to its matmul
  library, where it took a large share of a bf16 update."""
  q, k, v, mask, probs, out = residuals
  dt, scale = q.dtype, q.shape[-1] ** -0.5
  d_o = d_out.astype(dt)
  d_probs = jnp.einsum("bkgtd,bksd->bkgts", d_o, v, preferred_element_type=jnp.float32)
  correction = jnp.sum(d_out * out, axis=-1, keepdims=True)
  # A query with no visible key spread its probability evenly over masked scores, which
  # take no gradient (jnp.where's); everywhere else a masked probability is exactly 0.
  d_scores = jnp.where(mask, probs * (d_probs - correction) * scale, 0).astype(dt)
  dq = jnp.einsum("bkgts,bkds->bkgtd", d_scores, k, preferred_element_type=jnp.float32)
  # dK and dV sum over (group, query) pairs; XLA lays those dots out itself (on CPU it
  # widens them to float32: transposing an operand by hand first let it fold the
  # transpose back into a bfloat16 dot its runtime could not run).
  dk = jnp.einsum("bkgts,bkgtd->bkds", d_scores, q, preferred_element_type=jnp.float32)
  dv = jnp.einsum("bkgts,bkgtd->bksd", probs.astype(dt), d_o,
                  preferred_element_type=jnp.float32)
  return dq.astype(dt), dk.astype(k.dtype), dv.astype(v.dtype), None


_dense.defvjp(_dense_forward, _dense_backward)


def blockwise(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, kv_valid_BxS, q_slot_BxT,
              q_seg_BxT=None, k_seg_BxS=None, q_prefix_BxT=None, *, q_block: int = 64,
              k_block: int = 128, short_k_block: int | None = None):
  """Attention by query x key blocks with an online softmax (running max and sum in fp32).

  Forward and backward (a custom VJP that recomputes each block's probabilities from the
  saved log-sum-exp, as FlashAttention-2 does) hold O(T + S) memory besides one
  [B, H, q_block, k_block] block of scores. Each query block loops only over the key
  blocks `key_blocks_taken` leaves it: none past the last slot it can see (causality),
  none before the first key of its lowest segment, and none between a response and its
  shared prompt that holds only other responses. Packing writes nonzero segment ids in
  non-decreasing order along a row, so one row of many short sequences costs about
  sum(len_i^2) / 2 score pairs (up to block edges), not T^2 / 2 (rows of a batch share the
  blocks: a layout differing per row skips less); the last rule is what makes a long
  prompt shared by several responses cheap. A query that sees no key outputs 0, not the
  reference's mean over all values: either is finite, and neither feeds a real token.
  Block sizes: 64 x 128 ran a long forward + backward fastest; larger blocks skip less
  of the causal triangle and keep larger blocks live. With `short_k_block` (what `attention`
  passes), packed rows whose sequences are all at most SHORT_SEGMENT_KEYS long take key
  blocks that narrow instead (a run-time choice: both are compiled), in 16-bit dtypes
  only (float32: see chunked_head.KEPT_LOGITS_BYTES).
  """
  if (short_k_block and short_k_block < k_block and q_seg_BxT is not None
      and jnp.dtype(q_BxTxHxDh.dtype).itemsize < 4):
    q_prefix_BxT = q_seg_BxT if q_prefix_BxT is None else q_prefix_BxT
    narrow, wide = (functools.partial(blockwise, q_block=q_block, k_block=kb)
                    for kb in (short_k_block, k_block))
    return jax.lax.cond(longest_segment(k_seg_BxS) <= SHORT_SEGMENT_KEYS, narrow, wide,
                        q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, kv_valid_BxS, q_slot_BxT,
                        q_seg_BxT, k_seg_BxS, q_prefix_BxT)
  B, T, H, Dh = q_BxTxHxDh.shape
  S = k_BxKxDhxS.shape[-1]
  bq, bk = min(q_block, T), min(k_block, S)
  pad_t, pad_s = -T % bq, -S % bk
  pad = lambda x, axis, n, value=0: jnp.pad(  # noqa: E731
      x, [(0, n if a == axis else 0) for a in range(x.ndim)], constant_values=value)
  q_slot = jnp.broadcast_to(q_slot_BxT, (B, T))
  if q_seg_BxT is None:  # one segment per row: the same masks
    q_seg_BxT, k_seg_BxS = jnp.ones((B, T), jnp.int32), jnp.ones((B, S), jnp.int32)
  if q_prefix_BxT is None:  # a query's prefix its own segment: no other keys
    q_prefix_BxT = q_seg_BxT
  masks = (pad(kv_valid_BxS, 1, pad_s, False), pad(q_slot, 1, pad_t, -1),
           pad(q_seg_BxT, 1, pad_t, 0), pad(k_seg_BxS, 1, pad_s, 0),
           pad(jnp.broadcast_to(q_prefix_BxT, (B, T)), 1, pad_t, 0))
  out = _flash(bq, bk, pad(q_BxTxHxDh, 1, pad_t), pad(k_BxKxDhxS, 3, pad_s),
               pad(v_BxKxSxDh, 2, pad_s), masks)
  return out[:, :T]


# Packed rows of sequences no longer than this take key blocks of attention's
# SHORT_K_BLOCK instead of 128. In bf16, narrower key blocks made GRPO-style rows (short
# prompts and responses packed together) faster, while one long sequence keeps fewer,
# wider blocks. float32 keeps 128: alone its attention was faster 64-wide too, but the
# fp32 update ran slower with this and chunked_head.KEPT_LOGITS_BYTES together, and the
# two have not been told apart there.
SHORT_SEGMENT_KEYS = 1024
SHORT_K_BLOCK = 64


def longest_segment(seg_BxS):
  """The most slots any one nonzero segment id holds in a row of seg_BxS."""
  B, S = seg_BxS.shape
  flat = (seg_BxS + (S + 1) * jnp.arange(B)[:, None]).reshape(-1)
  counts = jax.ops.segment_sum(jnp.ones_like(flat), flat, num_segments=B * (S + 1))
  return counts.reshape(B, S + 1)[:, 1:].max()


def _blocks(x_BxTx___, bq):
  """[B, T, ...] -> [T // bq, B, bq, ...]."""
  B, T = x_BxTx___.shape[:2]
  return jnp.moveaxis(x_BxTx___.reshape(B, T // bq, bq, *x_BxTx___.shape[2:]), 1, 0)


def _query_blocks(q_BxTxHxDh, KV, bq):
  """[B, T, H, Dh] -> [T // bq, B, KV, G, bq, Dh]."""
  B, T, H, Dh = q_BxTxHxDh.shape
  return _blocks(q_BxTxHxDh, bq).reshape(T // bq, B, bq, KV, H // KV, Dh).transpose(
      0, 1, 3, 4, 2, 5)


def _key_block(k_BxKxDhxS, v_BxKxSxDh, masks, j, bk):
  kv_valid, _, _, k_seg, _ = masks
  k = jax.lax.dynamic_slice_in_dim(k_BxKxDhxS, j * bk, bk, axis=3)
  v = jax.lax.dynamic_slice_in_dim(v_BxKxSxDh, j * bk, bk, axis=2)
  return (k, v, jax.lax.dynamic_slice_in_dim(kv_valid, j * bk, bk, axis=1),
          jax.lax.dynamic_slice_in_dim(k_seg, j * bk, bk, axis=1))


def _scores(q_BxKxGxTxDh, k, valid, k_seg, slot, q_seg, q_prefix, j, bk):
  """Masked fp32 scores of one query block against key block j."""
  Dh = q_BxKxGxTxDh.shape[-1]
  s = jnp.einsum("bkgtd,bkds->bkgts", q_BxKxGxTxDh, k.astype(q_BxKxGxTxDh.dtype),
                 preferred_element_type=jnp.float32) * Dh ** -0.5
  mask = visible(valid, slot, q_seg, k_seg, k_offset=j * bk, q_prefix_BxT=q_prefix)
  return jnp.where(mask[:, None, None], s, MASKED)


def key_block_bounds(q_slot_BxT, q_seg_BxT, k_seg_BxS, bq, bk, q_prefix_BxT=None):
  """[T // bq] int32 (lo, hi): query block i sees no key outside key blocks lo[i] <= j < hi[i].

  hi: one past the block of the highest slot a query of the block sits at (causality).
  lo: the first key block holding a segment id >= the block's smallest segment a query
  sees (its own or its prefix), the earliest over the batch's rows: no key before it can
  share a segment with those queries. That holds for any order of segment ids
  (non-decreasing ones make it tight). Pads (id 0) see nothing, so they take no part; a
  block of pads gets lo = nk. T and S are multiples of bq and bk.
  """
  B, S = k_seg_BxS.shape
  nk = S // bk
  hi = jnp.clip(_blocks(q_slot_BxT, bq).max((1, 2)) // bk + 1, 0, nk)
  seen = q_seg_BxT if q_prefix_BxT is None else jnp.minimum(q_seg_BxT, q_prefix_BxT)
  lowest_NxB = _blocks(jnp.where(q_seg_BxT > 0, seen, jnp.iinfo(jnp.int32).max), bq).min(-1)
  reached_BxNk = jax.lax.cummax(k_seg_BxS.reshape(B, nk, bk).max(-1), axis=1)
  lo = jnp.sum(reached_BxNk[None] < lowest_NxB[..., None], axis=-1).min(-1)
  return lo.astype(jnp.int32), hi.astype(jnp.int32)


def key_blocks_taken(q_slot_BxT, q_seg_BxT, k_seg_BxS, bq, bk, q_prefix_BxT=None):
  """[T // bq, S // bk] bool: the key blocks each query block computes, those within
  `key_block_bounds` whose segment ids meet the ids the block's queries see (their own or
  their prefix). Blocks are compared by their id ranges (pads, 0, left out), which hold
  every id of a block whatever the order, so no visible pair is ever dropped; with
  packing's non-decreasing ids this drops the blocks of the other responses that lie
  between a response and its shared prompt, which the bounds keep."""
  B, S = k_seg_BxS.shape
  nk, top = S // bk, jnp.iinfo(jnp.int32).max
  lo, hi = key_block_bounds(q_slot_BxT, q_seg_BxT, k_seg_BxS, bq, bk, q_prefix_BxT)
  real = _blocks(q_seg_BxT, bq) > 0  # [nq, B, bq]

  def id_range(ids, present):
    return jnp.where(present, ids, top).min(-1), jnp.where(present, ids, 0).max(-1)

  keys = k_seg_BxS.reshape(B, nk, bk)
  k_lo, k_hi = id_range(keys, keys > 0)  # [B, nk]
  meets = jnp.zeros((real.shape[0], nk), bool)
  for ids in (q_seg_BxT, q_seg_BxT if q_prefix_BxT is None else q_prefix_BxT):
    q_lo, q_hi = id_range(_blocks(ids, bq), real)  # [nq, B]
    meets |= ((q_lo[..., None] <= k_hi) & (k_lo <= q_hi[..., None])).any(1)
  j = jnp.arange(nk)
  return meets & (j >= lo[:, None]) & (j < hi[:, None])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _flash(bq, bk, q, k, v, masks):
  return _flash_forward(bq, bk, q, k, v, masks)[0]


def _flash_forward(bq, bk, q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, masks):
  B, T, H, Dh = q_BxTxHxDh.shape
  KV = k_BxKxDhxS.shape[1]
  _, q_slot, q_seg, k_seg, q_prefix = masks

  def query_block(_, xs):
    q, slot, seg, prefix, order, count = xs

    def key_block(n, carry):
      m, l, acc = carry
      j = order[n]
      k, v, valid, k_seg = _key_block(k_BxKxDhxS, v_BxKxSxDh, masks, j, bk)
      s = _scores(q, k, valid, k_seg, slot, seg, prefix, j, bk)
      m_new = jnp.maximum(m, s.max(-1))
      p = jnp.exp(s - m_new[..., None])
      corr = jnp.exp(m - m_new)
      pv = jnp.einsum("bkgts,bksd->bkgtd", p.astype(q.dtype), v.astype(q.dtype),
                      preferred_element_type=jnp.float32)
      return m_new, l * corr + p.sum(-1), acc * corr[..., None] + pv

    m = jnp.full(q.shape[:-1], MASKED, jnp.float32)
    m, l, acc = jax.lax.fori_loop(0, count, key_block,
                                  (m, jnp.zeros_like(m), jnp.zeros(q.shape, jnp.float32)))
    # A query that saw only masked scores summed exp(0) over them: its l is no sign of a
    # visible key, its max is. Its lse of -MASKED makes the backward's probabilities 0.
    seen = m > MASKED
    out = jnp.where(seen[..., None], acc / jnp.where(seen, l, 1)[..., None], 0)
    lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1)), -MASKED)
    return None, (out.astype(q.dtype), lse)

  take = key_blocks_taken(q_slot, q_seg, k_seg, bq, bk, q_prefix)
  # Each query block's key blocks first, in order: the loop runs over those alone.
  order = jnp.argsort(~take, axis=1, stable=True).astype(jnp.int32)
  xs = (_query_blocks(q_BxTxHxDh, KV, bq), _blocks(q_slot, bq), _blocks(q_seg, bq),
        _blocks(q_prefix, bq), order, take.sum(1, dtype=jnp.int32))
  _, (out, lse) = jax.lax.scan(query_block, None, xs)
  # [nq, B, KV, G, bq, Dh] -> [B, T, H, Dh]
  out_BxTxHxDh = out.transpose(1, 0, 4, 2, 3, 5).reshape(B, T, H, Dh)
  return out_BxTxHxDh, (q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, masks, out, lse)


def _flash_backward(bq, bk, residuals, d_out_BxTxHxDh):
  q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, masks, out, lse = residuals
  B, T, H, Dh = q_BxTxHxDh.shape
  KV, nk, nq = k_BxKxDhxS.shape[1], k_BxKxDhxS.shape[-1] // bk, T // bq
  _, q_slot, q_seg, k_seg, q_prefix = masks
  qs = _query_blocks(q_BxTxHxDh, KV, bq)
  d_outs = _query_blocks(d_out_BxTxHxDh, KV, bq)
  # rowsum(dO * O): the softmax Jacobian's correction term, per query.
  deltas = jnp.sum(d_outs.astype(jnp.float32) * out.astype(jnp.float32), axis=-1)
  slots, segs, prefixes = _blocks(q_slot, bq), _blocks(q_seg, bq), _blocks(q_prefix, bq)
  take = key_blocks_taken(q_slot, q_seg, k_seg, bq, bk, q_prefix)

  def key_block(dq, j):
    k, v, valid, k_seg = _key_block(k_BxKxDhxS, v_BxKxSxDh, masks, j, bk)

    def query_block(i, carry):
      dq, dk, dv = carry
      q, d_o = qs[i], d_outs[i]
      s = _scores(q, k, valid, k_seg, slots[i], segs[i], prefixes[i], j, bk)
      p = jnp.exp(s - lse[i][..., None])
      dv = dv + jnp.einsum("bkgts,bkgtd->bksd", p.astype(q.dtype), d_o,
                           preferred_element_type=jnp.float32)
      dp = jnp.einsum("bkgtd,bksd->bkgts", d_o, v.astype(d_o.dtype),
                      preferred_element_type=jnp.float32)
      ds = (p * (dp - deltas[i][..., None]) * Dh ** -0.5).astype(q.dtype)
      dq_i = jnp.einsum("bkgts,bkds->bkgtd", ds, k.astype(q.dtype),
                        preferred_element_type=jnp.float32)
      dk = dk + jnp.einsum("bkgts,bkgtd->bkds", ds, q, preferred_element_type=jnp.float32)
      return dq.at[i].add(dq_i), dk, dv

    def maybe(i, carry):  # the forward pass skipped key block j for query block i
      return jax.lax.cond(take[i, j], query_block, lambda _, c: c, i, carry)

    dk = jnp.zeros(k.shape, jnp.float32)
    dv = jnp.zeros(v.shape, jnp.float32)
    dq, dk, dv = jax.lax.fori_loop(0, nq, maybe, (dq, dk, dv))
    return dq, (dk, dv)

  dq, (dks, dvs) = jax.lax.scan(key_block, jnp.zeros(qs.shape, jnp.float32), jnp.arange(nk))
  dq = dq.transpose(1, 0, 4, 2, 3, 5).reshape(B, T, H, Dh)
  dk = jnp.moveaxis(dks, 0, 3).reshape(k_BxKxDhxS.shape)  # [nk, B, KV, Dh, bk]
  dv = jnp.moveaxis(dvs, 0, 2).reshape(v_BxKxSxDh.shape)  # [nk, B, KV, bk, Dh]
  return (dq.astype(q_BxTxHxDh.dtype), dk.astype(k_BxKxDhxS.dtype),
          dv.astype(v_BxKxSxDh.dtype), None)


_flash.defvjp(lambda bq, bk, q, k, v, masks: _flash_forward(bq, bk, q, k, v, masks),
              _flash_backward)


def cudnn(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, kv_valid_BxS, *, implementation="cudnn"):
  """Teacher-forced attention (query t in slot t, S == T) by cuDNN's flash attention
  (hflax.platforms.gpu.attention), rows it cannot take by `blockwise`."""
  t = jnp.arange(q_BxTxHxDh.shape[1])
  fallback = lambda q, k, v: blockwise(q, k, v, kv_valid_BxS, t[None])  # noqa: E731
  return platforms.cudnn_attention(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, kv_valid_BxS, fallback,
                                   implementation=implementation)


def splash(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, kv_valid_BxS, q_seg_BxT=None, **options):
  """Teacher-forced attention (T a multiple of 128) by the TPU splash kernel
  (hflax.platforms.splash_attention); options: interpret=True runs it on any backend."""
  return platforms.splash_attention(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, kv_valid_BxS, q_seg_BxT,
                                    **options)


# Up to this many key slots "auto" keeps the dense reference: its scores are small there.
# For one SmolLM2-135M-shaped layer, dense and blockwise run about even up to 512 keys,
# and blockwise is clearly faster beyond.
REFERENCE_MAX_KEYS = 512
IMPLEMENTATIONS = ("auto", "reference", "blockwise", "cudnn", "splash")


@traced_once(static_argnames=("impl", "teacher_forced", "decode_kernel"))
def attention(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, kv_valid_BxS, q_slot_BxT,
              q_seg_BxT=None, k_seg_BxS=None, q_prefix_BxT=None, *, impl: str = "auto",
              teacher_forced: bool = False, decode_kernel: bool = False):
  """Attention output [B, T, H, Dh], by the implementation `impl` names or picks.

  teacher_forced (static) says query t sits in slot t of S == T slots, which the kernels
  that take only causal masks need. "auto": one_query for decoding on CPU (T == 1), the
  dense reference for decoding elsewhere (already linear in S) and for short contexts;
  cuDNN on GPU where it applies (bfloat16 or float16, no packed segments, teacher
  forced); the splash kernel on TPU (teacher forced, T % 128 == 0, no prefix ids: it
  takes no such mask); blockwise everywhere else. "cudnn" and "splash" force their
  kernel where it applies and leave the other calls (decoding, ...) to "auto"'s choice.
  decode_kernel (static): a decoding copy asked for the CPU decode-attention kernel, which
  "auto" then takes for one query a row where it reads this cache
  (hflax.platforms.attention.choose).
  """
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"attention={impl!r} is not one of {IMPLEMENTATIONS}")
  args = (q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, kv_valid_BxS, q_slot_BxT, q_seg_BxT, k_seg_BxS,
          q_prefix_BxT)
  T, S = q_BxTxHxDh.shape[1], k_BxKxDhxS.shape[-1]
  chosen = choose(impl, queries=T, short=S <= REFERENCE_MAX_KEYS, q_dtype=q_BxTxHxDh.dtype,
                  head_dim=q_BxTxHxDh.shape[-1], teacher_forced=teacher_forced,
                  packed=q_seg_BxT is not None, prefix=q_prefix_BxT is not None,
                  decode_kernel=decode_kernel, kv_dtypes=(k_BxKxDhxS.dtype, v_BxKxSxDh.dtype))
  if chosen == "decode_kernel":
    B = q_BxTxHxDh.shape[0]
    seen_BxS = visible(kv_valid_BxS, q_slot_BxT, q_seg_BxT, k_seg_BxS,
                       q_prefix_BxT=q_prefix_BxT)[:, 0]
    return platforms.decode_attention(q_BxTxHxDh[:, 0], k_BxKxDhxS, v_BxKxSxDh,
                                      jnp.broadcast_to(seen_BxS, (B, S)))[:, None]
  if chosen == "one_query":
    return one_query(*args)
  if chosen == "reference":
    return reference(*args)
  if chosen == "cudnn":
    return cudnn(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, kv_valid_BxS)
  if chosen == "splash":
    return splash(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, kv_valid_BxS, q_seg_BxT)
  return blockwise(*args, short_k_block=SHORT_K_BLOCK)
