"""The main job on the Ray backend: `python -m hflax.launch --config ppo.py
--config.cluster.backend=ray`.

RayTrainer is the local Trainer (data, rewards, the algorithm's driver loop, validation,
metrics, export) with three differences:
- roles: each placement pool becomes a WorkerGroup of Ray actor processes forming one
  jax.distributed job; the trainer holds RoleHandles. Rule/function rewards run on the
  driver (they are host Python).
- checkpoints: every process of a pool saves its roles' arrays with orbax to
  run_dir/checkpoints/pools/<pool>/<step> (a multi-process save), then the driver saves
  the host state (step, data position, KL state, worker counters) to run_dir/checkpoints.
  A step is resumable once the driver's part exists; pool steps newer than that (a save
  cut short) are dropped when the pool next saves or restores.
- failures: a dead worker process raises WorkerDied naming the pool, process, pid and
  roles; with cluster.max_restarts > 0 the groups are killed, started afresh and the run
  resumes from the latest checkpoint, else every actor is killed, Ray is shut down and
  the error goes to the caller (the CLI prints it and exits non-zero).
"""
from __future__ import annotations

import os
import time

import jax

from hflax.algorithms.drivers import Roles, init_state
from hflax.controller.ray_backend.config import pool_layouts
from hflax.controller.ray_backend.group import (HostRole, WorkerDied, WorkerGroup, build_groups,
                                                start_groups, wait_all)
from hflax.controller.ray_backend.session import SAFE_ENV, RaySession, check_loopback
from hflax.controller.ray_backend.transport import to_host
from hflax.controller.workers import FunctionRewardWorker
from hflax.launch.roles import (check_generation_cap, needed_roles, placement_spec,
                                reference_in_actor)
from hflax.launch.trainer import Trainer

_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


def total_devices(cfg) -> int:
  if cfg.placement.kind == "custom":
    return sum(int(n) for n in cfg.placement.pools.values())
  return int(cfg.trainer.devices)


def build_pool_roles(devices, cfg, spec, roles, policy, tokenizer) -> dict:
  """Runs in every member of a pool: the pool's roles on its global devices."""
  from hflax.launch.roles import build_roles
  built = build_roles(cfg, policy, tokenizer=tokenizer, devices=devices, spec=spec, only=roles)
  return {role: getattr(built, role) for role in roles}


def worker_env() -> dict:
  """Environment of the member processes: this checkout importable, Ray's quiet settings."""
  path = os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH", "")) if p)
  return {"PYTHONPATH": path, **SAFE_ENV}


