"""What one RL step asks of each model: the workload the auto-mapper plans for.

Roles: "actor" (trained, and it generates), "critic" (trained), "ref", "reward", "cost"
and "teacher" (forward only). The teacher is on-policy distillation's: its log-probs on
every step's samples, like the reference's, from a model of its own shape (often larger
than the actor). A step runs in three stages, in order (the paper's dataflow): generate,
then every forward pass that scores the responses, then the updates.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from hflax.models.config import ModelConfig
from hflax.sharding.automap.memory import ATTENTIONS

TRAINED = ("actor", "critic")
KNOWN_ROLES = ("actor", "critic", "ref", "reward", "cost", "teacher")
STAGES = ("generate", "forward", "train")
KV_CACHES = ("sampler", "paged")


@dataclasses.dataclass(frozen=True)
class Workload:
  models: Mapping[str, ModelConfig]   # role -> model shape
  prompts_per_step: int = 1024
  samples_per_prompt: int = 1
  prompt_len: int = 1024
  response_len: int = 1024
  mini_batch_size: int = 256          # prompts per optimizer step (verl's ppo_mini_batch_size)
  ppo_epochs: int = 1
  micro_batch_size: int = 8           # sequences per device per forward/backward call
  # The actor also computes the reference log-probs (LoRA: from its frozen base).
  reference_in_actor: bool = False
  # Sequences a generation replica may hold at once (rollout.max_num_seqs; 0: as many as
  # the KV cache fits).
  max_num_seqs: int = 0
  # Validation's samples per prompt (rollout.val_n): generated together too, so the KV
  # cache must hold them, though validation is not timed.
  val_samples_per_prompt: int = 1
  # How attention runs (memory.ATTENTIONS): "dense" stores [B, heads, T, T] scores per
  # layer, "blockwise" one tile; "" is what hflax's runtime picks (memory.runtime_attention).
  attention: str = ""
  # The generation engine's KV cache: "sampler" is hflax/rollout/sampler.py's (a prefill
  # cache of the bucketed prompt, then a decode cache grown to prompt + response), "paged"
  # one cache of prompt + response slots per sequence (vLLM's, as the paper's system ran).
  kv_cache: str = "sampler"
  # rollout.continuous_batching: max_num_seqs decode slots per replica, each taking the
  # next pending sequence when its row ends (hflax/rollout/continuous.py), not waves.
  continuous_batching: bool = False
  # Expected lengths (None: the maximum, today's worst case). Continuous batching's decode
  # time and packed passes' compute follow them; padded waves and rows do not.
  mean_response_len: float | None = None
  mean_prompt_len: float | None = None
  # model.use_remove_padding: update and forward passes compute the real tokens laid end
  # to end, a micro-batch per device of about `token_budget` tokens (actor.use_dynamic_bsz
  # with ppo_max_token_len_per_gpu; 0: micro_batch_size sequences' tokens) and of
  # `forward_token_budget` in the forward passes (log_prob_max_token_len_per_gpu; 0: the
  # update's).
  packed: bool = False
  token_budget: int = 0
  forward_token_budget: int = 0
  # model.share_prompts: packed passes compute a prompt its samples repeat once.
  share_prompts: bool = False

  def __post_init__(self):
    roles = tuple(self.models)
    unknown = set(roles) - set(KNOWN_ROLES)
    if unknown:
      raise ValueError(f"models: unknown roles {sorted(unknown)}; known: {KNOWN_ROLES}")
    if "actor" not in roles:
      raise ValueError("models: an 'actor' is required (it generates the responses)")
    for name in ("prompts_per_step", "samples_per_prompt", "prompt_len", "response_len",
                 "mini_batch_size", "ppo_epochs", "micro_batch_size"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
    if self.attention not in ("",) + ATTENTIONS:
      raise ValueError(f"attention must be one of {ATTENTIONS} (or '' for the runtime's), "
                       f"got {self.attention!r}")
    if self.kv_cache not in KV_CACHES:
      raise ValueError(f"kv_cache must be one of {KV_CACHES}, got {self.kv_cache!r}")
    if self.val_samples_per_prompt < 1:
      raise ValueError(f"val_samples_per_prompt must be >= 1, got {self.val_samples_per_prompt}")
    self._check_runtime_modes()
    # A decode slot holds one sample, so continuous batching takes any cap.
    least = 1 if self.continuous_batching else self.samples_per_prompt_most
    if self.max_num_seqs < 0 or 0 < self.max_num_seqs < least:
      what = ("1 (one decode slot)" if self.continuous_batching else
              f"the {least} samples of one prompt, which are generated together")
      raise ValueError(f"max_num_seqs must be 0 (no cap) or at least {what}; "
                       f"got {self.max_num_seqs}")
    if self.prompts_per_step % self.mini_batch_size:
      raise ValueError(f"mini_batch_size={self.mini_batch_size} must divide "
                       f"prompts_per_step={self.prompts_per_step}")
    # Canonical role order, so placements and reports read the same everywhere.
    object.__setattr__(self, "models", {r: self.models[r] for r in KNOWN_ROLES
                                        if r in self.models})

  def _check_runtime_modes(self):
    for name in ("continuous_batching", "packed"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
    for name, most in (("mean_response_len", self.response_len),
                       ("mean_prompt_len", self.prompt_len)):
      value = getattr(self, name)
      if value is None:
        object.__setattr__(self, name, most)
      elif not 1 <= value <= most:
        raise ValueError(f"{name} must be in [1, {most}] (at most the maximum), got {value}")
    for name in ("token_budget", "forward_token_budget"):
      value = getattr(self, name)
      if value < 0:
        raise ValueError(f"{name} must be >= 0 (0: by micro_batch_size), got {value}")
      if value and not self.packed:
        raise ValueError(f"{name}: token budgets cut packed passes; set packed=True")
      if 0 < value < self.seq_len:  # the runtime refuses these too (launch/roles.py)
        raise ValueError(f"{name}: {value} tokens is less than the longest sequence "
                         f"({self.seq_len} tokens)")

  @property
  def roles(self) -> tuple[str, ...]:
    return tuple(self.models)

  @property
  def samples_per_prompt_most(self) -> int:
    """The most samples of one prompt generated together (training or validation)."""
    return max(self.samples_per_prompt, self.val_samples_per_prompt)

  @property
  def sequences(self) -> int:
    return self.prompts_per_step * self.samples_per_prompt

  @property
  def seq_len(self) -> int:
    return self.prompt_len + self.response_len

  @property
  def mean_seq_len(self) -> float:
    return self.mean_prompt_len + self.mean_response_len

  @property
  def packed_seq_len(self) -> float:
    """Tokens a packed pass computes per sequence: with shared prompts a prompt's tokens
    are spread over its samples."""
    share = self.samples_per_prompt if self.share_prompts else 1
    return self.mean_prompt_len / share + self.mean_response_len

  def packed_row_tokens(self, train: bool) -> float:
    """Tokens of one packed micro-batch per device (one row): the budget, or the real
    tokens of micro_batch_size sequences."""
    budget = self.token_budget if train else (self.forward_token_budget or self.token_budget)
    return budget or self.micro_batch_size * self.packed_seq_len

  @property
  def mini_batch_sequences(self) -> int:
    return self.mini_batch_size * self.samples_per_prompt

  @property
  def optimizer_steps(self) -> int:
    return self.ppo_epochs * self.prompts_per_step // self.mini_batch_size

  @classmethod
  def ppo(cls, actor: ModelConfig, critic: ModelConfig | None = None, *,
          ref: ModelConfig | None = None, reward: ModelConfig | None = None,
          cost: ModelConfig | None = None, teacher: ModelConfig | None = None,
          **kw) -> Workload:
    """PPO's four models: ref defaults to the actor's shape, reward to the critic's; cost
    and a distillation teacher only when given."""
    critic = critic or actor
    models = {"actor": actor, "critic": critic, "ref": ref or actor, "reward": reward or critic}
    for role, cfg in (("cost", cost), ("teacher", teacher)):
      if cfg is not None:
        models[role] = cfg
    return cls(models=models, **kw)
