"""The roles of the RL dataflow: their names, what each one can do, and the set a run holds.

A driver sees roles only through these Protocols, so a local worker, a Ray role handle
and a host-side reward function are interchangeable wherever they offer the same methods.
"""
from __future__ import annotations

import dataclasses
import enum
from typing import Protocol, runtime_checkable

from hflax.controller.batch import Batch
from hflax.rollout import SamplingParams


class Role(str, enum.Enum):
  ACTOR = "actor"
  REF = "ref"
  CRITIC = "critic"
  REWARD = "reward"
  COST = "cost"
  TEACHER = "teacher"  # on-policy distillation's teacher (log-probs only)


# Roles whose parameters train (and go into checkpoints).
TRAINED = (Role.ACTOR, Role.CRITIC)


@runtime_checkable
class ActorRole(Protocol):
  """The policy: generates in its generation layout, trains in its training layout."""

  sampling: SamplingParams

  def generate_sequences(self, prompts: Batch, sampling: SamplingParams | None = None,
                         rng=None) -> Batch: ...

  def old_log_probs(self, batch: Batch) -> Batch: ...

  def compute_log_prob(self, batch: Batch) -> Batch: ...

  def update_actor(self, batch: Batch) -> Batch: ...


@runtime_checkable
class ReferenceRole(Protocol):
  def compute_ref_log_prob(self, batch: Batch) -> Batch: ...


@runtime_checkable
class TeacherRole(Protocol):
  def compute_teacher_log_prob(self, batch: Batch) -> Batch: ...


@runtime_checkable
class CriticRole(Protocol):
  def compute_values(self, batch: Batch) -> Batch: ...

  def update_critic(self, batch: Batch) -> Batch: ...


@runtime_checkable
class RewardRole(Protocol):
  """A reward model, or a function on the host; a cost role is a RewardRole writing costs."""

  def compute_reward(self, batch: Batch) -> Batch: ...


@dataclasses.dataclass
class Roles:
  actor: ActorRole
  ref: ReferenceRole | None = None
  critic: CriticRole | None = None
  reward: RewardRole | None = None
  cost: RewardRole | None = None
  teacher: TeacherRole | None = None

  def get(self, role: Role):
    return getattr(self, Role(role).value)

  def trained(self) -> dict[Role, object]:
    """The roles a checkpoint keeps (their parameters and optimizer state)."""
    return {r: self.get(r) for r in TRAINED if self.get(r) is not None}
