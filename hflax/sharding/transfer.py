"""Moving arrays between shardings without stalling the controller.

On CPU, jax.device_put of an array that is still being computed to a different sharding
waits for the value before it returns (measured with jax 0.10.2: replicated -> split over
the same devices), which would serialise roles that should overlap. Between two shardings
over the same devices in the same order, `move` runs a jitted identity with the target as
its output sharding instead: an ordinary program, dispatched asynchronously and queued
behind its producer on those devices. Between different device sets it keeps
jax.device_put: copying pieces of not-yet-computed arrays across devices asynchronously
(as `assemble` can) held XLA:CPU's few worker threads waiting on their sources when many
were in flight, which hung a colocated Safe-RLHF step in CI.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, SingleDeviceSharding


def move(x, sharding):
  """`x` (host data or a jax.Array) laid out as `sharding`; without waiting for `x` when
  both shardings span the same devices in the same order."""
  if not isinstance(x, jax.Array):
    return jax.device_put(x, sharding)
  if isinstance(sharding, jax.Device):
    sharding = SingleDeviceSharding(sharding)
  if x.sharding == sharding:
    return x
  same = _device_order(x.sharding)
  if same is not None and same == _device_order(sharding):
    return _identity(sharding)(x)
  return jax.device_put(x, sharding)


def _device_order(sharding):
  if isinstance(sharding, NamedSharding):
    return tuple(sharding.mesh.devices.flat)
  if isinstance(sharding, SingleDeviceSharding):
    return tuple(sharding.device_set)
  return None


@functools.lru_cache(maxsize=None)
def _identity(sharding):
  return jax.jit(lambda a: a, out_shardings=sharding)


def _region(index, shape) -> tuple[tuple[int, int], ...]:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def assemble(x: jax.Array, sharding) -> jax.Array:
  """`x` laid out as `sharding`, built on each destination device from the pieces of the
  source shards that cover its new shard: its own shard first, then device-to-device
  copies of the rest. No host round trip, no full copy anywhere, and no collective
  program (XLA's CPU collectives rendezvous all participants, which many transfers in
  flight can starve on a small thread pool).

  A pool spanning several processes (the Ray backend) cannot build shards from pieces it
  does not address; there the switch is one jax.device_put, which for two shardings over
  the same devices in the same order (the generate mesh keeps the training order)
  compiles to a resharding program whose collectives cross the processes."""
  if not x.is_fully_addressable:
    return jax.device_put(x, sharding)
  shape = x.shape
  sources = [(s.device, _region(s.index, shape), s.data) for s in x.addressable_shards]
  built = []
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    want, pieces = _region(index, shape), {}
    for src_device, have, data in sorted(sources, key=lambda t: t[0] != device):
      part = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(want, have))
      if any(lo >= hi for lo, hi in part) or part in pieces:
        continue  # disjoint, or a replica of a piece already taken (local ones first)
      local = tuple(slice(lo - b0, hi - b0) for (lo, hi), (b0, _) in zip(part, have))
      whole = all(sl.stop - sl.start == n for sl, n in zip(local, data.shape))
      piece = data if whole else data[local]
      pieces[part] = piece if src_device == device else jax.device_put(piece, device)
    built.append(_join(pieces))
  return jax.make_array_from_single_device_arrays(shape, sharding, built)


def _join(pieces: dict, dim: int = 0):
  """Concatenates pieces keyed by their (start, stop) per dimension into one block."""
  if len(pieces) == 1:
    return next(iter(pieces.values()))
  starts = sorted({key[dim][0] for key in pieces})
  if len(starts) == 1:
    return _join(pieces, dim + 1)
  return jnp.concatenate([_join({k: v for k, v in pieces.items() if k[dim][0] == s}, dim + 1)
                          for s in starts], axis=dim)
