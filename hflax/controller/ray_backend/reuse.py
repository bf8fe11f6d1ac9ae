"""Parked worker groups: a caller-owned Ray session keeps a closed backend's healthy groups
for the next backend of the same layout (cluster.reuse_workers).

Starting a group costs each process its Python and JAX start, the jax.distributed job and
every program's trace and compile; a notebook (or a test module) running several Trainers
against one `ray.init()` pays that once per layout instead of once per Trainer. A parked
member holds no role worker, checkpointer or stream (PoolMember.release), so a reused
process starts from what a fresh one holds but its compiled programs.

Parked groups belong to the Ray session they were started in: they are forgotten (never
called) once the driver is in another session, and Ray itself ends them with the session
(they are the driver's actors), so nothing outlives `ray.shutdown` or the driver's exit.
"""
from __future__ import annotations

from hflax.controller.ray_backend.group import WorkerGroup, wait_all

PING_TIMEOUT_S = 30.0  # a parked member that does not answer this fast is not reused
# Idle processes kept beyond those a layout asks for (each holds its JAX runtime's memory).
MAX_PARKED_PROCESSES = 8

_parked: list[WorkerGroup] = []
_session = None  # the Ray session the parked groups live in


def _current_session():
  import ray
  context = ray.get_runtime_context()
  return context.get_job_id(), context.get_node_id()


def _same_session() -> None:
  """Forgets the parked groups if they live in another Ray session than the driver's."""
  global _session
  here = _current_session()
  if _session != here:
    _parked.clear()  # ended with their session: nothing to call or kill
    _session = here


def parked() -> list[WorkerGroup]:
  """The parked groups of this driver's Ray session, oldest first."""
  _same_session()
  return list(_parked)


def take(layout: tuple, name: str, roles: tuple[str, ...], *,
         same_roles: bool = False) -> WorkerGroup | None:
  """A parked group of exactly `layout` (WorkerGroup.layout) whose every process still
  answers, renamed to pool `name` hosting `roles`; None if there is none. `same_roles`:
  only a group that hosted `roles` (its processes hold their programs). A parked group
  found dead is killed and dropped."""
  _same_session()
  candidates = sorted((g for g in _parked if g.layout == layout
                       and (g.roles == tuple(roles) or not same_roles)),
                      key=lambda g: g.name != name)
  for group in candidates:
    _parked.remove(group)
    calls = [(group, i, m.adopt.remote(name)) for i, m in enumerate(group.members)]
    try:
      pids = wait_all(calls, "waking a parked group", PING_TIMEOUT_S)
    except Exception:  # noqa: BLE001 - dead, stuck or not released: started afresh instead
      group.kill()
      continue
    if pids != [info["pid"] for info in group.infos]:  # not the processes it started
      group.kill()
      continue
    group.name, group.roles, group.descriptions, group.failed = name, tuple(roles), {}, False
    return group
  return None


def park(group: WorkerGroup) -> bool:
  """Releases the roles of a healthy group's members and keeps the group for a later
  backend; False (the caller kills it) where a member fails to release."""
  _same_session()
  calls = [(group, i, m.release.remote()) for i, m in enumerate(group.members)]
  try:
    wait_all(calls, "releasing the role workers", PING_TIMEOUT_S)
  except Exception:  # noqa: BLE001 - any failure: the group is not reused
    return False
  _parked.append(group)
  while sum(g.processes for g in _parked) > MAX_PARKED_PROCESSES and len(_parked) > 1:
    _parked.pop(0).kill()
  return True


def evict_reserving() -> None:
  """Kills the parked groups that hold Ray resources (CPUs, GPUs, a placement group): a
  layout that takes none of them may need what they hold."""
  _same_session()
  for group in [g for g in _parked if g.reserves]:
    _parked.remove(group)
    group.kill()


def discard_all() -> None:
  """Kills every parked group of this session."""
  _same_session()
  while _parked:
    _parked.pop().kill()
