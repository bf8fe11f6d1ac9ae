"""From a config to the typed plan of a run: the placement of the roles it needs, their
models, optimisers, losses and sampling; checks of what a placement must give them. The
layers below take the plan (hflax.controller.plan), not the config."""
from __future__ import annotations

from typing import Callable

from ml_collections import FrozenConfigDict

from hflax.algorithms.correction import RolloutCorrection
from hflax.algorithms.drivers import StepConfig, get_algorithm
from hflax.controller import build
from hflax.controller.plan import (ActorPlan, CriticPlan, RunPlan, ScorerPlan,
                                   TrainPlan)
from hflax.controller.roles import Role, Roles
from hflax.controller.training import OptimConfig, UpdateConfig
from hflax.launch.config import generation_cap_problem, tokenizer_spec
from hflax.launch.models import (  # noqa: F401  (the launcher's names for them, in one place)
    actor_config, builtin_config, check_adapter, lora_plan, needed_roles, policy_model,
    read_model_configs, reference_in_actor, remove_padding, role_reasons, teacher_path,
    token_budgets, uses_reference, with_lora)
from hflax.rollout import SamplingParams
from hflax.rollout.agents.rollout import MultiTurn
from hflax.sharding.layouts import data_parallel_size
from hflax.sharding.placement import colocated, standalone


def check_roles_placed(cfg, placed, roles=None) -> None:
  """Every role that will run has a place (`placed`: role names of the placement)."""
  reasons = role_reasons(cfg)
  missing = [r for r in (reasons if roles is None else roles) if r not in placed]
  if missing:
    why = "; ".join(f"{r} for {reasons[r]}" for r in missing)
    raise ValueError(f"config.placement.roles: no pool for {why}; add them to "
                     "placement.roles, or use placement.kind='colocated' or 'standalone'")


def check_generation_cap(cfg, cap) -> None:
  """The placement's max_num_seqs for the actor holds one prompt's samples at least."""
  problem = generation_cap_problem(cfg, cap)
  if problem:
    where = "an auto plan's " if cfg.placement.kind == "auto" else "config.placement.roles.actor."
    raise ValueError(f"{where}max_num_seqs: {problem}")


def check_placed(cfg, placed, roles) -> None:
  """What a built placement must give the roles that run on it: a pool each, a generation
  cap that holds one prompt's samples, micro-batches as wide as their data axes."""
  check_roles_placed(cfg, placed, roles)
  if "actor" in placed:
    check_generation_cap(cfg, placed["actor"].max_num_seqs)
  check_micro_batches(cfg, placed, roles, cfg.rollout.n)
  check_token_budgets(cfg, roles)


