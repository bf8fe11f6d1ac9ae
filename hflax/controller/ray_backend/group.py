"""The driver's side: worker groups (one per resource pool) and role handles.

A `WorkerGroup` is the Ray actors of one pool, one per process, forming one
`jax.distributed` job. A `RoleHandle` looks like a local role worker to the algorithm
drivers: calling `handle.compute_values(batch)` puts the (host) batch in the object store
once, sends the call to every member, waits for all of them, and returns process 0's
host Batch. Batches from roles on different pools therefore meet on the driver as numpy.

Failures: every wait watches all members of the group. When a member process dies
(killed, out of memory, a crashed collective), `WorkerDied` names the pool, the process,
its pid and node, the roles it hosts and the call that was running; an exception raised
inside a role method is re-raised on the driver as its own type.
"""
from __future__ import annotations

import functools
import time

from hflax.controller.backend import WorkerFailure
from hflax.controller.ray_backend.member import PoolMember
from hflax.controller.ray_backend.transport import to_wire


class WorkerDied(WorkerFailure):
  """A worker process of a pool died (the message says which, and what it was running)."""


GRACE_S = 3.0  # after a first failure, how long to let the other members report theirs


def layout_key(processes: int, devices_per_process: int, *, platform: str = "cpu",
               cpus: float = 0.0, gpus: float = 0.0, strategy: str = "",
               env: dict | None = None, jax_config: dict | None = None,
               compile_cache: str = "", **_) -> tuple:
  """What a parked group must match to be reused (ray_backend.reuse): everything a process
  is started or initialized with; the pool's name and roles need not."""
  return (processes, devices_per_process, platform, float(cpus), float(gpus), strategy,
          tuple(sorted((env or {}).items())), tuple(sorted((jax_config or {}).items())),
          compile_cache)


class WorkerGroup:
  """Starts `processes` Ray actors for pool `name` (devices_per_process devices each).

  Construction only schedules the actors; `start_groups` then joins each group into one
  jax.distributed job (all groups in parallel).
  """

  def __init__(self, name: str, processes: int, devices_per_process: int, *,
               roles: tuple[str, ...] = (), platform: str = "cpu", cpus: float = 0.0,
               gpus: float = 0.0, strategy: str = "", env: dict | None = None,
               jax_config: dict | None = None, compile_cache: str = "",
               init_timeout_s: int = 120):
    import ray
    self.name, self.processes, self.devices_per_process = name, processes, devices_per_process
    self.roles, self.init_timeout_s = tuple(roles), init_timeout_s
    self.layout = layout_key(processes, devices_per_process, platform=platform, cpus=cpus,
                             gpus=gpus, strategy=strategy, env=env, jax_config=jax_config,
                             compile_cache=compile_cache)
    self.reserves = bool(cpus or gpus or strategy)  # holds Ray resources while it lives
    self.failed = False  # a call failed or timed out: never reused
    self.descriptions: dict = {}
    self.infos: list[dict] = [{} for _ in range(processes)]
    self.placement_group = None
    # No Ray-level restarts: a jax.distributed job cannot take back a restarted member, so
    # the whole group is restarted instead (see RayBackend.restart).
    options = dict(num_cpus=cpus, num_gpus=gpus, max_restarts=0, max_task_retries=0,
                   runtime_env={"env_vars": dict(env)} if env else None)
    if strategy:
      from ray.util.placement_group import placement_group
      from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
      bundle = {k: v for k, v in (("CPU", cpus), ("GPU", gpus)) if v > 0}
      self.placement_group = placement_group([bundle] * processes, strategy=strategy)
    remote = ray.remote(PoolMember)
    self.members = []
    for i in range(processes):
      opts = dict(options)
      if self.placement_group is not None:
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
            self.placement_group, placement_group_bundle_index=i)
      self.members.append(remote.options(**opts).remote(
          name, i, processes, devices_per_process, platform, jax_config, compile_cache))

  # -- waiting, with death detection ----------------------------------------------------------
  def describe_process(self, i: int) -> str:
    info = self.infos[i]
    where = f", pid {info['pid']} on {info['node']}" if info else ""
    roles = ", ".join(self.roles) or "none yet"
    return f"process {i} of {self.processes} in pool {self.name!r} (roles {roles}{where})"

  def kill(self, wait_s: float = 10.0):
    """Kills every member (at once, even one stuck in a collective) and waits, up to
    wait_s, until the processes on this node are gone."""
    import ray
    for member in self.members:
      try:
        ray.kill(member, no_restart=True)
      except Exception:  # noqa: BLE001 - already gone
        pass
    here = _node_ip_or_none()
    local = [info["pid"] for info in self.infos if info and info.get("node") == here]
    deadline = time.monotonic() + wait_s
    while any(_alive(pid) for pid in local) and time.monotonic() < deadline:
      time.sleep(0.05)
    if self.placement_group is not None:
      from ray.util.placement_group import remove_placement_group
      try:
        remove_placement_group(self.placement_group)
      except Exception:  # noqa: BLE001
        pass
    self.members = []

  def call(self, role: str, method: str, *args, **kwargs):
    """Runs workers[role].method(*args, **kwargs) on every member; process 0's result."""
    import ray
    # One object-store entry for the whole group; Ray resolves the ref in each member.
    payload = ray.put((to_wire(args), to_wire(kwargs)))
    refs = [m.call.remote(role, method, payload) for m in self.members]
    return wait_all([(self, i, ref) for i, ref in enumerate(refs)], f"{role}.{method}")[0]

  def get(self, role: str, attribute: str):
    refs = [m.get.remote(role, attribute) for m in self.members]
    return wait_all([(self, i, ref) for i, ref in enumerate(refs)], f"{role}.{attribute}")[0]

  def broadcast(self, what: str, method: str, *args) -> list:
    refs = [getattr(m, method).remote(*args) for m in self.members]
    return wait_all([(self, i, ref) for i, ref in enumerate(refs)], what)


