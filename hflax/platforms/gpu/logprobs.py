"""Fused per-token log-prob and entropy over the vocabulary projection (Pallas on Triton).

For rows h [N, D] and an output projection W ([D, V], or [V, D] for tied embeddings) the
forward kernel streams vocabulary tiles through an online softmax, keeping per row the
running max m, s = sum exp(z - m) and t = sum exp(z - m) * z of the scaled logits z, so
[N, V] logits never exist in memory:
  logsumexp = m + log s,   entropy = logsumexp - t / s,   log-prob = z[target] - logsumexp.
The grid is (row tiles, vocabulary splits): with few rows, splitting the vocabulary keeps
every SM busy, and the [splits, N] partials are merged in plain JAX.

The backward pass is plain JAX over vocabulary chunks (`_backward`). Given the saved
logsumexp and entropy each chunk is independent: recompute its logits, form dlogits, and
run the two gradient matmuls. Those are large GEMMs that XLA already runs at peak, and the
[N, chunk] intermediates bound its memory; a Pallas backward would add a second
recompute (or atomics) for dW without saving FLOPs.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from hflax.platforms.xla import logits_cotangent

# Finite mask for logits past V: exp() of it underflows to 0 and 0 * _NEG is 0, not NaN.
_NEG = -1e30
_BWD_CHUNK_ELEMS = 2 ** 25  # [N, chunk] f32 intermediates of ~128 MiB in the backward


@dataclasses.dataclass(frozen=True)
class Config:
  """Static settings of one fused call (hashable: a nondiff argument of the custom_vjp)."""
  temperature: float = 1.0
  transposed: bool = False  # W is [V, D] (tied embedding) instead of [D, V]
  logits_dtype: str = "float32"  # logits are rounded to this first, as DecoderLM.logits does
  block_rows: int = 64
  block_vocab: int = 128
  block_d: int = 64
  vocab_splits: int | None = None  # None: enough programs for ~2 per SM
  num_warps: int = 4
  num_stages: int = 3
  bwd_vocab_chunk: int | None = None
  interpret: bool = False


def _scaled_logits(acc_f32, cfg: Config):
  """Round like DecoderLM.logits, then divide (not multiply) by T, as the fallback does."""
  return acc_f32.astype(cfg.logits_dtype).astype(jnp.float32) / cfg.temperature


def _fwd_kernel(h_ref, w_ref, t_ref, m_ref, s_ref, t_out_ref, pick_ref, *, cfg: Config,
                vocab: int, tiles_per_split: int):
  bn, depth = h_ref.shape
  bv, bd = cfg.block_vocab, cfg.block_d
  n_tiles = pl.cdiv(vocab, bv)
  first = pl.program_id(1) * tiles_per_split
  targets = t_ref[...]

  def logits_tile(j):
    cols = j * bv + jnp.arange(bv)

    def depth_step(k, acc):
      ks = k * bd + jnp.arange(bd)
      # Masks only where a tile can overhang the array, so aligned shapes load unmasked.
      h_mask = None if depth % bd == 0 else jnp.broadcast_to(ks[None, :] < depth, (bn, bd))
      h = plgpu.load(h_ref.at[:, pl.ds(k * bd, bd)], mask=h_mask,
                     other=None if h_mask is None else 0.0)
      if cfg.transposed:
        w_mask = (cols[:, None] < vocab) & (ks[None, :] < depth)
        w_view, dims = w_ref.at[pl.ds(j * bv, bv), pl.ds(k * bd, bd)], (((1,), (1,)), ((), ()))
      else:
        w_mask = (ks[:, None] < depth) & (cols[None, :] < vocab)
        w_view, dims = w_ref.at[pl.ds(k * bd, bd), pl.ds(j * bv, bv)], (((1,), (0,)), ((), ()))
      aligned = vocab % bv == 0 and depth % bd == 0
      w = plgpu.load(w_view, mask=None if aligned else w_mask, other=None if aligned else 0.0)
      return acc + lax.dot_general(h, w, dims, preferred_element_type=jnp.float32)

    acc = lax.fori_loop(0, pl.cdiv(depth, bd), depth_step, jnp.zeros((bn, bv), jnp.float32))
    z = _scaled_logits(acc, cfg)
    if vocab % bv:
      z = jnp.where(cols[None, :] < vocab, z, _NEG)
    return cols, z

  def vocab_step(i, carry):
    m, s, t, pick = carry
    cols, z = logits_tile(first + i)
    m_new = jnp.maximum(m, jnp.max(z, axis=1))
    rescale = jnp.exp(m - m_new)
    e = jnp.exp(z - m_new[:, None])
    s = s * rescale + jnp.sum(e, axis=1)
    t = t * rescale + jnp.sum(e * z, axis=1)
    pick = pick + jnp.sum(jnp.where(cols[None, :] == targets[:, None], z, 0.0), axis=1)
    return m_new, s, t, pick

  zeros = jnp.zeros((bn,), jnp.float32)
  count = jnp.minimum(tiles_per_split, n_tiles - first)  # the last split may be short
  m, s, t, pick = lax.fori_loop(0, count, vocab_step, (zeros + _NEG, zeros, zeros, zeros))
  m_ref[...], s_ref[...], t_out_ref[...], pick_ref[...] = m, s, t, pick


def _splits(cfg: Config, row_tiles: int, n_tiles: int) -> tuple[int, int]:
  """(splits, tiles per split), with no empty split."""
  want = cfg.vocab_splits
  if want is None:
    sms = getattr(jax.local_devices()[0], "core_count", None) or 1
    want = pl.cdiv(2 * sms, row_tiles)
  per = pl.cdiv(n_tiles, max(1, min(want, n_tiles)))
  return pl.cdiv(n_tiles, per), per


def _forward(h, w, targets, cfg: Config):
  """(log-prob, entropy, logsumexp), each [N] float32."""
  n, d = h.shape
  vocab = w.shape[0] if cfg.transposed else w.shape[1]
  bn = cfg.block_rows
  pad = -n % bn
  if pad:  # rows are cheap to pad, unlike W; padded rows are sliced off below
    h, targets = jnp.pad(h, ((0, pad), (0, 0))), jnp.pad(targets, (0, pad))
  row_tiles = (n + pad) // bn
  splits, per = _splits(cfg, row_tiles, pl.cdiv(vocab, cfg.block_vocab))
  partial = jax.ShapeDtypeStruct((splits, n + pad), jnp.float32)
  out_spec = pl.BlockSpec((None, bn), lambda i, j: (j, i))
  m, s, t, pick = pl.pallas_call(
      functools.partial(_fwd_kernel, cfg=cfg, vocab=vocab, tiles_per_split=per),
      grid=(row_tiles, splits),
      in_specs=[pl.BlockSpec((bn, d), lambda i, j: (i, 0)),
                pl.BlockSpec(w.shape, lambda i, j: (0, 0)),
                pl.BlockSpec((bn,), lambda i, j: (i,))],
      out_specs=[out_spec] * 4,
      out_shape=[partial] * 4,
      compiler_params=plgpu.CompilerParams(num_warps=cfg.num_warps,
                                           num_stages=cfg.num_stages),
      interpret=cfg.interpret,
      name="hflax_fused_logprobs",
  )(h, w, targets.astype(jnp.int32))
  top = jnp.max(m, axis=0)
  weight = jnp.exp(m - top)
  s, t = jnp.sum(s * weight, axis=0), jnp.sum(t * weight, axis=0)
  lse = top + jnp.log(s)
  return (jnp.sum(pick, axis=0) - lse)[:n], (lse - t / s)[:n], lse[:n]


def _bwd_chunk(cfg: Config, n: int, vocab: int) -> int:
  if cfg.bwd_vocab_chunk:
    return min(cfg.bwd_vocab_chunk, vocab)
  chunk = 128
  while chunk * 2 * n <= _BWD_CHUNK_ELEMS and chunk * 2 <= vocab:
    chunk *= 2
  return min(chunk, vocab)


def _backward(h, w, targets, lse, ent, g_logp, g_ent, cfg: Config):
  """d(h), d(W) for cotangents of log-prob and entropy, one vocabulary chunk at a time.

  With z = logits / T, p = softmax(z): dlogp/dz = onehot - p and
  dentropy/dz = -p * (z - lse + entropy) (that is -p * (log p + entropy)).
  """
  n, _ = h.shape
  axis = 0 if cfg.transposed else 1
  vocab = w.shape[axis]
  chunk = _bwd_chunk(cfg, n, vocab)
  lse, ent = lse[:, None], ent[:, None]
  g_logp, g_ent = g_logp.astype(jnp.float32)[:, None], g_ent.astype(jnp.float32)[:, None]
  h_dims = (((1,), (1,)), ((), ())) if cfg.transposed else (((1,), (0,)), ((), ()))

  def grads(start, size, dh, dw):
    w_c = lax.dynamic_slice_in_dim(w, start, size, axis)
    z = _scaled_logits(lax.dot_general(h, w_c, h_dims, preferred_element_type=jnp.float32), cfg)
    onehot = targets[:, None] == start + jnp.arange(size)
    dz = logits_cotangent(z, onehot, lse, lse - ent, g_logp, g_ent)  # mean z = lse - entropy
    # Rounded to the logits' dtype as autodiff of DecoderLM.logits rounds it: bf16 GEMMs
    # for a bf16 head, f32 ones for a tied head (whose logits are f32).
    dlogits = (dz / cfg.temperature).astype(cfg.logits_dtype)
    if cfg.transposed:
      dh = dh + jnp.dot(dlogits, w_c, preferred_element_type=jnp.float32)
      dw_c = jnp.einsum("nv,nd->vd", dlogits, h, preferred_element_type=jnp.float32)
    else:
      dh = dh + jnp.einsum("nv,dv->nd", dlogits, w_c, preferred_element_type=jnp.float32)
      dw_c = jnp.einsum("nd,nv->dv", h, dlogits, preferred_element_type=jnp.float32)
    return dh, lax.dynamic_update_slice_in_dim(dw, dw_c.astype(w.dtype), start, axis)

  full, rest = divmod(vocab, chunk)
  carry = (jnp.zeros(h.shape, jnp.float32), jnp.zeros_like(w))
  carry = lax.fori_loop(0, full, lambda i, c: grads(i * chunk, chunk, *c), carry)
  if rest:  # a static tail chunk, so W is never padded (that would copy it)
    carry = grads(full * chunk, rest, *carry)
  dh, dw = carry
  return dh.astype(h.dtype), dw


@functools.partial(jax.custom_vjp, nondiff_argnums=(3,))
def _fused(h, w, targets, cfg):
  return _forward(h, w, targets, cfg)[:2]


def _fused_fwd(h, w, targets, cfg):
  logp, ent, lse = _forward(h, w, targets, cfg)
  return (logp, ent), (h, w, targets, lse, ent)


def _fused_bwd(cfg, res, cotangents):
  h, w, targets, lse, ent = res
  dh, dw = _backward(h, w, targets, lse, ent, *cotangents, cfg)
  return dh, dw, None


_fused.defvjp(_fused_fwd, _fused_bwd)


def fused_log_probs(hidden_NxD, w, targets_N, **config):
  """log softmax(hidden @ W / temperature)[target] and the entropy, each [N] float32.

  `w` is [D, V], or [V, D] with transposed=True; it must share hidden's dtype. Keyword
  arguments are the fields of `Config`. Differentiable in hidden and w.
  """
  cfg = Config(**config)
  for name in ("block_rows", "block_vocab", "block_d"):
    size = getattr(cfg, name)
    if size < 16 or size & (size - 1):  # Triton's tiles; its dots are at least 16 wide
      raise ValueError(f"{name}={size}: tiles must be powers of 2, at least 16")
  if hidden_NxD.dtype != w.dtype:
    raise ValueError(f"hidden is {hidden_NxD.dtype} but W is {w.dtype}; cast one first")
  cfg = dataclasses.replace(cfg, logits_dtype=jnp.dtype(cfg.logits_dtype).name,
                            temperature=float(cfg.temperature))
  return _fused(hidden_NxD, w, targets_N.astype(jnp.int32), cfg)