def placement_spec(cfg, roles: list[str], devices: int, policy_cfg=None, device_list=None,
                   log=print) -> dict:
  kind, tensor = cfg.placement.kind, cfg.rollout.generate_tensor
  if kind == "auto":  # the auto-mapper's pick for trainer.mode (a split for the async modes)
    from hflax.launch.plan import picked_plan  # late: the plan CLI starts JAX in its own way
    chosen = picked_plan(cfg, policy_cfg, device_list, cfg.placement.get("profile", "calibrate"))
    log(chosen.explanation)
    return chosen.plan.to_config()
  if kind == "colocated":
    spec = colocated(roles, devices, tensor)
  elif kind == "standalone":
    if devices % len(roles):
      raise ValueError(f"config.placement: 'standalone' needs the {devices} devices to divide "
                       f"among the {len(roles)} roles {roles}")
    spec = standalone(roles, devices // len(roles), tensor)
  else:
    spec = {"pools": cfg.placement.pools.to_dict(), "roles": cfg.placement.roles.to_dict()}
    if "teacher" in roles and "teacher" not in spec["roles"] and "ref" in spec["roles"]:
      spec["roles"]["teacher"] = dict(spec["roles"]["ref"])  # the reference's place
    if reference_in_actor(cfg) and spec["roles"].pop("ref", None):
      # The actor serves the reference: a pool that only the reference used would idle.
      used = {r.get("pool") for r in spec["roles"].values()}
      spec["pools"] = {p: n for p, n in spec["pools"].items() if p in used}
    actor = spec["roles"].get("actor")
    if actor is None or "generate_tensor" in actor:
      return spec
    actor["generate_tensor"] = tensor  # the actor generates with rollout.generate_tensor
  # The actor generates on its own pool, or on role "rollout"'s (a split placement).
  split = "rollout" in spec["roles"]
  pool = spec["pools"].get(spec["roles"].get("rollout" if split else "actor", {}).get("pool"))
  if pool and int(pool) % tensor:  # named here: the placement's own check names its copy
    raise ValueError(f"config.rollout.generate_tensor: {tensor} does not divide the actor's "
                     f"{'rollout ' if split else ''}pool of {pool} devices")
  return spec


def _update(section, n: int, model=None) -> UpdateConfig:
  """A role's update batching; `model` (the config's model section) says whether its
  passes run on packed rows (use_remove_padding)."""
  rows = section.ppo_mini_batch_size * n
  budget, forward = token_budgets(section)
  return UpdateConfig(mini_batch_size=rows, micro_batch_size=section.ppo_micro_batch_size or rows,
                      epochs=section.ppo_epochs, shuffle=section.shuffle,
                      remove_padding=remove_padding(model), max_token_len=budget,
                      log_prob_max_token_len=forward,
                      share_prompts=bool(model is None or model.get("share_prompts", True)))


def check_token_budgets(cfg, wanted) -> None:
  """Before any device work: a token budget holds the longest sequence of the run."""
  longest = cfg.data.max_prompt_length + cfg.data.max_response_length
  for role in ("actor", "critic"):
    if role not in wanted:
      continue
    section = getattr(cfg, role)
    budget, forward = token_budgets(section)
    for name, value in (("ppo_max_token_len_per_gpu", budget),
                        ("log_prob_max_token_len_per_gpu", forward)):
      if value and value < longest:
        raise ValueError(f"config.{role}.{name}: {value} tokens is less than the longest "
                         f"sequence ({longest} tokens: data.max_prompt_length + "
                         "data.max_response_length)")


def check_micro_batches(cfg, placed, wanted, n: int):
  """Before any parameters move: a micro-batch needs a row on every data-parallel device
  (batches the data width does not divide are padded, but a micro-batch of fewer rows
  than devices would be mostly padding)."""
  for role in ("actor", "critic"):
    if role not in wanted or role not in placed:
      continue
    update = _update(getattr(cfg, role), n, cfg.model)
    micro, dp = update.micro_batch_size, data_parallel_size(placed[role].mesh)
    if micro < dp and not update.packed:  # packed micro-batches fill every device
      raise ValueError(f"config.{role}.ppo_micro_batch_size: {micro} rows per micro-batch are "
                       f"fewer than the {role}'s data-parallel size {dp}; use at least {dp} "
                       "(or a mesh with a narrower data axis)")


def _train(section, n: int, model) -> TrainPlan:
  return TrainPlan(optim=OptimConfig(**section.optim), update=_update(section, n, model),
                   loss=FrozenConfigDict(section))


def make_plan(cfg, placement: dict, tokenizer) -> RunPlan:
  """The typed plan of a run, with its placement spec (see placement_spec) decided."""
  algorithm, n = get_algorithm(cfg.algorithm.name), cfg.rollout.n
  r = cfg.rollout
  sampling = SamplingParams(
      max_new_tokens=cfg.data.max_response_length, temperature=r.temperature, top_k=r.top_k,
      top_p=r.top_p, n=n, eos_ids=tuple(tokenizer.eos_ids), pad_id=tokenizer.pad_id,
      record_routes=bool(cfg.actor.get("router_replay", False)))
  actor = ActorPlan(train=_train(cfg.actor, n, cfg.model), sampling=sampling, lora=lora_plan(cfg.model),
                    generate_dtype=r.dtype, recompute_log_prob=cfg.actor.recompute_log_prob,
                    optimizer_offload=cfg.actor.optimizer_offload, max_num_seqs=r.max_num_seqs,
                    continuous_batching=bool(r.get("continuous_batching", False)),
                    old_log_probs_in_reward=bool(cfg.algorithm.use_kl_in_reward),
                    use_kl_loss=bool(cfg.actor.use_kl_loss),
                    rollout_correction=rollout_correction(cfg),
                    multi_turn=multi_turn(cfg), tokenizer=tokenizer_spec(cfg))
  critic = CriticPlan(train=_train(cfg.critic, n, cfg.model), model_path=cfg.critic.model_path,
                      lora=lora_plan(cfg.critic)) if algorithm.uses_critic else None
  cost = ScorerPlan(kind=cfg.cost.kind, model_path=cfg.cost.model_path,
                    output="token_level_costs") if algorithm.uses_cost else None
  return RunPlan(
      algorithm=algorithm.name, placed_roles=tuple(Role(x) for x in needed_roles(cfg)),
      placement=placement, actor=actor, critic=critic, cost=cost,
      reward=ScorerPlan(kind=cfg.reward.kind, model_path=cfg.reward.model_path,
                        output="token_level_scores"),
      reference=uses_reference(cfg), reference_in_actor=reference_in_actor(cfg),
      ref_temperature=r.temperature or 1.0, seed=cfg.trainer.seed,
      ref_remove_padding=remove_padding(cfg.model),
      ref_share_prompts=bool(cfg.model.get("share_prompts", True)),
      ref_log_prob_max_token_len=token_budgets(cfg.actor)[1], teacher_path=teacher_path(cfg))


def multi_turn(cfg) -> MultiTurn | None:
  """rollout.multi_turn as the actor reads it; None when off."""
  m = cfg.rollout.multi_turn
  if not m.enable:
    return None
  return MultiTurn(max_turns=m.max_assistant_turns, max_turn_len=m.max_tool_response_length,
                   turn_tokens=m.max_turn_tokens,
                   tool_config_path=m.tool_config_path, format=m.format,
                   tool_timeout_s=float(m.tool_timeout_s), slots=cfg.rollout.max_num_seqs,
                   rewrite_history=bool(m.get("rewrite_history", False)))


def rollout_correction(cfg) -> RolloutCorrection | None:
  """algorithm.rollout_correction as the loss reads it; None when it corrects nothing."""
  section = dict(cfg.algorithm.get("rollout_correction", {}))
  correction = RolloutCorrection(**section)
  return correction if correction.enabled else None


def step_config(cfg) -> StepConfig:
  """What the algorithm's driver reads of the config."""
  return StepConfig(algorithm=FrozenConfigDict(cfg.algorithm),
                    train_batch_size=cfg.data.train_batch_size,
                    max_response_length=cfg.data.max_response_length,
                    critic_warmup=cfg.trainer.critic_warmup,
                    distill=FrozenConfigDict(cfg.distill) if teacher_path(cfg) else None)


def build_roles(cfg, policy, *, tokenizer, reward_fn: Callable | None = None,
                cost_fn: Callable | None = None, devices=None) -> Roles:
  """The roles of a config on local `devices` (research code, tests and benchmarks; the
  main job goes through its backend)."""
  import jax
  from hflax.sharding.placement import build_placement
  devices = list(devices if devices is not None else jax.devices())
  roles = needed_roles(cfg)
  spec = placement_spec(cfg, roles, len(devices), policy[0], devices)
  check_placed(cfg, build_placement(spec, devices), roles)
  plan = make_plan(cfg, spec, tokenizer)
  return build.build_roles(plan, policy, devices=devices, reward_fn=reward_fn, cost_fn=cost_fn)
