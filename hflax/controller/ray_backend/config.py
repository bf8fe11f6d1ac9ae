"""The `cluster` settings, and how each placement pool maps onto processes.

Imports nothing heavy (no Ray, no JAX device work), so the launcher reads it before
anything runs.
"""
from __future__ import annotations

import dataclasses

BACKENDS = ("local", "ray")
PLATFORMS = ("cpu", "gpu")
STRATEGIES = ("", "PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClusterSettings:
  """The `cluster` config section, typed (checked by hflax.launch.cluster first)."""
  backend: str = "local"
  address: str = ""  # join this Ray cluster; empty: start a local one
  processes_per_pool: int = 0
  devices_per_process: int = 0
  platform: str = "cpu"
  cpus_per_process: float = 0.0
  gpus_per_process: float = 0.0
  strategy: str = ""
  max_restarts: int = 0
  require_loopback: bool = False  # True: the project's tests (see session.check_loopback)
  temp_dir: str = ""
  init_timeout_s: int = 120
  log_to_driver: bool = True
  include_dashboard: bool | None = None  # None: Ray's default
  reuse_workers: bool = True  # on a caller's Ray session: see ray_backend.reuse

  @classmethod
  def from_section(cls, section) -> "ClusterSettings":
    settings = cls(**dict(section))
    if not isinstance(settings.reuse_workers, bool):  # e.g. a section given as a plain dict
      raise ValueError(f"config.cluster.reuse_workers: must be True or False, got "
                       f"{settings.reuse_workers!r}")
    return settings


@dataclasses.dataclass(frozen=True)
class PoolLayout:
  name: str
  size: int  # devices of the pool (one jax.distributed job)
  processes: int
  devices_per_process: int
  roles: tuple[str, ...]  # roles built on this pool


def pool_layouts(cluster, spec: dict, roles: list[str]) -> list[PoolLayout]:
  """Processes and devices per process of every pool that hosts one of `roles`.

  Errors name the config field (cluster.processes_per_pool / devices_per_process).
  """
  k = cluster
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
  return out
