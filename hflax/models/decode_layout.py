"""A model's decoding copy: its dense kernels stored [out, in] in their compute dtype.

A decode step multiplies a few rows (one token per sequence) by every kernel, so it
streams all weights from memory each step. XLA:CPU's matmul library reads a kernel laid
out [out, in] (each output's weights contiguous) faster than the training layout
[in, out]: SmolLM2-135M's layer matmuls, bfloat16 on a 2-core Xeon, took 14.5 against
20.9 ms a step for 16 rows and 23.7 against 29.7 for 64 (float32: 33.8 against 39.8 for
16). A transpose written inside the decode program does not get there: XLA folds it back
into the dot and keeps the [in, out] layout. So a program of its own writes the copy, once
per generate call (about 0.1 s for SmolLM2's fp32 kernels, cast on the way), and the
sampler decodes from it. GPUs and TPUs keep their measured path: the copy is CPU-only.
The copy lives beside the weights while the sampler runs; where it would take more than
half of the host's available memory, the sampler decodes from the weights as they are
and says so once.
"""
from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp
from flax import nnx

from hflax.models.transformer import Dense


def for_decoding(graphdef, state):
  """(graphdef, state) of the decoding copy, or the inputs themselves where it does not
  apply: not on CPU, no plain (adapter-free) kernels, or already a decoding copy."""
  if not _on_cpu(state):
    return graphdef, state
  model = nnx.merge(graphdef, state)
  dense = [m for _, m in nnx.iter_modules(model)
           if isinstance(m, Dense) and not m.out_in and m.lora_a is None]
  if not dense:
    return graphdef, state
  # Cast to the compute dtype (what the matmul reads), never widened: a bfloat16 generation
  # copy computing in float32 stays bfloat16.
  dtypes = tuple(min(m.dtype, m.kernel[...].dtype, key=lambda d: jnp.dtype(d).itemsize)
                 for m in dense)
  size = sum(m.kernel[...].size * jnp.dtype(d).itemsize for m, d in zip(dense, dtypes))
  if size > available_memory() // 2:
    _warn_once(f"generate: decoding from the weights as stored: their [out, in] copy "
               f"({size / 2**30:.1f} GiB) would take over half of the available memory")
    return graphdef, state
  kernels = _transposed(tuple(m.kernel[...] for m in dense), dtypes)
  for m, kernel in zip(dense, kernels):
    m.kernel = m.kernel.replace(kernel, axes=tuple(reversed(m.kernel.axes)))
    m.out_in = True
  return nnx.split(model)


def available_memory() -> int:
  """Bytes the host can still give (Linux's MemAvailable; unbounded where unknown)."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return 2**62


@functools.cache
def _warn_once(message: str):
  logging.getLogger(__name__).warning(message)


def _on_cpu(state) -> bool:
  leaves = jax.tree.leaves(state)
  return bool(leaves) and all(d.platform == "cpu" for d in leaves[0].devices())


@functools.partial(jax.jit, static_argnums=1)
def _transposed(kernels, dtypes):
  return tuple(k.T.astype(dtype) for k, dtype in zip(kernels, dtypes))
