"""The Ray backend: each placement pool is a WorkerGroup of Ray actor processes forming one
jax.distributed job, and the loop drives RoleHandles to them.

- roles: every member of a pool builds the pool's roles from the plan (the local
  backend's build_roles, on the pool's global devices). Rule/function rewards run on the
  driver (they are host Python). A split placement's rollout pool builds the actor's
  generation side, and the driver's actor is a SplitActor (ray_backend.split_actor);
  elsewhere it is a StreamingActor (ray_backend.stream): trainer.mode = "async" then
  streams in the actor's own pool.
- checkpoints: every process of a pool saves its roles' arrays with orbax to
  <checkpoints>/pools/<pool>/<step> (a multi-process save), then the driver saves the
  host state (with the workers' counters) to the run's checkpoint directory. A step is
  resumable once the driver's part exists; pool steps newer than that (a save cut short)
  are dropped when the pool next saves or restores.
- failures: a dead worker process raises WorkerDied (a WorkerFailure) naming the pool,
  process, pid and roles; `restart` kills the groups and starts them afresh, and the loop
  resumes from the latest checkpoint (up to cluster.max_restarts times).
- reuse: on a Ray session the caller owns (cluster.reuse_workers), `close` parks the
  healthy groups and the next backend takes those of its layouts (ray_backend.reuse).
"""
from __future__ import annotations

import os
import time

from hflax import platforms
from hflax.controller.build import build_roles
from hflax.controller.ray_backend.config import ClusterSettings, PoolLayout
from hflax.controller.ray_backend.group import (HostRole, WorkerGroup, build_groups,
                                                layout_key, start_groups, wait_all)
from hflax.controller.ray_backend import reuse, split
from hflax.controller.ray_backend.split_actor import SplitActor
from hflax.controller.ray_backend.stream import StreamingActor
from hflax.controller.ray_backend.session import SAFE_ENV, RaySession
from hflax.controller.ray_backend.transport import to_host
from hflax.controller.roles import Role, Roles
from hflax.controller.workers import FunctionRewardWorker

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def build_pool_roles(devices, plan, policy, replica=None) -> dict:
  """Runs in every member of a pool: the pool's roles on its global devices, and on a
  split placement's rollout pool the actor's generation side (`replica`: its plan)."""
  out = {}
  if plan.placed_roles:
    built = build_roles(plan, policy, devices=devices)
    out = {role.value: built.get(role) for role in plan.placed_roles}
  if replica is not None:
    out[split.ROLE] = split.build_replica(devices, replica, policy)
  return out


def worker_env(quiet: bool) -> dict:
  """Environment of the member processes: this checkout importable (and, in the test
  setting, Ray's quiet settings)."""
  path = os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH", "")) if p)
  return {"PYTHONPATH": path, **(SAFE_ENV if quiet else {})}


def require_ray() -> None:
  try:
    import ray  # noqa: F401
  except ImportError:
    raise ImportError("config.cluster.backend='ray' needs Ray: pip install 'ray[default]' "
                      "(or pip install -e '.[ray]')") from None


