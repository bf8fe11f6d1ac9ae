"""x @ w on CPUs: low-precision dots accumulated and returned through float32, and
gradients laid out for XLA:CPU's matmul library in every dtype.

Why not a plain `jnp.dot` of two bfloat16 arrays: XLA:CPU sends a dot to its fast library
(YNNPACK, AMX tiles where the CPU has them) only when it reads bfloat16 and writes float32.
Asked for a bfloat16 result, it runs its generic kernel, several times slower (a
prefill's products and a decode step's alike). The float32 sum is also what GPUs' GEMMs
accumulate in. The result is rounded to the compute dtype once, as before.

The gradient is written out so that its two matmuls read bfloat16 too: left to autodiff,
the cotangent of the float32 product is float32, and a float32 x bfloat16 matmul runs in
float32. The weight gradient comes back in the weight's own dtype (float32 master weights
get a float32 gradient, not one rounded to bfloat16 on the way). It contracts over the
rows, a layout the library does not take, so x is first written out transposed
(`row_major_transpose`). float32 takes the same path on CPU: autodiff's weight gradients
ran on XLA's generic dot there, and the fp32 update runs faster this way.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental.layout import Layout, with_layout_constraint

from hflax import platforms
from hflax.models.tracing import traced_once


@traced_once(static_argnums=2, static_argnames=("out_in", "kernel_left", "packed"))
def dense_dot(x, w, dtype, *, out_in: bool = False, kernel_left: bool = False, low=None,
              packed: bool = False):
  """x [..., K] contracted with w [K, ...] (w's first axis), computed in `dtype`, the
  result [..., *w.shape[1:]] in `dtype`; with out_in, w is [..., K] (its last axis) and
  the result [..., *w.shape[:-1]]: a decoding copy's kernel, never differentiated, put on
  the left for a few rows with kernel_left (rows_by_kernel: where the result's consumer
  reads it transposed at no cost), or with packed, one in the CPU kernel's packed layout
  (bfloat16 or float32), multiplied by that kernel. `low`: w already cast to `dtype` (compute_copy), read
  in its place on CPU; the gradient still goes to w, in w's dtype."""
  dtype = jnp.dtype(dtype)
  x = x.astype(dtype)
  if packed:
    y = platforms.packed_matmul(x.reshape(-1, x.shape[-1]), w.reshape(-1, w.shape[-1]), dtype)
    return y.reshape(x.shape[:-1] + w.shape[:-1])
  if out_in:
    # As 2-D operands: with x's leading axes kept (a decode step's [B, 1, D]), XLA:CPU
    # lays the kernel back out [in, out] in a copy and the layout's gain is lost.
    wide = jnp.float32 if widens_on_cpu(dtype) else None
    x_RxK, w_NxK = x.reshape(-1, x.shape[-1]), w.astype(dtype).reshape(-1, w.shape[-1])
    y = rows_by_kernel(x_RxK, w_NxK, wide, left=kernel_left)
    return y.reshape(x.shape[:-1] + w.shape[:-1]).astype(dtype)
  if not platforms.dots_want_library_forms():
    # GPUs and TPUs accumulate low-precision dots in float32 on their own; their path stays
    # XLA's (bench/accelerator.py checks it there).
    return jnp.tensordot(x, w.astype(dtype), axes=1)
  return _cpu_dot(x, w, w.astype(dtype) if low is None else low)


def compute_copy(w, dtype):
  """w cast to `dtype` where dense_dot would cast it on every call (on CPU, a kernel of
  another dtype), else None: made once for the micro-batches of an update
  (transformer.compute_kernels)."""
  dtype = jnp.dtype(dtype)
  if not platforms.dots_want_library_forms() or jnp.dtype(w.dtype) == dtype:
    return None
  return w.astype(dtype)


# Up to this many rows (a decode step's), rows_by_kernel puts the kernel on the left on CPU.
KERNEL_LEFT_ROWS = 256


def rows_by_kernel(x_RxK, w_NxK, preferred_element_type=None, *, left: bool = True):
  """x_RxK w_NxK^T, [R, N]: a few rows times a kernel stored [out, in] (a decoding
  copy's).

  On CPU with at most KERNEL_LEFT_ROWS rows, computed as (w x^T)^T: XLA:CPU's matmul
  library repacks its right operand on every call and reads the left one as it lies, so
  the kernel goes on the left and the few rows are what gets repacked (a float32
  projection at a few dozen rows gains about a quarter). The barrier keeps XLA from
  folding the transpose back into the dot (it did, restoring the slow order); the
  transpose then fuses into the consumer, free for an addition, not for every consumer
  (the LM head's gain went into its token pick's transposing copy; step_logits takes it
  for fewer rows), so callers choose (`left`).
  Many rows (a prefill, a training chunk) keep the plain order: there it was as fast or
  faster. So do fewer than LOW_LEFT_MIN_ROWS rows of a 16-bit dtype: in bf16 a few rows
  lost on some CPUs and gained or lost by kernel on others; from LOW_LEFT_MIN_ROWS rows
  bf16 gains on every kernel."""
  dims = (((1,), (1,)), ((), ()))
  if not (left and kernel_on_left(x_RxK.shape[0], x_RxK.dtype)):
    return lax.dot_general(x_RxK, w_NxK, dims, preferred_element_type=preferred_element_type)
  y_NxR = lax.dot_general(w_NxK, x_RxK, dims, preferred_element_type=preferred_element_type)
  return lax.optimization_barrier(y_NxR).T


# Fewer 16-bit rows than this keep the plain order (rows_by_kernel).
LOW_LEFT_MIN_ROWS = 32


def kernel_on_left(rows: int, dtype, max_rows: int | None = None) -> bool:
  """Whether rows_by_kernel puts the kernel on the left for this many rows of `dtype`:
  on CPU, up to max_rows (default KERNEL_LEFT_ROWS; see rows_by_kernel), 16-bit dtypes
  from LOW_LEFT_MIN_ROWS rows."""
  limit = KERNEL_LEFT_ROWS if max_rows is None else max_rows
  if not platforms.dots_want_library_forms() or rows > limit:
    return False
  return jnp.dtype(dtype) == jnp.float32 or rows >= LOW_LEFT_MIN_ROWS


# Up to this many rows, step_logits puts the head's table on the left on CPU.
HEAD_LEFT_ROWS = 32


def head_on_left(rows: int, dtype) -> bool:
  """Whether step_logits puts the table on the left for this many rows of `dtype`."""
  return kernel_on_left(rows, dtype, HEAD_LEFT_ROWS)


def step_logits(hidden_RxD, table_VxD, dtype):
  """float32 logits [R, V] of a generation step's rows against a head table stored [V, D]
  (a tied embedding, or a decoding copy's untied head), the matmul computed in `dtype`:
  tied_logits' product, with the table on the left for up to HEAD_LEFT_ROWS float32 rows
  on CPU (rows_by_kernel), else that product itself.

  Why a limit of its own: the [V, R] product is read transposed by the token pick, a copy
  that grows with the rows, so the head and its pick gain at a few rows and lose at many;
  whole generate calls gain, with the same tokens."""
  if not head_on_left(hidden_RxD.shape[0], dtype):
    return tied_logits(hidden_RxD, table_VxD, dtype)
  return rows_by_kernel(hidden_RxD.astype(dtype), table_VxD.astype(dtype), jnp.float32)


@jax.custom_vjp
def _cpu_dot(x, w, low):
  """x (the compute dtype) @ low, which is w (any float dtype) cast to x's dtype; the
  gradient goes to w, none through the cast.

  Why the cast is an argument: made inside, every micro-batch of an update converted each
  float32 kernel once in the forward and once more in the backward (XLA hoists neither
  out of the micro-batch loop), passes over all the weights that took about as long as
  the gradient accumulation; the caller can make it once (compute_copy), and the
  backward reads the forward's."""
  return lax.dot_general(x, low, (((x.ndim - 1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32).astype(x.dtype)


def _forward(x, w, low):
  return _cpu_dot(x, w, low), (x, w, low)


def _backward(saved, g):
  x, w, low = saved
  g = g.astype(x.dtype)
  # dx = g w^T: both operands contract their trailing axes, a layout the fast path takes.
  out_axes = low.ndim - 1
  dx = lax.dot_general(g, low,
                       ((tuple(range(g.ndim - out_axes, g.ndim)), tuple(range(1, low.ndim))),
                        ((), ())),
                       preferred_element_type=jnp.float32).astype(x.dtype)
  return dx, _weight_gradient(x, g, w.shape, w.dtype), None  # low: w's cast


_cpu_dot.defvjp(_forward, _backward)


def row_major_transpose(x):
  """x with its last two axes swapped, written out in memory as a row-major array, not a
  relabelled view."""
  return with_layout_constraint(jnp.swapaxes(x, -1, -2),
                                Layout(major_to_minor=tuple(range(x.ndim))))


def widens_on_cpu(dtype) -> bool:
  """Whether XLA would widen dots in `dtype` to float32 unless they are laid out for its
  fast library (low precisions on CPU; GPUs and TPUs take them as they are)."""
  return jnp.dtype(dtype) != jnp.float32 and platforms.widens_16_bit()


def _weight_gradient(x, g, w_shape, w_dtype):
  """x [..., K] contracted with g [..., *N] over all leading axes: [K, *N] in w_dtype."""
  x_KxR = row_major_transpose(x.reshape(-1, x.shape[-1]))
  g_RxN = g.reshape(x_KxR.shape[1], -1)
  return lax.dot_general(x_KxR, g_RxN, (((1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32).reshape(w_shape).astype(w_dtype)


def tied_logits(hidden, embed_VxD, dtype):
  """float32 logits [..., V] of hidden [..., D] against an embedding table [V, D] (a tied
  LM head), the matmul computed in `dtype`."""
  return tied_head(embed_VxD, dtype)(hidden)


def tied_head(embed_VxD, dtype):
  """hidden -> tied_logits(hidden, embed, dtype), the table cast to `dtype` once here: a
  caller projecting chunk by chunk (under a conditional that skips dead chunks) would
  otherwise cast all V x D entries again in every chunk, where XLA cannot hoist it."""
  low = embed_VxD.astype(dtype)
  if not platforms.dots_want_library_forms():
    return lambda hidden: jnp.einsum("...d,vd->...v", hidden.astype(dtype), low,
                                     preferred_element_type=jnp.float32)
  return lambda hidden: _cast_logits(hidden.astype(dtype), embed_VxD, low)


@jax.custom_vjp
def _cast_logits(h, embed, low):
  """h @ low^T in float32, where low is embed cast to h's dtype: the gradient goes to
  embed (its own dtype) directly, none through the cast."""
  return lax.dot_general(h, low, (((h.ndim - 1,), (1,)), ((), ())),
                         preferred_element_type=jnp.float32)


def _logits_forward(h, embed, low):
  return _cast_logits(h, embed, low), (h, embed, low)


def _logits_backward(saved, g):
  """The float32 cotangent of the logits is rounded to the compute dtype once, as an
  autocast framework's bf16 logits would carry it: left float32, both matmuls over the
  49k-id vocabulary (two thirds of the head's FLOPs) ran in float32."""
  h, embed, low = saved
  g = g.astype(h.dtype)
  dh = lax.dot_general(g, low, (((g.ndim - 1,), (0,)), ((), ())),
                       preferred_element_type=jnp.float32).astype(h.dtype)
  V, D = embed.shape
  if g.dtype == jnp.float32:
    # XLA:CPU's generic dot contracts the cotangent's rows as they lie; the library first
    # needed the [V, R] transposed copy autodiff's einsum got (the fp32 update runs faster
    # without it).
    d_embed = lax.dot_general(g.reshape(-1, V), h.reshape(-1, D), (((0,), (0,)), ((), ())))
  else:
    # [V, R] x [R, D]: transposing the [R, V] cotangent (bf16) costs far less than
    # transposing a [D, V] float32 product would; XLA's generic dot would widen to float32.
    d_embed = lax.dot_general(row_major_transpose(g.reshape(-1, V)), h.reshape(-1, D),
                              (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
  return dh, d_embed.astype(embed.dtype), None  # low: a symbolic zero, nothing to add up


_cast_logits.defvjp(_logits_forward, _logits_backward)
