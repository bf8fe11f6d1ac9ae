"""When the fused Pallas log-prob kernel (logprobs.py) serves, read from HFLAX_LOGPROB_KERNEL.

HFLAX_LOGPROB_KERNEL picks how `hflax.models.logprobs.hidden_log_probs` runs:
  unset, "auto", "0"  the chunked pure-JAX path, on every backend
  "1"                 the fused Pallas (Triton) kernel in any GPU process (an error on
                      other backends and where Triton cannot compile for the GPU)
  "interpret"         the kernel in Pallas interpret mode on any backend (tests; slow)
It is read when a function is traced, so set it before the first call of a jitted step.

"auto" does not pick the kernel: on an H100 it ran slower than the chunked path
(bench/accelerator.py's rows), and the chunked path does not hold the [tokens, vocab]
logits either. XLA cannot partition a Pallas custom call, so with "1" a sharded program
gathers the operands and every device computes every row.
"""
from __future__ import annotations

import functools
import os
import re

import jax

from hflax import platforms

ENV = "HFLAX_LOGPROB_KERNEL"
_OFF, _AUTO, _ON = ("0", "false", "off"), ("", "auto"), ("1", "true", "on")


@functools.lru_cache(maxsize=None)
def _triton_importable() -> bool:
  try:
    from jax.experimental.pallas import triton  # noqa: F401
  except ImportError:
    return False
  return True


MIN_COMPUTE_CAPABILITY = 8.0  # bf16 tensor-core dots in Triton start with Ampere


def _gpu_problem() -> str | None:
  """Why the kernel cannot compile for this process's first GPU, or None."""
  if not _triton_importable():
    return "jax.experimental.pallas.triton does not import"
  device = jax.local_devices()[0]
  capability = str(getattr(device, "compute_capability", ""))
  if not re.fullmatch(r"\d+\.\d+", capability):  # ROCm's is an arch name ("gfx90a")
    return f"{device.device_kind} is not a CUDA device (compute capability {capability!r})"
  if float(capability) < MIN_COMPUTE_CAPABILITY:
    return (f"{device.device_kind} has compute capability {capability}, the kernel needs "
            f"{MIN_COMPUTE_CAPABILITY}")
  return None


def logprob_kernel_mode() -> str | None:
  """"gpu", "interpret", or None for the pure-JAX path."""
  flag = os.environ.get(ENV, "auto").strip().lower()
  if flag not in _OFF + _AUTO + _ON + ("interpret",):
    raise ValueError(f"{ENV}={flag!r}: expected auto, 0, 1 or interpret")
  if flag in _OFF + _AUTO:
    return None
  if flag == "interpret":
    return "interpret"
  if platforms.backend() != "gpu":
    raise ValueError(f"{ENV}={flag} asks for the fused GPU kernel, but JAX's backend is "
                     f"{platforms.backend()}: unset it (or set auto) for the pure-JAX path")
  problem = _gpu_problem()
  if problem:
    raise ValueError(f"{ENV}={flag}: {problem}")
  return "gpu"
