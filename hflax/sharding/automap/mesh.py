"""A role's training/inference mesh shape: (data, fsdp, tensor), as the controller builds it,
and for a mixture of experts an expert axis (hflax.sharding.layouts' expert parallelism)."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, order=True)
class MeshShape:
  data: int = 1
  fsdp: int = 1
  tensor: int = 1
  # Splits a mixture of experts' experts; the batch's rows split over it too, so it is
  # data parallel for every other weight (those are replicated over it).
  expert: int = 1

  @property
  def size(self) -> int:
    return self.data * self.fsdp * self.tensor * self.expert

  @property
  def shards(self) -> int:
    """How many ways each weight is split (fsdp x tensor); the data axis replicates. The
    experts' weights split `expert` times more (expert_shards)."""
    return self.fsdp * self.tensor

  @property
  def expert_shards(self) -> int:
    return self.shards * self.expert

  @property
  def batch_ways(self) -> int:
    """How many ways the batch is split (data x fsdp x expert); a tensor group shares its
    rows."""
    return self.data * self.fsdp * self.expert

  @property
  def model_span(self) -> int:
    """Consecutive devices an fsdp group spans: the runtime lays devices out in (data,
    fsdp, expert, tensor) order (layouts.train_mesh), so fsdp's stride is expert x tensor."""
    return self.fsdp * self.expert * self.tensor

  def as_dict(self) -> dict:
    axes = {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}
    return {**axes, "expert": self.expert} if self.expert > 1 else axes

  def __str__(self) -> str:
    experts = f",e={self.expert}" if self.expert > 1 else ""
    return f"({self.data},{self.fsdp},{self.tensor}{experts})"
