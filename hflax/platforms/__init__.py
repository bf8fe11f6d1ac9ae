"""The one place that knows the hardware.

Everything that differs by backend (kernels, compiler options, process set-up) is chosen
here; model, rollout, sharding and controller code asks this package instead of reading
`jax.default_backend()` or a device's `platform` itself.
"""
from __future__ import annotations

from typing import Iterable

import jax


def backend() -> str:
  """The default JAX backend's name: "cpu", "gpu" or "tpu"."""
  return jax.default_backend()


def all_cpu(devices: Iterable) -> bool:
  """Whether every one of `devices` (jax devices) is a CPU device."""
  return all(d.platform == "cpu" for d in devices)
