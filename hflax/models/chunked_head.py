"""Log-probs and entropy of targets through an LM head, chunk by chunk, with a hand-written
backward pass.

`chunked_log_probs(head, hidden [N, B, C, D], targets [N, B, C], live, T, pieces)` runs
the head over the first `live` pieces of C / pieces columns (loops whose trip counts are
data: whole chunks, then the live pieces of the next one; what lies past the scored
tokens costs nothing) and keeps two [B, C] softmax statistics per chunk. Its backward pass
recomputes each live chunk's logits once and forms their cotangent in one pass over the
vocabulary: d/dz_j of log p_t is [j = t] - p_j and of the entropy -p_j (z_j - mean z),
z = logits / T. Against autodiff of a rematerialised scan under a conditional, this keeps
one chunk's logits alive at a time, never stacks or zero-fills the head's weights per
chunk, and passes over each block of logits three times (two in the forward, one in the
backward). On CPU in 16-bit compute, where the recompute is a quarter of the head's
matmuls and memory is plentiful, the forward keeps the logits of up to KEPT_LOGITS_BYTES
of chunks instead.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from hflax import platforms
from hflax.platforms.xla import logits_cotangent

# Tokens per logits block (rows x columns of a chunk). The head's backward matmuls contract
# over these tokens, and run faster over 512 than over 128 (the update too, in fp32 and
# bf16); 1024 was no faster. The price is memory: four [512, V] float32 blocks in the
# backward.
BLOCK_TOKENS = 512
# On CPU, computing in 16 bits, the forward keeps the chunks' logits for the backward,
# instead of recomputing them there, when all N chunks' logits fit in this many bytes
# (else it recomputes, holding one chunk at a time as on accelerators, where the
# recompute is cheap and memory is not). The
# backward then runs two of the head's matmuls per chunk instead of three, on the same
# logits (bit-equal gradients); bench/rl_step.py's bf16 update runs faster for it. Not in
# float32: there the update ran slower with this and 64-wide key blocks together.
KEPT_LOGITS_BYTES = 1 << 30


def chunk_columns(rows: int, columns: int, chunk: int | None = None) -> int:
  """Columns per chunk of a [rows, columns] block of positions: `chunk` if given, else as
  many as make BLOCK_TOKENS tokens (at least one, at most all)."""
  return max(1, min(columns, chunk or BLOCK_TOKENS // max(rows, 1)))


def softmax_stats(logits_BxCxV, targets_BxC, temperature):
  """log p(target), entropy, logsumexp and mean of z = logits / temperature under p: the
  max, then the sums of exp(z - max) and of exp(z - max) * z in one pass."""
  z = logits_BxCxV.astype(jnp.float32) / temperature
  top = lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
  e = jnp.exp(z - top)
  # One variadic reduction, which XLA keeps: a lone sum(e * z) XLA:CPU hands to its matmul
  # library (YNNPACK) as a reduction fusion, many times slower than XLA's own.
  zero = jnp.zeros((), jnp.float32)
  total, weighted = lax.reduce((e, e * z), (zero, zero),
                               lambda a, b: (a[0] + b[0], a[1] + b[1]), (z.ndim - 1,))
  lse = top[..., 0] + jnp.log(total)
  mean = weighted / total
  picked = jnp.take_along_axis(z, targets_BxC[..., None], axis=-1)[..., 0]
  return picked - lse, lse - mean, lse, mean


def chunked_log_probs(head, hidden_NxBxCxD, targets_NxBxC, live, temperature: float,
                      pieces: int = 1):
  """(log p, entropy), each [N, B, C], of targets under head(hidden) for the first `live`
  pieces (an int or a traced scalar), 0 past them: a piece is C // pieces columns of a
  chunk. Whole chunks are projected as they are, the live pieces of the last live chunk
  one by one (see hidden_log_probs: a packed pass's last chunk is mostly past its count).
  head: hidden [B, C, D] -> logits [B, C, V], differentiated with respect to whatever
  arrays it closes over."""
  N, _, C, _ = hidden_NxBxCxD.shape
  if pieces < 1 or C % pieces:
    raise ValueError(f"pieces={pieces} must divide the chunk's {C} columns")
  # Converted once per input width: the converted head keeps the shapes it was traced at.
  heads, consts = zip(*(jax.closure_convert(head, hidden_NxBxCxD[0, :, :width])
                        for width in dict.fromkeys((C, C // pieces))))
  if any(len(c) != len(consts[0]) or any(a is not b for a, b in zip(c, consts[0]))
         for c in consts):
    raise ValueError("chunked_log_probs: the head closes over different arrays per width")
  live = jnp.clip(jnp.asarray(live, jnp.int32), 0, N * pieces)
  return _project(heads, float(temperature), pieces, hidden_NxBxCxD, targets_NxBxC, live,
                  *consts[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _project(heads, temperature, pieces, hidden, targets, live, *consts):
  return _forward(heads, temperature, pieces, hidden, targets, live, *consts)[0]


def _over_live_spans(pieces, C, live, project, carry):
  """carry through project(at, width, carry) for every live span of columns, at = (chunk,
  first column): the whole chunks (width C), then the live pieces of the chunk after
  them (width C // pieces). Both passes walk the same spans."""
  whole, width = live // pieces, C // pieces
  carry = lax.fori_loop(0, whole, lambda i, c: project((i, 0), C, c), carry)
  return lax.fori_loop(0, live - whole * pieces,
                       lambda p, c: project((whole, p * width), width, c), carry)


def _forward(heads, temperature, pieces, hidden, targets, live, *consts):
  zeros = jnp.zeros(targets.shape, jnp.float32)
  logits = jax.eval_shape(heads[0], hidden[0], *consts)
  keep = (platforms.recompute_is_dear() and jnp.dtype(hidden.dtype).itemsize < 4 and
          hidden.shape[0] * logits.size * logits.dtype.itemsize <= KEPT_LOGITS_BYTES)
  # Chunks past `live` are never written: the backward does not read them either. Not
  # keeping: no chunk (the backward tells by the shape).
  kept = jnp.empty((hidden.shape[0] if keep else 0, *logits.shape), logits.dtype)
  C = hidden.shape[2]

  def project(at, width, carry):
    """One span of columns: at = (chunk, first column)."""
    outs, kept = carry
    logits = heads[width != C](_columns(hidden, at, width), *consts)
    stats = softmax_stats(logits, _columns(targets, at, width), temperature)
    outs = tuple(lax.dynamic_update_slice(o, s[None], (at[0], 0, at[1]))
                 for o, s in zip(outs, stats))
    return outs, (lax.dynamic_update_slice(kept, logits[None], (at[0], 0, at[1], 0))
                  if keep else kept)

  (logp, ent, lse, mean), kept = _over_live_spans(pieces, C, live, project,
                                                  ((zeros,) * 4, kept))
  return (logp, ent), (hidden, targets, live, lse, mean, kept, consts)


def _columns(x_NxBxC___, at, width):
  """x[chunk, :, column:column + width] for at = (chunk, column)."""
  start = (at[0], 0, at[1]) + (0,) * (x_NxBxC___.ndim - 3)
  sizes = (1, x_NxBxC___.shape[1], width) + x_NxBxC___.shape[3:]
  return lax.dynamic_slice(x_NxBxC___, start, sizes)[0]


def _backward(heads, temperature, pieces, saved, cotangents):
  hidden, targets, live, lse, mean, kept, consts = saved
  d_logp, d_ent = cotangents
  floating = [jnp.issubdtype(c.dtype, jnp.inexact) for c in consts]
  C = hidden.shape[2]

  def head_of(h, *float_consts):
    it = iter(float_consts)
    return heads[h.shape[1] != C](h, *[next(it) if f else c for c, f in zip(consts, floating)])

  float_consts = [c for c, f in zip(consts, floating) if f]

  def project(at, width, carry):
    """The gradient of one span of columns: at = (chunk, first column)."""
    d_hidden, d_consts = carry
    span = lambda x: _columns(x, at, width)  # noqa: E731
    logits, pull = jax.vjp(head_of, span(hidden), *float_consts)
    if kept.shape[0]:  # the forward's logits; XLA drops the recomputed ones, now unused
      logits = span(kept)
    z = logits.astype(jnp.float32) / temperature
    hit = jnp.arange(z.shape[-1]) == span(targets)[..., None]
    dz = logits_cotangent(z, hit, *(span(x)[..., None] for x in (lse, mean, d_logp, d_ent)))
    d_h, *d_c = pull((dz / temperature).astype(logits.dtype))
    return (lax.dynamic_update_slice(d_hidden, d_h[None], (at[0], 0, at[1], 0)),
            [acc + d.astype(acc.dtype) for acc, d in zip(d_consts, d_c)])

  start = (jnp.zeros_like(hidden), [jnp.zeros_like(c) for c in float_consts])
  d_hidden, d_float = _over_live_spans(pieces, C, live, project, start)
  it = iter(d_float)
  return (d_hidden, None, None, *[next(it) if f else None for f in floating])


_project.defvjp(_forward, _backward)
