"""Algorithm 1 of the paper: placements x device allocations x parallel layouts.

For each colocated group of roles and each pool size, the best layouts are searched once
and memoised (the paper's auto_parallel); allocations then only combine those results:
a stage takes the longest of the pools' summed role times, a step the sum of its stages.
On a shared host (DeviceProfile.shared_compute) pools share the cores: a stage takes at
least its longest pool and at least the pools' total divided by the host's measured
concurrency (1: they take turns).
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
import operator
from collections.abc import Mapping, Sequence

from hflax.sharding.automap.cost import Overheads, Simulator
from hflax.sharding.automap.mesh import MeshShape
from hflax.sharding.automap.placements import Placement, device_counts, placements
from hflax.sharding.automap.plan import Plan
from hflax.sharding.automap.profile import DeviceProfile
from hflax.sharding.automap.workload import STAGES, TRAINED, Workload

MAX_TENSOR = 8  # wider tensor parallelism only adds all-reduces (and leaves a node)


@dataclasses.dataclass
class PoolPlan:
  """Layouts for one group of roles on one pool, with its cost (or why it cannot run)."""
  meshes: dict[str, MeshShape] = dataclasses.field(default_factory=dict)
  generate_tensor: int = 1
  generate_strided: bool = True
  max_num_seqs: int = 0  # the actor's sequences per generation replica that fit
  # role -> bytes per device its mixture of experts' sparse layers move in a step
  exchange: dict[str, float] = dataclasses.field(default_factory=dict)
  stage_times: dict[str, float] = dataclasses.field(default_factory=dict)
  peak_memory: float = 0.0
  notes: dict[str, str] = dataclasses.field(default_factory=dict)
  reason: str | None = None

  @property
  def busy(self) -> float:
    return sum(self.stage_times.values()) if self.reason is None else math.inf


def _powers_of_two(limit: int) -> list[int]:
  return [1 << i for i in range(max(limit, 1).bit_length())]


class Planner:
  """Searches plans for one workload on one kind of device; memoises pool layouts."""

  def __init__(self, workload: Workload, profile: DeviceProfile,
               overheads: Overheads | None = None, generates: bool = True):
    self.wl, self.prof = workload, profile
    # False: the actor's pools train and score only; it generates on a rollout pool of its
    # own, which split.py plans (the asynchronous modes' split).
    self.generates = generates
    self.sim = Simulator(workload, profile, overheads)
    self._pools: dict[tuple[tuple[str, ...], int], PoolPlan] = {}

  # -- one pool ---------------------------------------------------------------------------
  def meshes(self, role: str, n: int) -> tuple[list[MeshShape], str | None]:
    """Valid (data, fsdp, tensor) shapes of n devices (tensor inside a node), or why none;
    for a mixture of experts also with an expert axis of every size dividing both its
    experts and the devices left beside tensor."""
    out, reason = [], None
    experts = self.wl.models[role].num_experts if self.wl.models[role].num_sparse_layers else 0
    for t in _powers_of_two(min(MAX_TENSOR, self.prof.devices_per_node, n)):
      if n % t:
        continue
      for e in (e for e in range(1, n // t + 1) if (n // t) % e == 0
                and (e == 1 or experts % e == 0)):
        rest = n // t // e
        for f in (f for f in range(1, rest + 1) if rest % f == 0):
          mesh = MeshShape(rest // f, f, t, e)
          problem = self.sim.mesh_problem(role, mesh)
          if problem:
            reason = reason or problem
          else:
            out.append(mesh)
    return out, (None if out else reason or f"no mesh of {n} devices for {role}")

  def generate_layouts(self, mesh: MeshShape) -> list[tuple[int, bool]]:
    """(t_g, strided) choices for the actor. Node-local groups only differ from strided
    ones when the training shards span nodes."""
    if not self.generates:
      return [(1, True)]
    widths = [g for g in _powers_of_two(min(MAX_TENSOR, self.prof.devices_per_node,
                                            mesh.size)) if mesh.size % g == 0]
    local = mesh.shards > self.prof.devices_per_node
    return [(g, s) for g in widths for s in ((True, False) if local else (True,))]

  def evaluate_pool(self, group: Sequence[str], n: int, meshes: Mapping[str, MeshShape],
                    generate_tensor: int = 1, generate_strided: bool = True,
                    reserved: float = 0.0) -> PoolPlan:
    """Exact stage times and peak memory of one pool with the given layouts (`reserved`:
    bytes per device taken by roles left out of `group`, when screening one role)."""
    sim = self.sim
    plan = PoolPlan(dict(meshes), generate_tensor, generate_strided)
    resident = reserved + sum(sim.resident(r, meshes[r]) for r in group)
    free = sim.capacity - resident
    times = {s: 0.0 for s in STAGES}
    transient = 0.0
    for role in group:
      mesh = meshes[role]
      problem = (f"{role} mesh {mesh} has {mesh.size} devices, its pool {n}"
                 if mesh.size != n else sim.mesh_problem(role, mesh))
      if problem:
        return dataclasses.replace(plan, reason=problem)
      calls = [("forward", sim.forward(role, mesh, free))]
      if role == "actor" and self.wl.reference_in_actor:
        calls.append(calls[0])
      if role in TRAINED:
        calls.append(("train", sim.train(role, mesh, free)))
      if role == "actor" and self.generates:
        calls.append(("generate", sim.generate(mesh, generate_tensor, free, generate_strided)))
      for stage, cost in calls:
        if cost.reason:
          return dataclasses.replace(plan, reason=cost.reason)
        times[stage] += cost.time
        transient = max(transient, cost.transient)
        plan.max_num_seqs = cost.max_num_seqs or plan.max_num_seqs
        if self.wl.models[role].num_sparse_layers:
          plan.exchange[role] = plan.exchange.get(role, 0.0) + cost.exchange
        if cost.note:
          plan.notes[role] = ", ".join(filter(None, [plan.notes.get(role), cost.note]))
    if resident > sim.capacity:
      return dataclasses.replace(plan, reason=f"OOM: resident state {resident / 1e9:.1f} GB "
                                 f"per device > {sim.capacity / 1e9:.1f} GB usable")
    plan.stage_times = {s: t for s, t in times.items() if t > 0}
    plan.peak_memory = resident + transient
    return plan

  def pool(self, group: tuple[str, ...], n: int) -> PoolPlan:
    """The best layouts for `group` on n devices (memoised)."""
    key = (group, n)
    if key not in self._pools:
      self._pools[key] = self._search_pool(group, n)
    return self._pools[key]

  def _search_pool(self, group: tuple[str, ...], n: int) -> PoolPlan:
    options = {}
    for role in group:
      meshes, reason = self.meshes(role, n)
      if reason:
        return PoolPlan(reason=reason)
      gens = self.generate_layouts if role == "actor" else lambda m: [(1, True)]
      options[role] = [(m, g) for m in meshes for g in gens(m)]
    shortlist = {role: self._shortlist(role, n, options, group) for role in group}
    best, first_failure = None, None
    for combo in itertools.product(*(shortlist[r] for r in group)):
      if first_failure and self._overfull(zip(group, (m for m, _ in combo))):
        continue  # it fails whatever its costs, and a failure to report is already kept
      meshes = {r: m for r, (m, _) in zip(group, combo)}
      gen = next((g for r, (_, g) in zip(group, combo) if r == "actor"), (1, True))
      plan = self.evaluate_pool(group, n, meshes, *gen)
      if plan.reason:
        first_failure = first_failure or plan
      elif best is None or plan.busy < best.busy:
        best = plan
    return best or first_failure

  def _shortlist(self, role, n, options, group):
    """A role's candidate layouts, screened alone with the other roles of the pool at
    their smallest footprint: per footprint (resident bytes, which the shard count and
    the expert axis set) the two fastest, then only those that no smaller footprint
    beats. The product of the shortlists is scored exactly, so the screen only has to
    keep the winner, not rank it."""
    others = sum(min(self.sim.resident(r, m) for m, _ in options[r])
                 for r in group if r != role)
    scored = sorted((math.inf if self._overfull([(role, m)], others) else
                     self.evaluate_pool((role,), n, {role: m}, *g, reserved=others).busy,
                     -self.sim.resident(role, m), m, g) for m, g in options[role])
    by_footprint: dict[float, list] = {}  # keyed by minus the resident bytes
    for item in scored:
      by_footprint.setdefault(item[1], []).append(item)
    kept, fastest = [], math.inf
    for footprint in sorted(by_footprint, reverse=True):  # smallest footprint first
      top = [x for x in by_footprint[footprint][:2] if x[0] < fastest or not kept]
      kept += top
      fastest = min([fastest] + [x[0] for x in top])
    return [(m, g) for _, _, m, g in kept]

  def _overfull(self, role_meshes, reserved: float = 0.0) -> bool:
    """Whether these (role, mesh) pairs' resident state exceeds a device, summed as
    evaluate_pool sums it: such a pool fails, so it need not be costed."""
    return reserved + sum(self.sim.resident(r, m) for r, m in role_meshes) > self.sim.capacity

  # -- allocations ------------------------------------------------------------------------
  def search(self, num_devices: int, *, top_k: int = 20, per_placement: int = 3,
             include_infeasible: bool = False) -> list[Plan]:
    """Ranked plans (best first): the `per_placement` best allocations of each placement,
    `top_k` overall; then, with include_infeasible, one plan per placement that cannot run
    at all, carrying the reason."""
    counts = device_counts(num_devices, self.prof.devices_per_node)
    ranked, failed = [], []
    for placement in placements(self.wl.roles):
      per_group = []
      for group in placement:
        tried = [(n, self.pool(group, n)) for n in counts]
        fits = [(n, p) for n, p in tried if p.reason is None]
        if not fits:
          failed.append(Plan(placement, (), {}, 1, {},
                             reason=f"{'+'.join(group)}: {tried[-1][1].reason}"))
          break
        per_group.append(fits)
      else:
        plans = self._allocate(placement, per_group, num_devices, per_placement)
        if not plans:
          need = sum(fits[0][0] for fits in per_group)
          failed.append(Plan(placement, (), {}, 1, {}, reason=(
              f"too few devices: its pools need at least {need} together, {num_devices} exist")))
        ranked += plans
    ranked.sort(key=lambda p: p.step_time)
    return ranked[:top_k] + (failed if include_infeasible else [])

  def _allocate(self, placement, per_group, total, keep) -> list[Plan]:
    """The `keep` cheapest allocations: each pool from its smallest fitting size up, the
    sizes summing to at most `total`. Pools are walked in turn with the budget left after
    reserving the others' minimum, so only allocations that fit are ever built."""
    rows = [[(n, p, tuple(p.stage_times.get(s, 0.0) for s in STAGES)) for n, p in fits]
            for fits in per_group]
    floors = [rs[0][0] for rs in rows]
    best: list = []  # heap of (-cost, -order, choice): the worst kept plan on top
    order = itertools.count()

    def walk(i, budget, chosen, stage_sum, stage_max):
      if i == len(rows):
        cost = sum(map(stage_time, stage_sum, stage_max))
        if len(best) < keep or cost < -best[0][0]:
          heapq.heappush(best, (-cost, -next(order), tuple(chosen)))
          if len(best) > keep:
            heapq.heappop(best)
        return
      reserve = sum(floors[i + 1:])
      for n, pool, times in rows[i]:
        if n + reserve <= budget:
          walk(i + 1, budget - n, chosen + [(n, pool)],
               tuple(map(operator.add, stage_sum, times)), tuple(map(max, stage_max, times)))

    stage_time = _stage_time(self.prof)
    walk(0, total, [], (0.0,) * len(STAGES), (0.0,) * len(STAGES))
    return [_combine(placement, chosen, stage_time, self.wl)
            for _, _, chosen in sorted(best, reverse=True)]

  # -- one given plan -----------------------------------------------------------------------
  def evaluate(self, placement: Placement, devices: Sequence[int],
               meshes: Mapping[str, MeshShape], generate_tensor: int = 1,
               generate_strided: bool = True) -> Plan:
    """Scores a plan given in full (a hand-written placement, or a config to check)."""
    if len(devices) != len(placement):
      raise ValueError(f"{len(placement)} pools but {len(devices)} device counts")
    chosen = [(n, self.evaluate_pool(g, n, meshes, generate_tensor, generate_strided))
              for g, n in zip(placement, devices)]
    plan = _combine(placement, chosen, _stage_time(self.prof), self.wl)
    plan.meshes = {r: meshes[r] for g in placement for r in g}
    plan.reason = next((f"{'+'.join(g)}: {p.reason}" for g, (_, p) in zip(placement, chosen)
                        if p.reason), None)
    return plan


