"""The typed plan of a run: what the launcher decides from a config, and all the layers
below read. Built once (hflax.launch.plan_config.make_plan); plain frozen dataclasses, so
a remote backend ships it to its worker processes as it is.
"""
from __future__ import annotations

import dataclasses
from typing import Any

from hflax.algorithms.correction import RolloutCorrection
from hflax.controller.roles import Role
from hflax.controller.training import OptimConfig, UpdateConfig
from hflax.rollout import SamplingParams
from hflax.rollout.agents.rollout import MultiTurn


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoraPlan:
  rank: int
  alpha: float
  target_modules: str
  adapter_path: str = ""  # adapters to start from (PEFT format); empty: fresh ones


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrainPlan:
  optim: OptimConfig
  update: UpdateConfig
  loss: Any  # the role's loss settings, read-only (see algorithms.drivers.common)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ActorPlan:
  train: TrainPlan
  sampling: SamplingParams
  lora: LoraPlan | None = None
  generate_dtype: str | None = None
  recompute_log_prob: bool = False
  optimizer_offload: bool = False
  max_num_seqs: int = 0
  continuous_batching: bool = False  # max_num_seqs decode slots, refilled as rows end
  old_log_probs_in_reward: bool = False  # a KL penalty in the reward reads them
  use_kl_loss: bool = False  # the loss reads the reference's log-probs
  # The loss corrects for the rollout's recorded log-probs (hflax.algorithms.correction).
  rollout_correction: RolloutCorrection | None = None
  # Multi-turn trajectories with tools (rollout.multi_turn) and the tokenizer they need.
  multi_turn: MultiTurn | None = None
  tokenizer: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class CriticPlan:
  train: TrainPlan
  model_path: str = ""  # empty: the policy's backbone with a fresh value head
  lora: LoraPlan | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class ScorerPlan:
  """A reward or cost role: a model with a score head, or a function on the host."""
  kind: str  # "model" or "rule"
  output: str  # the Batch field it writes: token_level_scores or token_level_costs
  model_path: str = ""


@dataclasses.dataclass(frozen=True, kw_only=True)
class RunPlan:
  algorithm: str
  # Roles that hold devices, in build order (a rule reward runs on the host: not here).
  placed_roles: tuple[Role, ...]
  placement: dict  # {"pools": {name: devices}, "roles": {role: {pool, mesh, ...}}}
  actor: ActorPlan
  reward: ScorerPlan
  critic: CriticPlan | None = None
  cost: ScorerPlan | None = None
  reference: bool = False  # a reference policy is used (KL loss or KL in the reward)
  reference_in_actor: bool = False  # with LoRA: the actor's frozen base serves it
  ref_temperature: float = 1.0
  # The reference's log-prob passes on packed rows (model.use_remove_padding), cut by
  # tokens per device when ref_log_prob_max_token_len > 0 (actor.use_dynamic_bsz).
  ref_remove_padding: bool = False
  ref_share_prompts: bool = True  # packed: a prompt several rows repeat computed once
  ref_log_prob_max_token_len: int = 0
  # On-policy distillation's teacher checkpoint (empty: none); it runs as the reference
  # does (temperature, packing, token budget) on placement role "teacher".
  teacher_path: str = ""
  seed: int = 0

  def only(self, roles, placement: dict) -> "RunPlan":
    """The plan of one pool of a remote backend: its roles on its placement."""
    keep = tuple(Role(r) for r in roles)
    return dataclasses.replace(self, placed_roles=keep, placement=placement)
