"""The `cluster` config section: validation, and how each placement pool maps onto processes.

Imports nothing heavy (no Ray, no JAX device work): `hflax.launch.config.validate` calls
`validate_cluster` before anything runs.
"""
from __future__ import annotations

import dataclasses

BACKENDS = ("local", "ray")
PLATFORMS = ("cpu", "gpu")
STRATEGIES = ("", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


def validate_cluster(c, fail) -> None:
  """Checks c.cluster; `fail(field, why)` raises naming config.<field>."""
  from hflax.launch.config import _check_int  # late: launch.config imports this module
  k = c.cluster
  if k.backend not in BACKENDS:
    fail("cluster.backend", f"{k.backend!r} is not one of {BACKENDS}")
  for field in ("processes_per_pool", "devices_per_process", "max_restarts"):
    _check_int(c, f"cluster.{field}", 0, fail)
  if k.platform not in PLATFORMS:
    fail("cluster.platform", f"{k.platform!r} is not one of {PLATFORMS}")
  for field in ("cpus_per_process", "gpus_per_process"):
    if k[field] < 0:
      fail(f"cluster.{field}", f"must be >= 0, got {k[field]!r}")
  if k.strategy not in STRATEGIES:
    fail("cluster.strategy", f"{k.strategy!r} is not one of {STRATEGIES}")
  if k.strategy and k.cpus_per_process <= 0 and k.gpus_per_process <= 0:
    fail("cluster.strategy", "a placement-group strategy needs cluster.cpus_per_process or "
         "cluster.gpus_per_process > 0 (Ray bundles cannot be empty)")
  if k.init_timeout_s <= 0:
    fail("cluster.init_timeout_s", f"must be > 0, got {k.init_timeout_s!r}")
  if k.backend == "ray":
    if c.placement.kind == "auto":
      fail("placement.kind", "'auto' measures the local devices; with cluster.backend='ray' "
           "use 'colocated', 'standalone' or 'custom' (python -m hflax.launch.plan prints "
           "the custom placement of the best plan)")
    if c.placement.kind in ("colocated", "standalone") and not c.trainer.devices:
      fail("trainer.devices", f"placement.kind={c.placement.kind!r} with cluster.backend='ray' "
           "needs the number of devices the cluster provides for the run")


@dataclasses.dataclass(frozen=True)
class PoolLayout:
  name: str
  size: int  # devices of the pool (one jax.distributed job)
  processes: int
  devices_per_process: int
  roles: tuple[str, ...]  # roles built on this pool


def pool_layouts(cfg, spec: dict, roles: list[str]) -> list[PoolLayout]:
  """Processes and devices per process of every pool that hosts a needed role.

  Errors name the config field (cluster.processes_per_pool / devices_per_process).
  """
  k = cfg.cluster
  out = []
  for name, size in spec["pools"].items():
    size = int(size)
    hosted = tuple(r for r in roles if spec["roles"].get(r, {}).get("pool") == name)
    if not hosted:
      continue
    procs, per = k.processes_per_pool, k.devices_per_process
    if not procs and not per:
      procs = 1
    if procs and not per:
      if size % procs:
        raise ValueError(f"config.cluster.processes_per_pool: {procs} does not divide pool "
                         f"{name!r} of {size} devices")
      per = size // procs
    elif per and not procs:
      if size % per:
        raise ValueError(f"config.cluster.devices_per_process: {per} does not divide pool "
                         f"{name!r} of {size} devices")
      procs = size // per
    elif procs * per != size:
      raise ValueError(f"config.cluster: processes_per_pool={procs} x devices_per_process={per} "
                       f"is {procs * per}, but pool {name!r} has {size} devices")
    out.append(PoolLayout(name, size, procs, per, hosted))
  from hflax.launch.roles import check_roles_placed  # late: launch imports this module
  check_roles_placed(cfg, {r for p in out for r in p.roles}, roles)
  return out
