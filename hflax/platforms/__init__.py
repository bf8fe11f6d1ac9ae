"""The one place that knows the hardware.

Everything that differs by backend (kernels, compiler options, process set-up) is chosen
here; model, rollout, sharding and controller code asks this package instead of reading
`jax.default_backend()` or a device's `platform` itself.

  xla.py            the plain path GPUs and TPUs take
  cpu/              XLA:CPU: the decoding copy, its kernels and their build, process
                    set-up and compiler options; every HFLAX_CPU_* setting in settings.py
  gpu/, tpu/        cuDNN attention and the Pallas log-prob kernel; splash attention
  compile_cache.py  JAX's persistent compilation cache (any backend)

This package imports jax only inside its functions: the CPU process set-up runs before
JAX starts.
"""
from __future__ import annotations

from typing import Iterable


def backend() -> str:
  """The default JAX backend's name: "cpu", "gpu" or "tpu"."""
  import jax
  return jax.default_backend()


def on_cpu() -> bool:
  """Whether the default backend is XLA:CPU (whose tunings the cpu platform holds)."""
  return backend() == "cpu"


def all_cpu(devices: Iterable) -> bool:
  """Whether every one of `devices` (jax devices) is a CPU device."""
  return all(d.platform == "cpu" for d in devices)


def train_compiler_options(devices, compute_dtype="float32") -> dict | None:
  """XLA options for a training step on `devices` computing in `compute_dtype`: XLA:CPU's
  (cpu/options.py) where every device is a CPU, None (XLA's defaults) elsewhere."""
  if not all_cpu(devices):
    return None
  from hflax.platforms.cpu.options import train_options
  return train_options(compute_dtype)
