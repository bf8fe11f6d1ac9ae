"""x @ w in a low-precision compute dtype on CPUs, accumulated and returned through float32.

Why not a plain `jnp.dot` of two bfloat16 arrays: XLA:CPU sends a dot to its fast library
(YNNPACK, AMX tiles where the CPU has them) only when it reads bfloat16 and writes float32.
Asked for a bfloat16 result, it runs its generic kernel: on a 2-core Xeon with AMX, a
[1024, 576] x [576, 1536] product ran at 307 GFLOP/s that way against 1879 with a float32
result, and a 64-row decode matmul at 158 against 996. The float32 sum is also what GPUs'
GEMMs accumulate in. The result is rounded to the compute dtype once, as before.

The gradient is written out so that its two matmuls read bfloat16 too: left to autodiff,
the cotangent of the float32 product is float32, and a float32 x bfloat16 matmul runs in
float32. The weight gradient comes back in the weight's own dtype (float32 master weights
get a float32 gradient, not one rounded to bfloat16 on the way). It contracts over the
rows, a layout XLA:CPU's fast library does not take, so there it still runs in float32.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax


def dense_dot(x, w, dtype):
  """x [..., K] contracted with w [K, ...] (w's first axis), computed in `dtype`, the
  result [..., *w.shape[1:]] in `dtype`."""
  dtype = jnp.dtype(dtype)
  x = x.astype(dtype)
  if dtype == jnp.float32 or jax.default_backend() != "cpu":
    # GPUs and TPUs accumulate low-precision dots in float32 on their own; their path stays
    # the one measured there (bench/accelerator.py).
    return jnp.tensordot(x, w.astype(dtype), axes=1)
  return _low_precision_dot(x, w)


@jax.custom_vjp
def _low_precision_dot(x, w):
  """x (the compute dtype) @ w (any float dtype, cast to x's)."""
  return lax.dot_general(x, w.astype(x.dtype), (((x.ndim - 1,), (0,)), ((), ())),
                         preferred_element_type=jnp.float32).astype(x.dtype)


def _forward(x, w):
  return _low_precision_dot(x, w), (x, w)


def _backward(saved, g):
  x, w = saved
  g = g.astype(x.dtype)
  # dx = g w^T: both operands contract their trailing axes, a layout the fast path takes.
  out_axes = w.ndim - 1
  dx = lax.dot_general(g, w.astype(x.dtype),
                       ((tuple(range(g.ndim - out_axes, g.ndim)), tuple(range(1, w.ndim))),
                        ((), ())),
                       preferred_element_type=jnp.float32).astype(x.dtype)
  rows = range(x.ndim - 1)
  dw = lax.dot_general(x, g, ((tuple(rows), tuple(rows)), ((), ())),
                       preferred_element_type=jnp.float32).astype(w.dtype)
  return dx, dw


_low_precision_dot.defvjp(_forward, _backward)
