"""The plain path: what GPUs and TPUs run, pure JAX with XLA's own kernels.

The platform kernels (cpu/, gpu/, tpu/) are checked against these forms, and a kernel
whose backward pass is plain JAX shares its formula from here, so the two paths cannot
drift apart.
"""
from __future__ import annotations

import jax.numpy as jnp


def logits_cotangent(z, hit, lse, mean, d_logp, d_ent):
  """d/dz of d_logp * log p[target] + d_ent * entropy, z = logits / temperature, from the
  forward's statistics: d_logp ([j = t] - p_j) - d_ent p_j (z_j - mean z), p = exp(z - lse).
  hit marks the target; the rest broadcast against z [..., V]."""
  p = jnp.exp(z - lse)
  return d_logp * (hit - p) - d_ent * p * (z - mean)
