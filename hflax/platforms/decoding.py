"""The one seam for a model's decoding copy: what the sampler and the hybrid engine ask,
whatever the hardware.

A platform may decode from a copy of the weights laid out for its decode steps. XLA:CPU
does (cpu/decoding_copy.py: kernels stored [out, in], fused and packed for its matmul
library and the CPU kernels); XLA on GPUs and TPUs decodes from the weights as they are,
so its Decoding is the identity. `decoding(devices)` picks one for the devices the weights
live on; rollout and sharding code calls for_decoding / leafwise_plan here and never
imports a platform's module.

This module sits above the models (the CPU copy's modules subclass the model's) and
imports a platform's copy only when its devices are that platform's.
"""
from __future__ import annotations

from typing import Protocol

import jax

from hflax import platforms


class Decoding(Protocol):
  """What a platform's decoding copy offers (cpu/decoding_copy.py is the CPU's)."""

  def for_decoding(self, graphdef, state) -> tuple:
    """(graphdef, state) to decode from: the copy, or the inputs where none applies."""

  def leafwise_plan(self, graphdef, abstract, devices, replicas):
    """How a copy is written leaf by leaf from sharded training weights (a plan with
    graphdef, abstract and one leaf_copy.Recipe per leaf), or None: decode as stored."""

  def fits_in_memory(self, copy_bytes: int) -> bool:
    """Whether a copy of that many bytes may be written now."""

  def forget_decoding_copy(self) -> None:
    """Drops any copy kept for reuse."""


class Plain:
  """XLA's own path (GPUs, TPUs, anything not a CPU): decode from the weights as stored."""

  def for_decoding(self, graphdef, state) -> tuple:
    return graphdef, state

  def leafwise_plan(self, graphdef, abstract, devices, replicas):
    return None

  def fits_in_memory(self, copy_bytes: int) -> bool:
    return True

  def forget_decoding_copy(self) -> None:
    pass


PLAIN = Plain()


def decoding(devices) -> Decoding:
  """The Decoding for weights on `devices` (jax devices): the CPU platform's where every
  one is a CPU device, the plain path elsewhere (and for no devices at all)."""
  devices = list(devices)
  if devices and platforms.all_cpu(devices):
    # A module serves as the CPU's Decoding: its functions are the protocol's methods.
    from hflax.platforms.cpu import decoding_copy
    return decoding_copy
  return PLAIN


def state_devices(state) -> set:
  """The devices the jax arrays of `state` live on (none for shape structs or numpy)."""
  return {d for x in jax.tree.leaves(state) if isinstance(x, jax.Array)
          for d in x.sharding.device_set}


def for_decoding(graphdef, state) -> tuple:
  """(graphdef, state) of the decoding copy the platform of `state`'s devices decodes
  from, or the inputs themselves where it decodes from the weights as stored."""
  return decoding(state_devices(state)).for_decoding(graphdef, state)


def leafwise_plan(graphdef, abstract, devices, replicas: int | None):
  """The plan of a copy the hybrid engine writes leaf by leaf onto `devices` (the
  generation mesh's and the training sources'), or None (see Decoding.leafwise_plan)."""
  return decoding(devices).leafwise_plan(graphdef, abstract, devices, replicas)

