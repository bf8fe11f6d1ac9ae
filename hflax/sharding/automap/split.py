"""The asynchronous modes' split: k devices only generate, the other N - k train.

With trainer.mode one_step_off or async, a placement with a rollout pool of its own lets
generation of the next batch run while the training pools score and update this one
(hflax.launch.modes). A colocated plan cannot overlap them: its devices run the programs
in order, so its step stays the sum of its stages whatever the mode.

A split step, as simulated here:

  overlap(generate on the k rollout devices, forward + train on the N - k others)
    + the weight sync (the updated actor copied to the rollout devices)

where overlap is the longer of the two on devices of their own, and on a shared host
(simulated CPU devices) at least their total over the host's concurrency, as for any
concurrent pools (search._stage_time). The sync cannot overlap: the rollout pool waits
for the update's weights, and the training devices send them. The rollout pool holds the
actor's generation copy and KV cache only; its generation is cost.Simulator.generate on a
mesh whose shards are t_g wide (so no train-to-generate reshard), and the training side
is the ordinary search over the roles' placements on N - k devices with generation left
out (Planner(generates=False)). k runs over the pool sizes worth trying (device_counts)
and the complements of them.
"""
from __future__ import annotations

import dataclasses
import math

from hflax.sharding.automap import comm
from hflax.sharding.automap.cost import Overheads, compute_bytes
from hflax.sharding.automap.mesh import MeshShape
from hflax.sharding.automap.placements import device_counts
from hflax.sharding.automap.plan import Plan, nbytes, seconds
from hflax.sharding.automap.profile import DeviceProfile
from hflax.sharding.automap.search import MAX_TENSOR, Planner, _powers_of_two, _stage_time
from hflax.sharding.automap.teacher import explain_teacher
from hflax.sharding.automap.workload import Workload

MODES = ("sync", "one_step_off", "async")
SPLIT_MODES = ("one_step_off", "async")  # the modes whose generation can overlap training


@dataclasses.dataclass
class RolloutPool:
  """The actor's generation alone on k devices: k / t_g replicas of t_g-way tensor groups."""
  devices: int
  generate_tensor: int = 1
  time: float = math.inf
  max_num_seqs: int = 0
  peak_memory: float = 0.0
  reason: str | None = None


@dataclasses.dataclass
class SplitPlan:
  """A rollout pool of `rollout.devices` beside the training pools of `train` (a sync plan
  of the roles with generation left out), and what a step of `mode` costs on them."""
  mode: str
  rollout: RolloutPool
  train: Plan
  weight_sync: float       # seconds to copy the actor's generation weights across
  sync_bytes: float        # bytes each rollout device receives per sync
  overlapped: float        # the generation and training side by side
  reason: str | None = None

  @property
  def feasible(self) -> bool:
    return self.reason is None

  @property
  def step_time(self) -> float:
    return self.overlapped + self.weight_sync if self.feasible else math.inf

  @property
  def label(self) -> str:
    return "rollout split"

  @property
  def rollout_devices(self) -> int:
    return self.rollout.devices

  @property
  def devices(self) -> tuple[int, ...]:
    return self.train.devices + (self.rollout.devices,)

  @property
  def training_time(self) -> float:
    return self.train.step_time

  @property
  def stage_times(self) -> dict[str, float]:
    return {"generate": self.rollout.time, **self.train.stage_times,
            "weight_sync": self.weight_sync}

  def to_config(self) -> dict:
    """The training plan's placement dict plus pool "rollout" and role "rollout" on it; the
    actor's generate_tensor and max_num_seqs are the rollout pool's (build_placement lays
    them over it)."""
    spec = self.train.to_config()
    spec["pools"]["rollout"] = self.rollout.devices
    actor = spec["roles"]["actor"]
    actor["generate_tensor"] = self.rollout.generate_tensor
    actor.pop("generate_strided", None)
    actor.pop("max_num_seqs", None)
    if self.rollout.max_num_seqs:
      actor["max_num_seqs"] = self.rollout.max_num_seqs
    spec["roles"]["rollout"] = {"pool": "rollout"}
    return spec

  def describe(self) -> str:
    pools = "  ".join(f"[{'+'.join(g)}]x{n}" for g, n in
                      zip(self.train.placement, self.train.devices))
    meshes = " ".join(f"{r}={m}" for r, m in self.train.meshes.items())
    memory = "/".join(map(nbytes, self.train.peak_memory + (self.rollout.peak_memory,)))
    return (f"{seconds(self.step_time):>8}  {pools}  [rollout]x{self.rollout.devices}  "
            f"{meshes} t_g={self.rollout.generate_tensor}  {self.mode}: "
            f"overlap(generate={seconds(self.rollout.time)}, "
            f"train pools={seconds(self.training_time)})={seconds(self.overlapped)} + "
            f"weight_sync={seconds(self.weight_sync)}  peak {memory}")


