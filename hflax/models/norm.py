"""RMSNorm with a hand-written backward pass whose sums over the hidden axis stay in XLA.

y = scale * n, n = x / sqrt(mean(x^2) + eps), normalised in float32 and rounded to the
compute dtype before the scale, as the HF reference does. The backward pass:
dx = r (gn - n mean(gn n)), r = 1 / sqrt(mean(x^2) + eps), gn = dy * scale; dscale is the
sum of dy * n over the tokens.

Why by hand: in a bf16 step XLA:CPU hands autodiff's lone multiply-reduce over hidden to
its matmul library (YNNPACK) as a reduction fusion, slower than this pass, which folds
both of its sums over hidden (x^2, to recompute r instead of saving it, and gn x) into
one variadic reduction that XLA keeps (as chunked_head.softmax_stats does); a bf16
update runs faster for it. fp32 steps, whose reductions stay in XLA anyway, compute the
same numbers as autodiff to rounding.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from hflax.models.tracing import traced_once


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rms_norm(x, scale, eps: float):
  """scale * x / sqrt(mean(x^2, axis=-1) + eps), in x's dtype (scale cast to it)."""
  return _forward(x, scale, eps)[0]


def _forward(x, scale, eps):
  x32 = x.astype(jnp.float32)
  r = lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return scale.astype(x.dtype) * (x32 * r).astype(x.dtype), (x, scale)


def _backward(eps, saved, dy):
  x, scale = saved
  x32 = x.astype(jnp.float32)
  gn = (dy * scale.astype(dy.dtype)).astype(jnp.float32)
  zero = jnp.zeros((), jnp.float32)
  squares, dots = lax.reduce((x32 * x32, gn * x32), (zero, zero),
                             lambda a, b: (a[0] + b[0], a[1] + b[1]), (x.ndim - 1,))
  width = x.shape[-1]
  r = lax.rsqrt(squares[..., None] / width + eps)
  dx = r * gn - x32 * (r * r * r) * dots[..., None] / width
  n = (x32 * r).astype(x.dtype)
  d_scale = jnp.sum((dy * n).astype(jnp.float32).reshape(-1, width), axis=0)
  return dx.astype(x.dtype), d_scale.astype(scale.dtype)


_rms_norm.defvjp(_forward, _backward)
rms_norm = traced_once(static_argnums=2)(_rms_norm)
