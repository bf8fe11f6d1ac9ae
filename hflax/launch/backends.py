"""The backend a config asks for (cluster.backend), with what it must be given checked before
any work: the placement for local devices, the pools' process layouts for Ray."""
from __future__ import annotations

import jax

from hflax.controller.backend import LocalBackend
from hflax.launch.roles import (check_generation_cap, check_placed, check_roles_placed,
                                needed_roles, placement_spec, reference_in_actor)
from hflax.sharding.placement import build_placement


def total_devices(cfg) -> int:
  """The devices a Ray run uses (its driver holds none)."""
  if cfg.placement.kind == "custom":
    return sum(int(n) for n in cfg.placement.pools.values())
  return int(cfg.trainer.devices)


def local_devices(cfg) -> list:
  devices = jax.devices()
  if cfg.trainer.devices > len(devices):
    raise ValueError(f"config.trainer.devices: {cfg.trainer.devices} asked for, "
                     f"{len(devices)} {devices[0].platform} device(s) here")
  return devices[:cfg.trainer.devices] if cfg.trainer.devices else devices


def make_backend(cfg, log=print):
  """(backend, placement spec or None: decided once the policy's shape is known)."""
  roles = needed_roles(cfg)
  if reference_in_actor(cfg) and "ref" in cfg.placement.roles:
    log("model.lora_rank: the actor computes the reference log-probs from its frozen "
        "base, so placement.roles.ref is not used (nor a pool only it used)")
  if cfg.cluster.backend == "ray":
    from hflax.controller.ray_backend.backend import RayBackend, require_ray
    require_ray()
    from hflax.controller.ray_backend.config import ClusterSettings, pool_layouts
    from hflax.controller.ray_backend.session import check_loopback
    from hflax.controller.ray_backend.split import rollout_pool
    cluster = ClusterSettings.from_section(cfg.cluster)
    spec = placement_spec(cfg, roles, total_devices(cfg))
    check_generation_cap(cfg, spec["roles"].get("actor", {}).get("max_num_seqs", 0))
    # A rollout pool apart from the actor's gets processes of its own (ray_backend.split).
    hosted = roles + ["rollout"] if rollout_pool(spec) else roles
    layouts = pool_layouts(cluster, spec, hosted)
    check_roles_placed(cfg, {r for p in layouts for r in p.roles}, roles)
    import ray
    if not ray.is_initialized():
      check_loopback(cluster)
    return RayBackend(cluster, layouts, keep=cfg.trainer.keep, log=log,
                      compile_cache=cfg.trainer.compile_cache_dir), spec
  devices = local_devices(cfg)
  if cfg.placement.kind != "auto":  # an auto plan needs the policy's shape: checked later
    placed = build_placement(placement_spec(cfg, roles, len(devices)), devices,
                             where="config.placement")
    check_placed(cfg, placed, roles)
  return LocalBackend(devices), None