class SplitPlanner:
  """Rollout pools and training placements for one workload, memoised across k."""

  def __init__(self, workload: Workload, profile: DeviceProfile,
               overheads: Overheads | None = None):
    self.wl, self.prof = workload, profile
    self.trainer = Planner(workload, profile, overheads, generates=False)
    self.sim = self.trainer.sim
    self.stage_time = _stage_time(profile)

  def rollout_pool(self, k: int) -> RolloutPool:
    """The fastest generation layout of k devices holding nothing but the actor's
    generation copy and its KV cache."""
    sim, best, failure = self.sim, None, None
    for t in _powers_of_two(min(MAX_TENSOR, self.prof.devices_per_node, k)):
      if k % t:
        continue
      cost = sim.generate(MeshShape(k // t, 1, t), t, sim.capacity)
      pool = RolloutPool(k, t, cost.time, cost.max_num_seqs, cost.transient, cost.reason)
      if pool.reason:
        failure = failure or pool
      elif best is None or pool.time < best.time:
        best = pool
    return best or failure or RolloutPool(k, reason=f"no generation layout of {k} devices")

  def weight_sync(self, rollout: RolloutPool, train_devices: int) -> tuple[float, float]:
    """(seconds, bytes per rollout device) of one copy of the actor's generation weights:
    each rollout device receives its t_g shard, and the training devices send one copy per
    replica between them; the slower side sets the time, over the links the two pools
    span together."""
    cfg = self.wl.models["actor"]
    shard = compute_bytes(cfg) * cfg.num_params / rollout.generate_tensor
    sent = shard * rollout.devices / train_devices
    span = rollout.devices + train_devices
    return comm.transfer(self.prof, max(shard, sent), span), shard

  def plan(self, k: int, total: int, mode: str) -> SplitPlan | None:
    """The best split with k rollout devices of `total`, or None when a side cannot run."""
    rollout = self.rollout_pool(k)
    if rollout.reason:
      return None
    trained = self.trainer.search(total - k, top_k=1, per_placement=1)
    if not trained:
      return None
    train = trained[0]
    sync, shard = self.weight_sync(rollout, sum(train.devices))
    overlapped = self.stage_time(rollout.time + train.step_time,
                                 max(rollout.time, train.step_time))
    return SplitPlan(mode, rollout, train, sync, shard, overlapped)

  def search(self, total: int, mode: str = "one_step_off") -> list[SplitPlan]:
    """Ranked splits (best first), one per rollout pool size k."""
    counts = device_counts(total, self.prof.devices_per_node)
    sizes = sorted({k for k in counts + [total - c for c in counts] if 0 < k < total})
    plans = [p for p in (self.plan(k, total, mode) for k in sizes) if p is not None]
    return sorted(plans, key=lambda p: p.step_time)


@dataclasses.dataclass
class Pick:
  """The plan a run of `mode` takes, the best of each kind it was chosen from, and why."""
  mode: str
  plan: Plan | SplitPlan
  sync: Plan | None            # the best plan whose devices generate and train in turn
  split: SplitPlan | None      # the best split (None for sync runs, or where none fits)
  explanation: str


def pick(workload: Workload, profile: DeviceProfile, num_devices: int, mode: str = "sync", *,
         overheads: Overheads | None = None, consider_split: bool | None = None) -> Pick:
  """The best plan for a run of trainer.mode `mode`: the sync search's best, and for the
  asynchronous modes (or with consider_split) also the best rollout split, whichever
  steps faster, with an explanation naming the split and the per-pool times."""
  if mode not in MODES:
    raise ValueError(f"mode: {mode!r} is not one of {MODES}")
  if consider_split is None:
    consider_split = mode in SPLIT_MODES
  if consider_split and mode not in SPLIT_MODES:
    raise ValueError(f"mode: a rollout split overlaps nothing in {mode!r} mode; plan it for "
                     f"one of {SPLIT_MODES}")
  planner = Planner(workload, profile, overheads)
  synced = planner.search(num_devices, top_k=1)
  sync = synced[0] if synced else None
  split = None
  if consider_split and num_devices > 1:
    splitter = SplitPlanner(workload, profile, overheads)
    splits = splitter.search(num_devices, mode)
    split = splits[0] if splits else None
  if sync is None and split is None:
    raise ValueError(f"no placement of these models fits on {num_devices} devices "
                     f"({profile.name})")
  best = split if split is not None and (sync is None or split.step_time < sync.step_time) \
      else sync
  # A split's teacher sits among its training pools, planned on the devices beside rollout.
  teacher = (explain_teacher(planner, sync, num_devices) if best is sync else
             explain_teacher(splitter.trainer, split.train, num_devices - split.rollout.devices,
                             "scoring and updating"))
  explanation = explain(mode, num_devices, sync, split, best)
  return Pick(mode, best, sync, split, f"{explanation}; {teacher}" if teacher else explanation)


def _count(n: int, what: str) -> str:
  return f"{n} {what}{'' if n == 1 else 's'}"


def _sync_terms(plan: Plan) -> str:
  return " + ".join(f"{s} {seconds(t)}" for s, t in plan.stage_times.items())


def _split_terms(split: SplitPlan) -> str:
  train = split.train
  pools = " ".join(f"[{'+'.join(g)}]x{n}" for g, n in zip(train.placement, train.devices))
  meshes = " ".join(f"{r}={m}" for r, m in train.meshes.items())
  replicas = split.rollout.devices // split.rollout.generate_tensor
  return (f"{_count(split.rollout.devices, 'rollout device')} (t_g="
          f"{split.rollout.generate_tensor}, {_count(replicas, 'replica')}) generating in "
          f"{seconds(split.rollout.time)}, beside "
          f"{_count(sum(train.devices), 'training device')} "
          f"({pools} {meshes}{train.expert_terms()}) scoring and updating in "
          f"{seconds(split.training_time)} ({_sync_terms(train)}); overlapped "
          f"{seconds(split.overlapped)} + weight sync "
          f"{seconds(split.weight_sync)} ({nbytes(split.sync_bytes)} to each rollout device) "
          f"= {seconds(split.step_time)}")


def explain(mode: str, devices: int, sync: Plan | None, split: SplitPlan | None,
            best) -> str:
  """Why `best` was picked, in words: the split's k, the pools' times, the comparison."""
  head = f"auto placement for trainer.mode={mode} on {devices} devices: "
  if split is None:
    why = ("sync steps generate, score and train in turn, so a rollout pool of its own "
           "would idle" if mode not in SPLIT_MODES else "no rollout split fits")
    return head + f"{sync.label}, a step of {sync.describe().strip()}; {why}"
  if sync is None:
    return head + "split: " + _split_terms(split) + "; no placement generating where it " \
        "trains fits"
  colocated = (f"the best plan generating on its training devices ({sync.label}, "
               f"{'+'.join(map(str, sync.devices))} devices: {_sync_terms(sync)} "
               f"= {seconds(sync.step_time)})")
  if best is split:
    ratio = sync.step_time / split.step_time
    return (head + f"split into {split.rollout.devices} rollout and "
            f"{sum(split.train.devices)} training devices: " + _split_terms(split)
            + f"; {ratio:.2f}x faster than {colocated}, because the next batch's generation "
            "runs while this one trains instead of before it")
  hidden = min(split.rollout.time, split.training_time)
  if split.weight_sync >= hidden:
    cause = (f"the weight sync ({seconds(split.weight_sync)}) costs more than the "
             f"overlap hides ({seconds(hidden)})")
  else:
    cause = (f"each side gets fewer devices: generation on {split.rollout.devices} "
             f"devices and training on {sum(split.train.devices)} take longer than the "
             f"colocated stages one after the other")
  return (head + f"{sync.label} wins: {colocated}, against the best split, "
          + _split_terms(split) + f"; the split loses because {cause}")
