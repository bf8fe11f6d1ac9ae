"""Resource pools and placements: which devices each role runs on, and with which mesh.

A placement is a plain dict (what config files and the auto-mapper produce):

  {"pools": {"train": 4, "score": 4},
   "roles": {"actor":  {"pool": "train", "mesh": {"fsdp": 4}, "generate_tensor": 2,
                        "max_num_seqs": 256},
             "ref":    {"pool": "train", "mesh": {"fsdp": 4}},
             "critic": {"pool": "score", "mesh": {"fsdp": 2, "tensor": 2}},
             "reward": {"pool": "score", "mesh": {"data": 4}}}}

Roles that share a pool are colocated (they run in turn); roles on different pools run
concurrently. Pools take consecutive devices in the order they are listed. The actor's
optional generate_tensor, generate_strided and max_num_seqs set its generation layout and
how many sequences each generation replica holds at once (see hybrid_engine, workers).

Role "rollout" splits the actor's generation off its training devices (verl's one-step-off
recipe, hybrid_engine=False, gives the rollout a resource pool of its own):

  {"pools": {"train": 1, "rollout": 1},
   "roles": {"actor": {"pool": "train"}, "rollout": {"pool": "rollout"}}}

The actor then trains on its pool and generates on the rollout pool's devices (its
generate_tensor and generate_strided laid over them), the weights copied there after each
update; with trainer.mode one_step_off or async the two pools work at the same time. A
rollout role on the actor's own pool is the colocated default.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import numpy as np
from jax.sharding import Mesh

from hflax.sharding.layouts import train_mesh

ROLES = ("actor", "ref", "critic", "reward", "cost", "teacher", "rollout")
# "expert": a mixture of experts' experts split over it (expert parallelism, see layouts).
MESH_AXES = ("data", "fsdp", "tensor", "expert")


@dataclasses.dataclass(frozen=True)
class ResourcePool:
  name: str
  devices: tuple

  @property
  def size(self) -> int:
    return len(self.devices)


@dataclasses.dataclass(frozen=True)
class RolePlacement:
  role: str
  pool: ResourcePool
  mesh: Mesh
  generate_tensor: int = 1
  generate_strided: bool = True  # False: node-local tensor groups (see hybrid_engine)
  max_num_seqs: int = 0  # sequences a generation replica holds at once (0: no cap)
  # The actor's generation devices where role "rollout" has a pool apart from its training
  # pool (a mesh over them in the training axes, laid out by generate_mesh); None: its own.
  generate_on: Mesh | None = None


def colocated(roles: Sequence[str], devices: int, generate_tensor: int = 1) -> dict:
  """Every role on one pool, FSDP over all of it."""
  return {"pools": {"all": devices},
          "roles": {r: {"pool": "all", "mesh": {"fsdp": devices},
                        **({"generate_tensor": generate_tensor} if r == "actor" else {})}
                    for r in roles}}


def standalone(roles: Sequence[str], devices_per_role: int, generate_tensor: int = 1) -> dict:
  """Each role on a pool of its own."""
  return {"pools": {r: devices_per_role for r in roles},
          "roles": {r: {"pool": r, "mesh": {"fsdp": devices_per_role},
                        **({"generate_tensor": generate_tensor} if r == "actor" else {})}
                    for r in roles}}


def split_rollout(roles: Sequence[str], train: int, rollout: int, generate_tensor: int = 1) -> dict:
  """Every role on pool "train" (FSDP over it) but the actor's generation, on pool
  "rollout" (verl's one-step-off layout)."""
  spec = colocated(roles, train, generate_tensor)
  spec["pools"] = {"train": train, "rollout": rollout}
  for r in spec["roles"].values():
    r["pool"] = "train"
  spec["roles"]["rollout"] = {"pool": "rollout"}
  return spec


ROLE_FIELDS = ("pool", "mesh", "generate_tensor", "generate_strided", "max_num_seqs")


def build_placement(spec: Mapping[str, Any], devices=None, *,
                    where: str = "placement") -> dict[str, RolePlacement]:
  """Validates a placement dict and builds each role's pool and mesh.

  Errors name the offending field (`where` is the config path of `spec`).
  """
  devices = list(jax.devices() if devices is None else devices)
  pools_spec, roles_spec = spec.get("pools"), spec.get("roles")
  if not pools_spec:
    raise ValueError(f"{where}.pools: at least one pool is needed, e.g. {{'all': {len(devices)}}}")
  if not roles_spec:
    raise ValueError(f"{where}.roles: no roles placed")
  wanted = sum(int(n) for n in pools_spec.values())
  if wanted > len(devices):
    raise ValueError(f"{where}.pools asks for {wanted} devices ({dict(pools_spec)}) but only "
                     f"{len(devices)} exist")
  pools, start = {}, 0
  for name, size in pools_spec.items():
    if int(size) < 1:
      raise ValueError(f"{where}.pools.{name}: size must be >= 1, got {size}")
    pools[name] = ResourcePool(name, tuple(devices[start:start + int(size)]))
    start += int(size)
  apart = rollout_pool(spec, where)
  placed = {}
  for role, rspec in roles_spec.items():
    field = f"{where}.roles.{role}"
    if role not in ROLES:
      raise ValueError(f"{field}: unknown role; valid roles are {ROLES}")
    unknown = set(rspec) - set(ROLE_FIELDS)
    if unknown:
      raise ValueError(f"{field}: unknown fields {sorted(unknown)}; valid: {ROLE_FIELDS}")
    if rspec.get("pool") not in pools:
      raise ValueError(f"{field}.pool: {rspec.get('pool')!r} is not one of {sorted(pools)}")
    pool = pools[rspec["pool"]]
    shape = dict(rspec.get("mesh") or {"fsdp": pool.size})
    unknown = set(shape) - set(MESH_AXES)
    if unknown:
      raise ValueError(f"{field}.mesh: unknown axes {sorted(unknown)}; use {MESH_AXES}")
    product = int(np.prod([int(shape.get(a, 1)) for a in MESH_AXES]))
    if product != pool.size:
      raise ValueError(f"{field}.mesh: {shape} multiplies to {product} but pool "
                       f"{pool.name!r} has {pool.size} devices")
    tensor_g = int(rspec.get("generate_tensor", 1))
    generates_on = pools[apart] if role == "actor" and apart else pool
    if generates_on.size % tensor_g:
      raise ValueError(f"{field}.generate_tensor: {tensor_g} does not divide pool "
                       f"{generates_on.name!r} of {generates_on.size} devices")
    cap = rspec.get("max_num_seqs", 0)
    if not isinstance(cap, (int, np.integer)) or isinstance(cap, bool) or cap < 0:
      raise ValueError(f"{field}.max_num_seqs: must be an integer >= 0 (0: no cap), got {cap!r}")
    if cap and role != "actor":
      raise ValueError(f"{field}.max_num_seqs: only the actor generates")
    mesh = train_mesh(pool.devices, int(shape.get("data", 1)), int(shape.get("fsdp", 1)),
                      int(shape.get("tensor", 1)), int(shape.get("expert", 1)))
    placed[role] = RolePlacement(role, pool, mesh, tensor_g,
                                 bool(rspec.get("generate_strided", True)), int(cap))
  if apart:
    placed["actor"] = dataclasses.replace(placed["actor"], generate_on=placed["rollout"].mesh)
  return placed


def rollout_pool(spec: Mapping[str, Any], where: str = "placement") -> str | None:
  """The pool of role "rollout" where it is apart from the actor's, else None. Checked
  from the spec alone (pool names and sizes), so that the Ray driver, which holds no
  devices, refuses a bad rollout role with build_placement's own errors."""
  roles, pools = spec.get("roles") or {}, spec.get("pools") or {}
  if "rollout" not in roles:
    return None
  rollout, field = roles["rollout"], f"{where}.roles.rollout"
  if rollout.get("pool") not in pools:
    raise ValueError(f"{field}.pool: {rollout.get('pool')!r} is not one of {sorted(pools)}")
  if set(rollout) != {"pool"}:
    raise ValueError(f"{field}: only 'pool' is set here; the generation layout is the "
                     "actor's (generate_tensor, generate_strided, max_num_seqs)")
  if "actor" not in roles:
    raise ValueError(f"{field}: the rollout is the actor's generation; place the actor too")
  pool, tensor = rollout["pool"], int(roles["actor"].get("generate_tensor", 1))
  if int(pools[pool]) % tensor:
    raise ValueError(f"{where}.roles.actor.generate_tensor: {tensor} does not divide pool "
                     f"{pool!r} of {pools[pool]} devices")
  return pool if pool != roles["actor"].get("pool") else None
