"""Every HFLAX_CPU_* environment variable, read here and nowhere else.

Each is read when asked (not at import), so a test or a user that sets one later in the
process is heard; this module imports no JAX (the process set-up reads it before JAX
starts). A switch is off for "0", "false" or "off" (any case); anything else, or unset,
leaves it on.
"""
from __future__ import annotations

import os

DEVICES = "HFLAX_CPU_DEVICES"  # simulated CPU devices (default 2)
MALLOC = "HFLAX_CPU_MALLOC"  # glibc keeping freed memory (process.keep_freed_memory)
MATMUL = "HFLAX_CPU_MATMUL"  # the decoding copy's packed matmul kernel (matmul.py)
ATTENTION = "HFLAX_CPU_ATTENTION"  # the decode-attention kernel (attention.py)
YNN = "HFLAX_CPU_YNN"  # YNNPACK dot fusions in float32 training steps (options.py)
FAST_MATH = "HFLAX_CPU_FAST_MATH"  # fast-math reassociation in bfloat16 training steps
_OFF = ("0", "false", "off")


def turned_off(name: str) -> str | None:
  """"NAME=value" where the switch `name` is turned off, else None."""
  value = os.environ.get(name, "")
  return f"{name}={value}" if value.strip().lower() in _OFF else None


def devices() -> int:
  """HFLAX_CPU_DEVICES (default 2): simulated CPU devices; a bad value is one line."""
  text = os.environ.get(DEVICES, "2")
  if not text.strip().isdigit() or int(text) < 1:
    raise ValueError(f"environment variable {DEVICES}: {text!r} is not a whole number "
                     ">= 1 (simulated CPU devices; unset it for 2)")
  return int(text)
