"""Parameter layouts: logical axis names -> mesh axes, for training and for generation.

Training shards every weight across the whole pool (FSDP): its model-parallel dimension
(heads, mlp, vocab) over the pool's ("fsdp", "tensor") axes, so that generation's tensor
parallelism, which splits that same dimension over fewer devices, finds each device's
training shard inside its generation shard (see hybrid_engine). Weights without such a
dimension, or whose size does not divide, fall back to the next candidate, then to
replication.

Mixture-of-experts weights stack their experts on a logical "expert" axis, split over a
mesh axis of the same name where the mesh has one (expert parallelism): each device holds
its experts whole over that axis, and the batch's rows split over it too (ROW_AXES), so
the devices of an expert group are also data parallel for everything else. An expert's
own width ("expert_mlp") splits like a dense MLP's.
"""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from hflax.models.config import ROW_AXES  # noqa: F401  (the model splits its rows by them)

TRAIN_AXES = ("data", "fsdp", "tensor")
GENERATE_AXES = ("data", "tensor")
EXPERT_AXIS = "expert"
_MODEL_PARALLEL = ("q_heads", "kv_heads", "mlp", "expert_mlp", "vocab")

# Logical axis -> mesh axes it may be split over, in priority order across the whole spec.
TRAIN_RULES = ((EXPERT_AXIS, (EXPERT_AXIS,)),) + tuple(
    (name, ("fsdp", "tensor")) for name in _MODEL_PARALLEL) + (("embed", ("fsdp", "tensor")),)
GENERATE_RULES = ((EXPERT_AXIS, (EXPERT_AXIS,)),) + tuple(
    (name, ("tensor",)) for name in _MODEL_PARALLEL)


def partition_spec(axes, shape, rules, mesh: Mesh) -> P:
  """The PartitionSpec for one array; a dimension is split only where its size divides."""
  spec: list = [None] * len(shape)
  used: set[str] = set()
  for logical, mesh_axes in rules:
    for dim, name in enumerate(axes or ()):
      if name != logical or spec[dim] is not None:
        continue
      mesh_axes = tuple(a for a in mesh_axes if a in mesh.shape and mesh.shape[a] > 1
                        and a not in used)
      size = int(np.prod([mesh.shape[a] for a in mesh_axes])) if mesh_axes else 1
      if mesh_axes and shape[dim] % size == 0:
        spec[dim] = mesh_axes if len(mesh_axes) > 1 else mesh_axes[0]
        used.update(mesh_axes)
  return P(*spec)


def _is_var(x):
  return isinstance(x, nnx.Variable)


def state_shardings(state, mesh: Mesh, rules):
  """NamedShardings shaped like an nnx.State (its Variables' `axes` metadata pick them)."""
  return jax.tree.map(
      lambda v: NamedSharding(mesh, partition_spec(v.get_metadata().get("axes"),
                                                   v.get_value().shape, rules, mesh)),
      state, is_leaf=_is_var)


def train_mesh(devices, data: int = 1, fsdp: int | None = None, tensor: int = 1,
               expert: int = 1) -> Mesh:
  """A (data, fsdp, tensor) mesh, with a fourth axis "expert" where expert > 1."""
  devices = np.asarray(devices)
  fsdp = fsdp or devices.size // (data * tensor * expert)
  if data * fsdp * tensor * expert != devices.size:
    raise ValueError(f"mesh data={data} x fsdp={fsdp} x tensor={tensor} x expert={expert} = "
                     f"{data * fsdp * tensor * expert} does not match the pool's "
                     f"{devices.size} devices")
  if expert > 1:
    return Mesh(devices.reshape(data, fsdp, expert, tensor),
                TRAIN_AXES[:2] + (EXPERT_AXIS,) + TRAIN_AXES[2:])
  return Mesh(devices.reshape(data, fsdp, tensor), TRAIN_AXES)


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """Rows split over every data-parallel axis the mesh has; tensor groups share a shard."""
  axes = tuple(a for a in ROW_AXES if a in mesh.shape)
  return NamedSharding(mesh, P(axes))


def data_parallel_size(mesh: Mesh) -> int:
  return int(np.prod([mesh.shape[a] for a in ROW_AXES if a in mesh.shape]))
