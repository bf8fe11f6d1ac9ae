"""Device arrays as host (numpy) values, whether the devices are this process's or spread
over several (a jax.distributed job: a Ray pool of several processes).

An array on this process's devices, or replicated onto each, is read from a local copy;
one sharded over other processes' devices is gathered with `process_allgather`, a
collective: every process must read the same arrays in the same order, as the processes
of a pool do when each runs the same host program (the rollout engine's steps, a role
method's result)."""
from __future__ import annotations

import jax
import numpy as np


def host_array(x: jax.Array) -> np.ndarray:
  if x.is_fully_addressable:
    return np.asarray(x)
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  from jax.experimental import multihost_utils
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def host_values(tree):
  """jax.device_get for arrays on any process's devices (module docstring)."""
  return jax.tree.map(lambda x: host_array(x) if isinstance(x, jax.Array) else x, tree)


def broadcast_bytes(data: bytes | None) -> bytes:
  """Process 0's `data` on every process of a jax.distributed job (the others pass None):
  its length, then the bytes padded to a power of two (a few buffer shapes, so a few
  compiled broadcasts). A collective: every process calls it at the same point."""
  from jax.experimental import multihost_utils
  source = jax.process_index() == 0
  if source and data is None:
    raise ValueError("broadcast_bytes: process 0 sends the bytes")
  size = np.asarray([len(data) if source else 0], np.int64)
  size = int(multihost_utils.broadcast_one_to_all(size)[0])
  buffer = np.zeros(max(1024, 1 << (size - 1).bit_length()), np.uint8)
  if source:
    buffer[:size] = np.frombuffer(data, np.uint8)
  buffer = multihost_utils.broadcast_one_to_all(buffer)  # summed with the others' zeros
  return np.asarray(buffer, np.uint8)[:size].tobytes()