def _stage_time(profile: DeviceProfile):
  """A stage's time from its pools' total and longest time: the longest where pools have
  their own hardware; on a shared host also at least the total over the host's
  concurrency."""
  if not profile.shared_compute:
    return lambda total, longest: longest
  concurrency = profile.host_concurrency or 1.0
  return lambda total, longest: max(longest, total / concurrency)


def _combine(placement: Placement, chosen, stage_time, workload: Workload) -> Plan:
  meshes, notes, gen, strided, cap, exchange = {}, {}, 1, True, 0, {}
  for group, (_, pool) in zip(placement, chosen):
    meshes.update(pool.meshes)
    notes.update(pool.notes)
    exchange.update(pool.exchange)
    if "actor" in group:
      gen, strided, cap = pool.generate_tensor, pool.generate_strided, pool.max_num_seqs
  times = {s: [p.stage_times.get(s, 0.0) for _, p in chosen] for s in STAGES}
  stages = {s: stage_time(sum(t), max(t)) for s, t in times.items()}
  return Plan(placement, tuple(n for n, _ in chosen), meshes, gen,
              {s: t for s, t in stages.items() if t > 0},
              tuple(p.stage_times for _, p in chosen), tuple(p.peak_memory for _, p in chosen),
              notes=notes, generate_strided=strided, max_num_seqs=cap,
              experts=_experts(workload, exchange))


def _experts(workload: Workload, exchange: dict[str, float]) -> dict:
  """role -> (total parameters, active parameters, expert exchange bytes per device per
  step) of each mixture-of-experts role the plan places."""
  return {r: (workload.models[r].num_params, workload.models[r].num_active_params, b)
          for r, b in exchange.items()}


def search(workload: Workload, profile: DeviceProfile, num_devices: int, *,
           overheads: Overheads | None = None, top_k: int = 20, per_placement: int = 3,
           include_infeasible: bool = False) -> list[Plan]:
  """Ranked plans for `num_devices` devices, best first (see Planner.search)."""
  return Planner(workload, profile, overheads).search(
      num_devices, top_k=top_k, per_placement=per_placement,
      include_infeasible=include_infeasible)