class RayBackend:
  def __init__(self, cluster: ClusterSettings, layouts: list[PoolLayout], *, keep: int | None,
               log=print, compile_cache: str = ""):
    require_ray()
    self.cluster, self.layouts, self.keep, self.log = cluster, list(layouts), keep, log
    # Each member resolves it (hflax.platforms.compile_cache).
    self.compile_cache = compile_cache
    self.max_restarts = cluster.max_restarts
    self.devices = sum(p.size for p in self.layouts)
    self.session, self.groups, self.roles = None, [], None
    self.reuse, self.reused = False, set()  # set by build: reuse_workers on a caller's session

  # -- roles on worker groups -----------------------------------------------------------------
  def build(self, plan, policy, *, reward_fn=None, cost_fn=None) -> Roles:
    model_cfg, graphdef, state = policy
    self._plan, self._policy = plan, (model_cfg, graphdef, to_host(state))
    self._host_fns = {Role.REWARD: reward_fn, Role.COST: cost_fn}
    self.session = RaySession(self.cluster)
    # A session this backend started ends with it: nothing would be left to reuse.
    self.reuse = self.cluster.reuse_workers and not self.session.started
    self.roles = self._start_groups()
    return self.roles

  def _group_settings(self, p: PoolLayout) -> dict:
    k = self.cluster
    return dict(roles=p.roles, platform=k.platform, cpus=k.cpus_per_process,
                gpus=k.gpus_per_process or platforms.gpus_to_reserve(k.platform,
                                                                     p.devices_per_process),
                strategy=k.strategy, env=worker_env(quiet=k.require_loopback),
                compile_cache=self.compile_cache, init_timeout_s=k.init_timeout_s)

  def _groups(self) -> list[WorkerGroup]:
    """A group per pool: a parked one of the same layout where reuse is on, else new
    processes (started and joined into their jax.distributed jobs)."""
    settings = {p.name: self._group_settings(p) for p in self.layouts}
    groups = {}
    # First the groups that hosted the same roles (their programs are compiled there).
    for same_roles in ((True, False) if self.reuse else ()):
      for p in self.layouts:
        if p.name not in groups:
          group = reuse.take(layout_key(p.processes, p.devices_per_process, **settings[p.name]),
                             p.name, p.roles, same_roles=same_roles)
          if group is not None:
            groups[p.name] = group
    self.reused = set(groups)
    fresh = [p for p in self.layouts if p.name not in self.reused]
    if fresh and self.reuse:
      reuse.evict_reserving()  # what they hold may be what the new processes need
    started = [WorkerGroup(p.name, p.processes, p.devices_per_process, **settings[p.name])
               for p in fresh]
    groups.update((g.name, g) for g in started)
    self.groups = [groups[p.name] for p in self.layouts]
    if started:
      start_groups(started)
    return self.groups

  def _start_groups(self) -> Roles:
    import ray
    k, plan = self.cluster, self._plan
    policy_ref = ray.put(self._policy)  # one copy in the object store for every member
    for g in self._groups():
      self.log(f"ray: pool {g.name!r} ({', '.join(g.roles)}): {g.processes} process(es) x "
               f"{g.devices_per_process} {k.platform} device(s)"
               f"{' (reused)' if g.name in self.reused else ''}: " +
               ", ".join(f"process {i} pid {info['pid']} on {info['node']}"
                         for i, info in enumerate(g.infos)))
    builders, apart = {}, split.rollout_pool(plan.placement)
    for p in self.layouts:
      own = tuple(r for r in p.roles if r != split.ROLE)
      spec = {"pools": {p.name: p.size}, "roles": {r: plan.placement["roles"][r] for r in own}}
      if apart and "actor" in own:  # its generation layout is laid over the rollout pool
        spec["roles"]["actor"] = {**spec["roles"]["actor"], "generate_tensor": 1}
      replica = split.replica_plan(plan, p.name, p.size) if split.ROLE in p.roles else None
      builders[p.name] = (build_pool_roles, (plan.only(own, spec), policy_ref, replica))
    started = time.perf_counter()
    handles = build_groups(self.groups, builders)
    self.log(f"ray: roles {', '.join(handles)} built in {time.perf_counter() - started:.1f} s")
    out = Roles(**{r.value: handles.get(r.value) for r in Role})
    if split.ROLE in handles:  # trains on its pool, generates on the rollout pool
      out.actor = SplitActor(handles["actor"], handles[split.ROLE])
    elif "actor" in handles:  # generates on its own pool: async streams beside it there
      out.actor = StreamingActor.of(handles["actor"])
    if plan.reference_in_actor:
      out.ref = out.actor
    for role, scorer in ((Role.REWARD, plan.reward), (Role.COST, plan.cost)):
      fn = self._host_fns[role]
      if scorer is not None and out.get(role) is None and fn is not None:
        setattr(out, role.value, HostRole(FunctionRewardWorker(fn, output=scorer.output)))
    return out

  def restart(self) -> Roles:
    self._stop_groups()
    self.roles = self._start_groups()
    return self.roles

  def _stop_groups(self):
    for g in self.groups:
      g.kill()
    self.groups = []

  def close(self):
    """Parks the healthy groups for a later backend where the caller owns the Ray session
    and cluster.reuse_workers is on (ray_backend.reuse), kills the other worker processes,
    and shuts down the Ray cluster this run started."""
    import ray
    if self.reuse and ray.is_initialized():  # else the caller's shutdown ended them
      for g in self.groups:
        if g.failed or not reuse.park(g):
          g.kill()
      self.groups = []
    self._stop_groups()
    if self.session is not None:
      self.session.close()
      self.session = None

  # -- checkpoints: arrays from the pools (every process), host state from the driver ----------
  def _trained_by_group(self) -> dict:
    out: dict = {}
    for role in self.roles.trained():
      out.setdefault(self.roles.get(role).group, []).append(role.value)
    return out

  @staticmethod
  def _pool_dir(ckpt, pool: str) -> str:
    return os.path.join(ckpt.directory, "pools", pool)

  def save(self, ckpt, step, host):
    groups = self._trained_by_group()
    calls = [(g, i, m.save.remote(self._pool_dir(ckpt, g.name), self.keep, step, roles))
             for g, roles in groups.items() for i, m in enumerate(g.members)]
    results, counters, k = wait_all(calls, f"saving checkpoint {step}"), {}, 0
    for g in groups:
      counters.update(results[k])  # process 0's counters (every process has the same)
      k += g.processes
    ckpt.save(step, {}, {**host, "workers": counters}, force=True)

  def restore(self, ckpt, step):
    _, host = ckpt.restore(step)
    calls = [(g, i, m.restore.remote(self._pool_dir(ckpt, g.name), self.keep, step, roles,
                                     host["workers"]))
             for g, roles in self._trained_by_group().items() for i, m in enumerate(g.members)]
    wait_all(calls, f"restoring checkpoint {step}")
    return host