class RayTrainer(Trainer):
  def __init__(self, cfg, log=print):
    self.session, self.groups, self._force_resume = None, [], False
    try:
      import ray  # noqa: F401
    except ImportError:
      raise ImportError("config.cluster.backend='ray' needs Ray: pip install 'ray[default]' "
                        "(or pip install -e '.[ray]')") from None
    try:
      super().__init__(cfg, log)
    except BaseException:
      self.close()
      raise
    self.devices = sum(g.processes * g.devices_per_process for g in self.groups)
    self._initial_loader = self.loader.state_dict()

  # -- roles on worker groups -----------------------------------------------------------------
  def check_placement(self, devices):
    """The pools' process layouts and where Ray may start: before any work (the warm-up)."""
    del devices  # the driver's own devices hold no role
    import ray
    cfg = self.cfg
    roles = needed_roles(cfg)
    self._spec = placement_spec(cfg, roles, total_devices(cfg))
    check_generation_cap(cfg, self._spec["roles"].get("actor", {}).get("max_num_seqs", 0))
    self._layouts = pool_layouts(cfg, self._spec, roles)
    if not ray.is_initialized():
      check_loopback(cfg.cluster)

  def make_roles(self, policy, devices):
    del devices
    model_cfg, graphdef, state = policy
    self._policy = (model_cfg, graphdef, to_host(state))
    self.session = RaySession(self.cfg.cluster)
    return self._start_groups()

  def _start_groups(self) -> Roles:
    import ray
    cfg, k = self.cfg, self.cfg.cluster
    policy_ref = ray.put(self._policy)  # one copy in the object store for every member
    env = worker_env()
    self.groups = [WorkerGroup(p.name, p.processes, p.devices_per_process, roles=p.roles,
                               platform=k.platform, cpus=k.cpus_per_process,
                               gpus=k.gpus_per_process or (p.devices_per_process if
                                                           k.platform == "gpu" else 0),
                               strategy=k.strategy, env=env,
                               init_timeout_s=k.init_timeout_s) for p in self._layouts]
    start_groups(self.groups)
    for g in self.groups:
      self.log(f"ray: pool {g.name!r} ({', '.join(g.roles)}): {g.processes} process(es) x "
               f"{g.devices_per_process} {k.platform} device(s): " +
               ", ".join(f"process {i} pid {info['pid']} on {info['node']}"
                         for i, info in enumerate(g.infos)))
    builders = {}
    for p in self._layouts:
      spec = {"pools": {p.name: p.size}, "roles": {r: self._spec["roles"][r] for r in p.roles}}
      builders[p.name] = (build_pool_roles, (cfg, spec, p.roles, policy_ref, self.tokenizer))
    started = time.perf_counter()
    handles = build_groups(self.groups, builders)
    self.log(f"ray: roles {', '.join(handles)} built in {time.perf_counter() - started:.1f} s")
    out = Roles(**{r: handles.get(r) for r in ("actor", "ref", "critic", "reward", "cost")})
    if reference_in_actor(cfg):
      out.ref = out.actor
    if out.reward is None:
      out.reward = HostRole(FunctionRewardWorker(self.reward_fn, output="token_level_scores"))
    if cfg.algorithm.name == "safe_rlhf" and out.cost is None:
      out.cost = HostRole(FunctionRewardWorker(self.cost_fn, output="token_level_costs"))
    return out

  def _stop_groups(self):
    for g in self.groups:
      g.kill()
    self.groups = []

  def close(self):
    """Kills every worker process and shuts down the Ray cluster this run started."""
    self._stop_groups()
    if self.session is not None:
      self.session.close()
      self.session = None

  # -- checkpoints: arrays from the pools (every process), host state from the driver ----------
  def _trained_by_group(self) -> dict:
    out: dict = {}
    for role in ("actor", "critic"):
      handle = getattr(self.roles, role)
      if handle is not None:
        out.setdefault(handle._group, []).append(role)  # noqa: SLF001
    return out

  def _pool_dir(self, pool: str) -> str:
    return os.path.join(self.cfg.trainer.run_dir, "checkpoints", "pools", pool)

  def save(self, step: int, force: bool = False):
    if not force and step % self.ckpt.save_every:
      return
    if self.ckpt.latest_step() == step:
      return
    keep = self.cfg.trainer.keep
    groups = self._trained_by_group()
    calls = [(g, i, m.save.remote(self._pool_dir(g.name), keep, step, roles))
             for g, roles in groups.items() for i, m in enumerate(g.members)]
    results, counters, k = wait_all(calls, f"saving checkpoint {step}"), {}, 0
    for g in groups:
      counters.update(results[k])  # process 0's counters (every process has the same)
      k += g.processes
    host = {"step": step, "loader": self.loader.state_dict(), "kl_ctrl": self.state.kl_ctrl,
            "lagrange_lambda": self.state.lagrange_lambda, "workers": counters}
    self.ckpt.save(step, {}, host, force=True)

  def resume(self) -> int:
    step = self.ckpt.latest_step() if self.cfg.trainer.resume or self._force_resume else None
    if step is None:
      return 0
    _, host = self.ckpt.restore(step)
    keep = self.cfg.trainer.keep
    calls = [(g, i, m.restore.remote(self._pool_dir(g.name), keep, step, roles, host["workers"]))
             for g, roles in self._trained_by_group().items() for i, m in enumerate(g.members)]
    wait_all(calls, f"restoring checkpoint {step}")
    self.loader.load_state_dict(host["loader"])
    self.state.step, self.state.kl_ctrl = host["step"], host["kl_ctrl"]
    self.state.lagrange_lambda = host["lagrange_lambda"]
    self.log(f"resumed from step {step} ({self.ckpt.directory})")
    return step

  # -- the loop, restarted on worker death ---------------------------------------------------
  def fit(self) -> dict:
    limit, restarts = self.cfg.cluster.max_restarts, 0
    while True:
      try:
        return super().fit()
      except WorkerDied as e:
        self.log(f"ray: {e}")
        if restarts >= limit:
          raise
        restarts += 1
        self.log(f"ray: restart {restarts} of {limit}: new worker groups, resuming from the "
                 "latest checkpoint")
        self._stop_groups()
        self.loader.load_state_dict(self._initial_loader)
        self.state = init_state(self.cfg.algorithm)
        self.state.lagrange_lambda = self.cfg.algorithm.lambda_init
        self.roles = self._start_groups()
        self._force_resume = True


def run(cfg, log=print) -> dict:
  """The main job with role workers in Ray actors; always leaves no worker process behind."""
  try:  # the driver holds no devices: never let it claim an accelerator the workers need
    jax.config.update("jax_platforms", "cpu")
  except Exception:  # noqa: BLE001 - backend already up (e.g. inside tests): nothing to do
    pass
  trainer = RayTrainer(cfg, log=log)
  try:
    return trainer.fit()
  finally:
    trainer.close()