def _node_ip_or_none():
  try:
    import ray
    return ray.util.get_node_ip_address()
  except Exception:  # noqa: BLE001
    return None


def _alive(pid: int) -> bool:
  """Whether a process runs (a zombie waiting to be reaped counts as gone)."""
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"
  except (OSError, IndexError):
    return False


def wait_all(calls: list, what: str, timeout_s: float | None = None) -> list:
  """Results of [(group, process index, ref)], in order; raises on the first failure
  (and TimeoutError naming the waiting processes after timeout_s, if given).

  A dead member (any Ray error other than an exception raised by the method) raises
  WorkerDied naming it, after a short grace so that every member that died is named; an
  exception raised inside a method is re-raised as its own type. Either way (and on a
  timeout or an interrupt) every group waited on is marked failed: it is never reused.
  """
  try:
    return _wait(calls, what, timeout_s)
  except BaseException:
    for group, _, _ in calls:  # a member may be dead, stuck or half-way through the call
      group.failed = True
    raise


def _wait(calls: list, what: str, timeout_s: float | None) -> list:
  import ray
  from ray.exceptions import RayError, RayTaskError
  index = {ref: k for k, (_, _, ref) in enumerate(calls)}
  results: list = [None] * len(calls)
  pending = [ref for _, _, ref in calls]
  deadline = None if timeout_s is None else time.monotonic() + timeout_s
  while pending:
    left = None if deadline is None else max(0.0, deadline - time.monotonic())
    ready, pending = ray.wait(pending, num_returns=1, timeout=left)
    if not ready:
      waiting = "; ".join(calls[index[ref]][0].describe_process(calls[index[ref]][1])
                          for ref in pending)
      raise TimeoutError(f"{what}: no answer within {timeout_s:.0f} s from {waiting} (does "
                         f"the Ray cluster have the resources the pools ask for?)")
    try:
      results[index[ready[0]]] = ray.get(ready[0])
      continue
    except RayError:
      pass
    # Something failed: give the others a moment, then classify every member's outcome.
    done = ray.wait(pending, num_returns=len(pending), timeout=GRACE_S)[0] if pending else []
    dead, errors = [], []
    for ref in [ready[0], *done]:
      group, i, _ = calls[index[ref]]
      try:
        ray.get(ref)
      except RayTaskError as e:
        errors.append(e)
      except RayError as e:  # the actor (its process) is gone
        dead.append((group, i, e))
    if dead:
      names = "; ".join(g.describe_process(i) for g, i, _ in dead)
      raise WorkerDied(f"worker process died during {what}: {names}. "
                       f"Ray says: {_first_line(dead[0][2])}")
    raise errors[0].as_instanceof_cause()  # e.g. a ValueError from a role method
  return results


