"""One decode step's attention on x86 CPUs with AVX-512, through a kernel of our own
(attention.cc, built with matmul.cc) that XLA calls as a custom call (jax.ffi).

Why: attention.one_query, XLA's best decode step, ran as five programs a layer (the keys
widened to float32 and written out, the scores, a max, a sum, the values' dot), each
reading or writing the whole cache, a sizeable share of a many-row decode step. The kernel
reads each row's keys and values once, from the cache as it lies (the keys' bfloat16
bits), and keeps its scores in L1, prefetching the next head's keys and values into L2
meanwhile (without that it lost to XLA). Whole generate calls run faster through it in
bfloat16 and float32, the float32 tokens unchanged (bench/generate.py measures them).

Numerics: the scores are multiply-adds over head_dim in one_query's order with the same
scale and mask (in bfloat16 the products are exact in float32, so the scores are
one_query's exactly; in float32 each fused multiply-add rounds once); the softmax's exp
is a polynomial within 2 ulp of float32's; the values are summed in slot order (XLA's
dot chooses its own), so results differ from one_query's by float32 rounding
(bfloat16's probabilities and outputs are rounded as one_query rounds them).

Each row is read only up to its last visible slot (all of them where it sees none), so
a cache wider than what it holds costs no reads: the sampler grows the cache once, to its
full width, where every layer attends through the kernel (decoding.kernel_attends) instead
of between loop segments, each growth a copy of the whole cache; the result is the
narrow cache's bit for bit.

Used where the decoding copy says so (copy_modules.CopyAttention.cpu_attention: weights
whole on one device per core, as for cpu_matmul's kernels, since the kernel runs on one
thread and cannot be partitioned), for bfloat16 and float32 caches with head_dim a multiple of 16.
HFLAX_CPU_ATTENTION=0 turns it off; `problem` says why it cannot serve, logged once.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from hflax.platforms.cpu import matmul as cpu_matmul
from hflax.platforms.cpu import settings

ENV = settings.ATTENTION
DTYPES = ("bfloat16", "float32")  # of the caches (and queries) it reads
LANES = 16  # head_dim is taken 16 at a time: a 512-bit register of float32
_TARGETS = {"bfloat16": ("hflax_cpu_attention_bf16", "HflaxCpuAttentionBf16"),
            "float32": ("hflax_cpu_attention_f32", "HflaxCpuAttentionF32")}
_FLAGS = {"avx512f", "avx512bw", "avx512vl"}


def problem(dtype) -> str | None:
  """Why the kernel cannot serve caches in `dtype` in this process, or None."""
  dtype = jnp.dtype(dtype)
  off = settings.turned_off(ENV)
  if off:
    return off
  if dtype.name not in DTYPES:
    return f"no kernel for {dtype.name}"
  return cpu_matmul.backend_problem() or cpu_matmul.machine_problem(_FLAGS)


def usable(dtype) -> bool:
  """Whether decode steps in `dtype` may attend through the kernel (logs why not, once)."""
  reason = problem(dtype)
  if reason is not None:
    cpu_matmul.note_once(f"decode attention through XLA in {jnp.dtype(dtype).name}: {reason}")
  return reason is None


def fits(head_dim: int) -> bool:
  """Whether the kernel takes heads of this size."""
  return head_dim > 0 and head_dim % LANES == 0


def serves(q_dtype, k_cache, v_cache) -> bool:
  """Whether a decode step with these queries and cache attends through the kernel now:
  it takes them and nothing turned it off since the decoding copy asked for it
  (HFLAX_CPU_ATTENTION=0 set later falls back to XLA's attention, logged)."""
  return takes(q_dtype, k_cache, v_cache) and usable(q_dtype)


def takes(q_dtype, k_cache, v_cache) -> bool:
  """Whether the kernel reads this cache for queries of q_dtype: bfloat16 keys as their
  bits (or as bfloat16) with bfloat16 values, or float32 throughout."""
  q, k, v = jnp.dtype(q_dtype), jnp.dtype(k_cache.dtype), jnp.dtype(v_cache.dtype)
  if q == jnp.bfloat16:
    return k in (jnp.uint16, jnp.bfloat16) and v == jnp.bfloat16
  return q == k == v == jnp.float32


def decode(q_BxHxDh, k_BxKxDhxS, v_BxKxSxDh, visible_BxS):
  """[B, H, Dh] in q's dtype: each row's one query per head against its cache (keys
  [B, KV, Dh, S], values [B, KV, S, Dh]) at the slots `visible` (bool [B, S]) marks,
  H // KV consecutive query heads a KV head, as attention.one_query computes it."""
  dtype = jnp.dtype(q_BxHxDh.dtype)
  if not takes(dtype, k_BxKxDhxS, v_BxKxSxDh):
    raise ValueError(f"hflax cpu attention: no kernel for {dtype.name} queries on "
                     f"{k_BxKxDhxS.dtype} keys and {v_BxKxSxDh.dtype} values")
  if not fits(q_BxHxDh.shape[-1]):
    raise ValueError(f"hflax cpu attention: head_dim {q_BxHxDh.shape[-1]} is not a "
                     f"positive multiple of {LANES}")
  reason = problem(dtype)
  if reason is not None:
    raise RuntimeError(f"hflax cpu attention: {reason}")
  if k_BxKxDhxS.dtype == jnp.bfloat16:
    k_BxKxDhxS = jax.lax.bitcast_convert_type(k_BxKxDhxS, jnp.uint16)
  call = jax.ffi.ffi_call(cpu_matmul.register(*_TARGETS[dtype.name]),
                          jax.ShapeDtypeStruct(q_BxHxDh.shape, dtype), vmap_method="sequential")
  return call(q_BxHxDh, k_BxKxDhxS, v_BxKxSxDh, visible_BxS.astype(bool))
