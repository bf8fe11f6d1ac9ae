"""Builds the role workers of a plan on devices: models, LoRA adapters, placement, losses."""
from __future__ import annotations

from typing import Callable

import jax
from flax import nnx

from hflax.algorithms.objectives import actor_loss, critic_loss
from hflax.controller.plan import LoraPlan, RunPlan
from hflax.controller.roles import Role, Roles
from hflax.controller.actor import ActorRolloutWorker
from hflax.controller.workers import (CriticWorker, FunctionRewardWorker, ReferenceWorker,
                                      RewardModelWorker, TeacherWorker)
from hflax.models import ModelConfig, create, hf
from hflax.models.lora import (add_adapters, adapter_adapts_experts, load_adapter, lora_config,
                               split_adapters)
from hflax.sharding.placement import build_placement


def with_lora(model_cfg: ModelConfig, lora: LoraPlan | None) -> ModelConfig:
  """model_cfg with the adapters a plan asks for, if any."""
  if lora is None:
    return model_cfg
  # An adapter to start from decides whether the routed experts are adapted (PEFT's
  # all-linear on transformers 5 leaves them out).
  experts = adapter_adapts_experts(lora.adapter_path) if lora.adapter_path else True
  return lora_config(model_cfg, lora.rank, lora.alpha, lora.target_modules, experts)


def value_model(path: str, policy, seed: int, lora: LoraPlan | None = None):
  """A value-head model: from a checkpoint, else the policy's backbone with a fresh head;
  `lora` adds adapters to it."""
  if path:
    model_cfg, graphdef, state = hf.load_checkpoint(path, head="value", seed=seed)
  else:
    model_cfg, _, policy_state = policy
    graphdef, state = create(model_cfg, seed=seed, head="value")
    for key in policy_state:
      if key in state and key != "lm_head":
        state[key] = policy_state[key]
  if lora is not None:
    graphdef, state = add_adapters(with_lora(model_cfg, lora), state, seed, head="value")
  return graphdef, state


def teacher_model(path: str, student_cfg: ModelConfig):
  """On-policy distillation's teacher (graphdef, state): any checkpoint hflax loads (an HF
  directory, a LoRA-merged export, a .gguf file), in the student's dtypes and attention."""
  _, graphdef, state = hf.load_checkpoint(path, param_dtype=student_cfg.param_dtype,
                                          dtype=student_cfg.dtype,
                                          attention=student_cfg.attention)
  return graphdef, state


def build_roles(plan: RunPlan, policy, *, devices=None, reward_fn: Callable | None = None,
                cost_fn: Callable | None = None) -> Roles:
  """The workers of plan.placed_roles on `devices` (default: every local device), plus the
  host-side reward and cost functions for rule rewards (when given).

  policy: (model config, graphdef, state) the actor, reference and value models start
  from. A remote backend builds one pool's share: `plan.only(roles, pool placement)`.
  """
  devices = list(devices if devices is not None else jax.devices())
  placed = build_placement(plan.placement, devices)
  wanted = plan.placed_roles
  seed = plan.seed
  home = jax.sharding.SingleDeviceSharding(
      placed[(wanted[0] if wanted else Role.ACTOR).value].pool.devices[0])
  model_cfg, graphdef, state = policy
  out = Roles(actor=None)
  if Role.ACTOR in wanted:
    a = plan.actor
    actor_graphdef, actor_state = graphdef, state
    if a.lora is not None:
      lora_cfg = with_lora(model_cfg, a.lora)
      actor_graphdef, actor_state = add_adapters(lora_cfg, state, seed)
      if a.lora.adapter_path:
        actor_state = nnx.merge_state(split_adapters(actor_state)[1],
                                      load_adapter(a.lora.adapter_path, lora_cfg))
    out.actor = ActorRolloutWorker(
        placed["actor"], actor_graphdef, actor_state, sampling=a.sampling,
        loss_fn=actor_loss(a.train.loss, a.rollout_correction),
        loss_fields=(("ref_log_prob",) if a.use_kl_loss else ()) +
        (("rollout_log_probs",) if a.rollout_correction is not None else ()) +
        (("routes",) if a.sampling.record_routes else ()),  # routing replay
        generate_dtype=a.generate_dtype, recompute_log_prob=a.recompute_log_prob,
        optimizer_offload=a.optimizer_offload, max_num_seqs=a.max_num_seqs,
        continuous_batching=a.continuous_batching, multi_turn=a.multi_turn,
        tokenizer=a.tokenizer,
        old_log_probs_in_reward=a.old_log_probs_in_reward,
        optim=a.train.optim, update=a.train.update, home=home, seed=seed)
    if plan.reference_in_actor:
      out.ref = out.actor
  if Role.REF in wanted:
    out.ref = ReferenceWorker(placed["ref"], graphdef, state, home=home,
                              temperature=plan.ref_temperature,
                              remove_padding=plan.ref_remove_padding,
                              share_prompts=plan.ref_share_prompts,
                              log_prob_max_token_len=plan.ref_log_prob_max_token_len)
  if Role.TEACHER in wanted:
    out.teacher = TeacherWorker(placed["teacher"], *teacher_model(plan.teacher_path, model_cfg),
                                home=home, temperature=plan.ref_temperature,
                                remove_padding=plan.ref_remove_padding,
                                share_prompts=plan.ref_share_prompts,
                                log_prob_max_token_len=plan.ref_log_prob_max_token_len)
  if Role.CRITIC in wanted:
    c = plan.critic
    out.critic = CriticWorker(placed["critic"], *value_model(c.model_path, policy, seed + 1,
                                                             lora=c.lora),
                              loss_fn=critic_loss(c.train.loss), optim=c.train.optim,
                              update=c.train.update, home=home, seed=seed)
  for role, scorer, fn in ((Role.REWARD, plan.reward, reward_fn), (Role.COST, plan.cost, cost_fn)):
    if scorer is None:
      continue
    if scorer.kind == "model" and role in wanted:
      worker = RewardModelWorker(placed[role.value], *value_model(scorer.model_path, policy, seed),
                                 output=scorer.output, home=home)
    elif scorer.kind == "rule" and fn is not None:
      worker = FunctionRewardWorker(fn, home=home, output=scorer.output)
    else:
      continue
    setattr(out, role.value, worker)
  return out
