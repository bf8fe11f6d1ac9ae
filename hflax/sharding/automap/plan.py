"""A plan: where each role runs, on which mesh, and what the simulator predicts for it."""
from __future__ import annotations

import dataclasses
import math

from hflax.sharding.automap.mesh import MeshShape
from hflax.sharding.automap.placements import Placement, label
from hflax.sharding.automap.workload import STAGES


@dataclasses.dataclass
class Plan:
  placement: Placement                 # groups of colocated roles, one pool each
  devices: tuple[int, ...]             # devices per pool, in placement order
  meshes: dict[str, MeshShape]         # role -> training/inference mesh
  generate_tensor: int                 # the actor's generation tensor width t_g
  stage_times: dict[str, float]        # stage -> seconds (max over pools of their sum)
  pool_stage_times: tuple[dict[str, float], ...] = ()
  peak_memory: tuple[float, ...] = ()  # bytes per device, per pool
  reason: str | None = None            # why the plan cannot run (None: it can)
  notes: dict[str, str] = dataclasses.field(default_factory=dict)  # role -> "remat", ...
  generate_strided: bool = True        # False: node-local generation tensor groups
  # Sequences per generation replica whose KV cache the plan's memory holds: the actor
  # generates in waves of at most this many (also in validation, whatever its batch).
  max_num_seqs: int = 0
  # Mixture-of-experts roles: role -> (total parameters, active parameters, bytes each
  # device receives per step moving tokens or experts over the pool: cost._expert_exchange).
  experts: dict[str, tuple[int, int, float]] = dataclasses.field(default_factory=dict)

  @property
  def feasible(self) -> bool:
    return self.reason is None

  @property
  def step_time(self) -> float:
    return sum(self.stage_times.values()) if self.feasible else math.inf

  @property
  def label(self) -> str:
    return label(self.placement)

  def pool_of(self, role: str) -> str:
    for i, group in enumerate(self.placement):
      if role in group:
        return f"pool{i}"
    raise KeyError(role)

  def to_config(self) -> dict:
    """The placement dict the controller consumes (see hflax.sharding.placement):

      {"pools": {"pool0": 8, "pool1": 8},
       "roles": {"actor": {"pool": "pool0", "mesh": {"data": 1, "fsdp": 4, "tensor": 2},
                           "generate_tensor": 2, "max_num_seqs": 48},
                 "critic": {"pool": "pool1", "mesh": {...}}, ...}}

    Only when the plan needs node-local generation groups (hybrid_engine.generate_mesh
    with strided=False) does the actor's entry also carry "generate_strided": False.
    """
    roles = {}
    for group in self.placement:
      for role in group:
        entry = {"pool": self.pool_of(role), "mesh": self.meshes[role].as_dict()}
        if role == "actor":
          entry["generate_tensor"] = self.generate_tensor
          if not self.generate_strided:
            entry["generate_strided"] = False
          if self.max_num_seqs:
            entry["max_num_seqs"] = self.max_num_seqs
        roles[role] = entry
    return {"pools": {f"pool{i}": n for i, n in enumerate(self.devices)}, "roles": roles}

  def describe(self) -> str:
    pools = "  ".join(f"[{'+'.join(g)}]x{n}" for g, n in zip(self.placement, self.devices))
    if not self.feasible:
      return f"{pools}  infeasible: {self.reason}"
    meshes = " ".join(f"{r}={m}" for r, m in self.meshes.items())
    stages = " ".join(f"{s}={seconds(self.stage_times[s])}" for s in STAGES
                      if s in self.stage_times)
    memory = "/".join(map(nbytes, self.peak_memory))
    notes = "".join(f" {r}:{n}" for r, n in self.notes.items() if n)
    return (f"{seconds(self.step_time):>8}  {pools}  {meshes} t_g={self.generate_tensor}  "
            f"{stages}  peak {memory}{notes}{self.expert_terms()}")

  def expert_terms(self) -> str:
    """For each mixture-of-experts role: its total and active parameters and the bytes its
    sparse layers move per step; "" for dense models."""
    return "".join(f"  {r}: {count(total)} params, {count(active)} active, expert exchange "
                   f"{nbytes(moved)}/step" for r, (total, active, moved) in self.experts.items())


def seconds(t: float) -> str:
  """Three significant figures, so a CPU plan's 40 ms reads as such and not as 0.0s."""
  if t < 1:
    return f"{t * 1e3:.3g}ms"
  return f"{t:.1f}s" if t < 100 else f"{t:.0f}s"


def count(n: float) -> str:
  for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
    if n >= size:
      return f"{n / size:.3g}{unit}"
  return f"{n:.0f}"


def nbytes(b: float) -> str:
  for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
    if b >= size:
      return f"{b / size:.3g} {unit}"
  return f"{b:.0f} B"