def _first_line(error) -> str:
  text = " ".join(str(error).split())
  return text[:300]


class PendingBatch:
  """Calls submitted to pools and not yet waited for (a split's generation with its
  weights' calls; async's decode steps): `result()` waits for all of them, raising as a
  role call would, and returns calls[answer]'s result (the answering process 0's)."""

  def __init__(self, calls: list, answer: int, what: str):
    self._calls, self._answer, self._what, self._batch = calls, answer, what, None

  def result(self):
    if self._calls is not None:
      self._batch = wait_all(self._calls, self._what)[self._answer]
      self._calls = None
    return self._batch


class RoleHandle:
  """A role on a worker group, with the methods (and a few settings) of the worker."""

  def __init__(self, group: WorkerGroup, role: str, description: dict):
    self.group, self._role, self._methods = group, role, set(description["methods"])
    self.pool, self.worker_type = group.name, description["type"]
    # What the worker is, as the member described it (None where the role has no such part).
    self.sampling = description.get("sampling")
    self.mesh_shape = description.get("mesh_shape")
    self.generate_mesh_shape = description.get("generate_mesh_shape")

  def __getattr__(self, name):
    if name.startswith("_") or name not in self.__dict__.get("_methods", ()):
      raise AttributeError(f"{type(self).__name__} for role {self.__dict__.get('_role')!r} has "
                           f"no attribute {name!r}")
    return functools.partial(self.group.call, self._role, name)

  @property
  def params(self):
    """The parameters as host arrays (gathered from the group)."""
    return self.group.get(self._role, "params")

  @property
  def opt_state(self):
    return self.group.get(self._role, "opt_state")

  def __repr__(self):
    return f"RoleHandle({self._role!r} on pool {self.pool!r}, {self.worker_type})"


class HostRole:
  """A host-side role (rule / function rewards) run by the driver itself; host results."""

  def __init__(self, worker):
    self._worker = worker

  def __getattr__(self, name):
    method = getattr(self._worker, name)
    if not callable(method):
      return method

    def call(*args, **kwargs):
      from hflax.controller.ray_backend.transport import to_host
      return to_host(method(*args, **kwargs))
    return call


def start_groups(groups: list[WorkerGroup]) -> None:
  """Every group's processes up and joined into their jax.distributed job (in parallel)."""
  timeout = max(g.init_timeout_s for g in groups)
  calls = [(g, i, m.info.remote()) for g in groups for i, m in enumerate(g.members)]
  for (g, i, _), info in zip(calls, wait_all(calls, "process start", timeout)):
    g.infos[i] = info
  coords = wait_all([(g, 0, g.members[0].coordinator_address.remote()) for g in groups],
                    "coordinator address", timeout)
  calls = [(g, i, m.initialize.remote(coord, g.init_timeout_s))
           for g, coord in zip(groups, coords) for i, m in enumerate(g.members)]
  started = time.perf_counter()
  for (g, i, _), out in zip(calls, wait_all(calls, "jax.distributed.initialize", timeout)):
    want = g.processes * g.devices_per_process
    if out["global_devices"] != want:
      raise RuntimeError(f"pool {g.name!r}: the jax.distributed job has {out['global_devices']} "
                         f"devices, expected {want} (took {time.perf_counter() - started:.1f} s)")


def build_groups(groups: list[WorkerGroup], builders: dict) -> dict:
  """builders: {group name: (builder, args)}; returns {role: RoleHandle}."""
  calls, order = [], []
  for g in groups:
    builder, args = builders[g.name]
    for i, m in enumerate(g.members):
      calls.append((g, i, m.build.remote(builder, *args)))
    order.append(g)
  results = wait_all(calls, "building the role workers")
  handles, k = {}, 0
  for g in order:
    descriptions = results[k]
    k += g.processes
    g.descriptions = descriptions
    g.roles = tuple(descriptions)
    for role, description in descriptions.items():
      handles[role] = RoleHandle(g, role, description)
  return handles
