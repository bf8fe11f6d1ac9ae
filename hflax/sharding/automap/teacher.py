"""Where a plan puts on-policy distillation's teacher, and why, in words.

The teacher is a forward-only role (workload.py): its weights and one forward pass's
activations, every step. The search weighs it like the reference: beside the actor, on a
pool with other scorers, or on a pool of its own. A plan says which it took and what the
best plan of each other kind costs, or why none of that kind runs: a big teacher's
weights beside the actor can leave its generation too little memory for a prompt's
samples, while a small one shares the actor's devices, which otherwise idle while it
scores.
"""
from __future__ import annotations

from hflax.sharding.automap.plan import Plan, count, seconds
from hflax.sharding.automap.search import Planner

TEACHER = "teacher"
# Where the teacher can sit, in the words the explanation uses for each.
KINDS = {"actor": "beside the actor", "scorers": "beside other roles, not the actor",
         "own": "on a pool of its own"}


def kind(placement) -> str:
  """'actor', 'scorers' or 'own': whom the teacher's pool holds besides it."""
  group = next(g for g in placement if TEACHER in g)
  if len(group) == 1:
    return "own"
  return "actor" if "actor" in group else "scorers"


def pools(plan: Plan) -> str:
  return " ".join(f"[{'+'.join(g)}]x{n}" for g, n in zip(plan.placement, plan.devices))


def explain_teacher(planner: Planner, plan: Plan, num_devices: int,
                    step: str = "a step") -> str:
  """Where `plan` (the best of planner.search(num_devices)) puts the teacher, against the
  best plan of each other kind; "" when the workload has no teacher. `step` names what
  plan.step_time is (a split's training pools: their share of the step)."""
  if TEACHER not in planner.wl.roles:
    return ""
  chosen = kind(plan.placement)
  pool = plan.pool_of(TEACHER)
  devices = plan.devices[int(pool.removeprefix("pool"))]
  beside = "+".join(r for g in plan.placement if TEACHER in g for r in g if r != TEACHER)
  where = f"{pool} of its own" if chosen == "own" else f"{pool} with {beside}"
  params = count(planner.wl.models[TEACHER].num_params)
  head = (f"the teacher ({params} params, forward only) runs on {where} "
          f"({devices} device{'' if devices == 1 else 's'})")
  # One plan per placement, the failures too: the best of each kind, or why none runs.
  found = planner.search(num_devices, top_k=10 ** 6, per_placement=1, include_infeasible=True)
  others = []
  for other in (k for k in KINDS if k != chosen):
    of_kind = [p for p in found if kind(p.placement) == other]
    if not of_kind:
      continue  # e.g. no role but the actor and the teacher: no other scorers to join
    best = next((p for p in of_kind if p.feasible), None)
    if best is not None:
      others.append(f"{KINDS[other]} the best plan steps in {seconds(best.step_time)} "
                    f"({pools(best)})")
      continue
    # A pool that does not fit says more than one that lacks devices.
    failed = sorted(of_kind, key=lambda p: p.reason.startswith("too few devices"))[0]
    others.append(f"{KINDS[other]} no plan runs ({failed.reason})")
  if not others:
    return head
  return head + f", {seconds(plan.step_time)} {step}; " + "; ".join(others)
