"""XLA settings a CPU run needs before JAX starts (this module must not import jax):
simulated host devices, so per-model meshes exist on a plain CPU. Flags the user already
set in XLA_FLAGS are left as they are."""
from __future__ import annotations

import os

_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def configure_cpu(devices: int | None = None) -> str:
  """Adds the simulated device count to XLA_FLAGS (unless set) and returns XLA_FLAGS.

  devices: None takes HFLAX_CPU_DEVICES (default 2).
  """
  flags = os.environ.get("XLA_FLAGS", "").split()
  if not any(f.startswith(_DEVICES_FLAG) for f in flags):
    count = devices if devices is not None else int(os.environ.get("HFLAX_CPU_DEVICES", "2"))
    flags.append(f"{_DEVICES_FLAG}={count}")
  os.environ["XLA_FLAGS"] = " ".join(flags)
  return os.environ["XLA_FLAGS"]
