"""Collective times under the alpha-beta model, and which link a device group uses.

Bandwidth terms are those of ring algorithms (optimal for large messages); the latency
term is that of tree / recursive-doubling algorithms (what NCCL and XLA pick for small
messages): ceil(log2 n) hops of `collective_latency` each.

Meshes lay devices out in (data, fsdp, tensor) order, tensor fastest, so a group of devices
that are `stride` apart, `size` of them, spans size * stride consecutive devices; it stays on
the intra-node links only when that span fits in one node.
"""
from __future__ import annotations

import math

from hflax.sharding.automap.profile import DeviceProfile


def link_bandwidth(profile: DeviceProfile, span: int) -> float:
  """Sustained per-device bandwidth of a group spanning `span` consecutive devices."""
  link = (profile.intra_node_bandwidth if span <= profile.devices_per_node
          else profile.inter_node_bandwidth)
  return link * profile.bandwidth_efficiency


def all_gather(profile: DeviceProfile, nbytes: float, size: int, span: int,
               pieces: int = 1) -> float:
  """Ring all-gather that leaves `nbytes` on every device (each receives (n-1)/n of it),
  as `pieces` separate collectives (one per weight tensor, say), each paying the latency."""
  if size <= 1:
    return 0.0
  return (pieces * _latency(profile, size)
          + nbytes * (size - 1) / size / link_bandwidth(profile, span))


def reduce_scatter(profile: DeviceProfile, nbytes: float, size: int, span: int) -> float:
  """Ring reduce-scatter of `nbytes` per device (the mirror image of all_gather)."""
  return all_gather(profile, nbytes, size, span)


def all_reduce(profile: DeviceProfile, nbytes: float, size: int, span: int) -> float:
  """A reduce-scatter then an all-gather."""
  if size <= 1:
    return 0.0
  return _latency(profile, size) + \
      2 * nbytes * (size - 1) / size / link_bandwidth(profile, span)


def all_to_all(profile: DeviceProfile, nbytes: float, size: int, span: int) -> float:
  """Every device sends 1/size of its `nbytes` buffer to each other device of the group
  (and keeps its own block)."""
  if size <= 1:
    return 0.0
  return _latency(profile, size) + nbytes * (size - 1) / size / link_bandwidth(profile, span)


def transfer(profile: DeviceProfile, nbytes: float, span: int) -> float:
  """Every device receives `nbytes` from peers spread over `span` devices."""
  return profile.collective_latency + nbytes / link_bandwidth(profile, span)


def _latency(profile: DeviceProfile, size: int) -> float:
  return math.ceil(math.log2(size)) * profile.collective_latency
