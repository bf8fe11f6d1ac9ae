"""The seam between the training loop and where roles run.

A backend builds the roles of a plan, saves and restores their part of a checkpoint and
releases what it holds. The loop (hflax.launch.trainer) is the same for every backend:
LocalBackend runs the roles in this process on its devices; the Ray backend
(hflax.controller.ray_backend.backend.RayBackend) runs them in worker processes.

A checkpoint is one step directory of the run's Checkpointer holding the loop's host
state ({"step", "loader", ...}, given to `save`) plus the backend's part: the trained
roles' arrays and counters (local), or the counters and the pools' own step directories
(Ray). `restore` returns the host state of the step it restored.
"""
from __future__ import annotations

from typing import Callable, Protocol

from hflax.checkpoint import Checkpointer
from hflax.controller.build import build_roles
from hflax.controller.plan import RunPlan
from hflax.controller.roles import Roles


class WorkerFailure(RuntimeError):
  """A process holding roles died; a backend with max_restarts > 0 can start them afresh."""


class Backend(Protocol):
  devices: int  # devices the roles run on (for throughput per device)
  max_restarts: int  # WorkerFailures the loop may recover from by `restart`

  def build(self, plan: RunPlan, policy, *, reward_fn: Callable | None = None,
            cost_fn: Callable | None = None) -> Roles: ...

  def save(self, ckpt: Checkpointer, step: int, host: dict) -> None: ...

  def restore(self, ckpt: Checkpointer, step: int) -> dict: ...

  def restart(self) -> Roles: ...

  def close(self) -> None: ...


def trained_arrays(roles: Roles) -> dict:
  """{"actor_params": ..., "critic_opt_state": ...}: what a checkpoint keeps of the roles."""
  return {f"{role.value}_{k}": v for role, w in roles.trained().items()
          for k, v in w.checkpoint_arrays().items()}


def restore_trained(roles: Roles, arrays: dict, counters: dict, step: int) -> None:
  for role, w in roles.trained().items():
    w.restore_checkpoint({k: arrays[f"{role.value}_{k}"] for k in ("params", "opt_state")},
                         counters[role.value], step)


def counters(roles: Roles) -> dict:
  return {role.value: w.checkpoint_counters() for role, w in roles.trained().items()}


class LocalBackend:
  """Every role in this process, on `devices` (one SPMD program per role's mesh)."""

  max_restarts = 0

  def __init__(self, devices):
    self.device_list = list(devices)
    self.devices = len(self.device_list)
    self.roles: Roles | None = None

  def build(self, plan, policy, *, reward_fn=None, cost_fn=None) -> Roles:
    self.roles = build_roles(plan, policy, devices=self.device_list, reward_fn=reward_fn,
                             cost_fn=cost_fn)
    return self.roles

  def save(self, ckpt, step, host):
    ckpt.save(step, trained_arrays(self.roles), {**host, "workers": counters(self.roles)},
              force=True)

  def restore(self, ckpt, step):
    arrays, host = ckpt.restore(step, trained_arrays(self.roles))
    restore_trained(self.roles, arrays, host["workers"], step)
    return host

  def restart(self) -> Roles:
    raise RuntimeError("the local backend cannot restart its roles")

  def close(self):
    self.roles = None
