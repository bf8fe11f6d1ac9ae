"""A role's training/inference mesh shape: (data, fsdp, tensor), as the controller builds it."""
from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, order=True)
class MeshShape:
  data: int = 1
  fsdp: int = 1
  tensor: int = 1

  @property
  def size(self) -> int:
    return self.data * self.fsdp * self.tensor

  @property
  def shards(self) -> int:
    """How many ways each weight is split (fsdp x tensor); the data axis replicates."""
    return self.fsdp * self.tensor

  @property
  def batch_ways(self) -> int:
    """How many ways the batch is split (data x fsdp); a tensor group shares its rows."""
    return self.data * self.fsdp

  def as_dict(self) -> dict:
    return {"data": self.data, "fsdp": self.fsdp, "tensor": self.tensor}

  def __str__(self) -> str:
    return f"({self.data},{self.fsdp},{self.tensor})"
