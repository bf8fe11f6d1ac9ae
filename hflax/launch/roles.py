"""Builds the role workers an algorithm needs from a config: models, placement, losses."""
from __future__ import annotations

from typing import Callable

import jax
from flax import nnx

from hflax.algorithms.drivers import NEEDS_CRITIC, Roles
from hflax.algorithms.drivers.common import actor_loss, critic_loss
from hflax.controller.training import OptimConfig, UpdateConfig
from hflax.controller.workers import (ActorRolloutWorker, CriticWorker, FunctionRewardWorker,
                                      ReferenceWorker, RewardModelWorker)
from hflax.launch.config import generation_cap_problem
from hflax.models import ModelConfig, create, hf
from hflax.models.lora import (add_adapters, load_adapter, lora_config, lora_targets,
                               read_adapter_config, split_adapters)
from hflax.rollout import SamplingParams
from hflax.sharding.layouts import data_parallel_size
from hflax.sharding.placement import build_placement, colocated, standalone


def uses_reference(cfg) -> bool:
  return bool(cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward)


def reference_in_actor(cfg) -> bool:
  """With LoRA the actor serves the reference log-probs from its frozen base weights (verl's
  ref_in_actor), so no reference role, pool or weight copy exists."""
  return uses_reference(cfg) and cfg.model.lora_rank > 0


def role_reasons(cfg) -> dict[str, str]:
  """The roles this config runs, each with the setting that calls for it."""
  roles = {"actor": "every algorithm"}
  if uses_reference(cfg) and not reference_in_actor(cfg):
    roles["ref"] = "actor.use_kl_loss or algorithm.use_kl_in_reward"
  if cfg.algorithm.name in NEEDS_CRITIC:
    roles["critic"] = f"algorithm.name={cfg.algorithm.name!r}"
  if cfg.reward.kind == "model":
    roles["reward"] = "reward.kind='model'"
  if cfg.algorithm.name == "safe_rlhf" and cfg.cost.kind == "model":
    roles["cost"] = "cost.kind='model'"
  return roles


def needed_roles(cfg) -> list[str]:
  return list(role_reasons(cfg))


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


def read_model_configs(cfg, driver_only: bool = False) -> ModelConfig | None:
  """Reads the model config of every checkpoint directory the config names (no weights),
  each error naming its field; returns the policy's (None: the built-in model).
  driver_only: the policy's alone, as Ray workers read the value models' on their hosts."""
  reasons = {} if driver_only else role_reasons(cfg)
  fields = [("model.path", cfg.model.path),
            ("critic.model_path", cfg.critic.model_path if "critic" in reasons else ""),
            ("reward.model_path", cfg.reward.model_path if "reward" in reasons else ""),
            ("cost.model_path", cfg.cost.model_path if "cost" in reasons else "")]
  read = {}
  for field, path in fields:
    if path:
      try:
        read[field] = hf.read_config(path)
      except (OSError, ValueError) as e:
        raise ValueError(f"config.{field}: {e}") from None
  if cfg.model.lora_adapter_path:
    check_adapter(cfg)
  return read.get("model.path")


def check_adapter(cfg) -> None:
  """model.lora_adapter_path holds adapters of the rank, alpha and targets configured."""
  m = cfg.model
  try:
    found = read_adapter_config(m.lora_adapter_path)
  except (OSError, ValueError) as e:
    raise ValueError(f"config.model.lora_adapter_path: {e}") from None
  wanted = {"rank": m.lora_rank, "alpha": float(m.lora_alpha),
            "targets": set(lora_targets(m.target_modules))}
  found["targets"] = set(found["targets"])
  if found != wanted:
    raise ValueError(
        f"config.model.lora_adapter_path: {m.lora_adapter_path} has r={found['rank']}, "
        f"lora_alpha={found['alpha']:g}, target_modules {sorted(found['targets'])}; set "
        f"model.lora_rank={found['rank']} model.lora_alpha={found['alpha']:g} "
        f"model.target_modules={','.join(sorted(found['targets']))}")


def placement_spec(cfg, roles: list[str], devices: int, policy_cfg=None, device_list=None) -> dict:
  kind, tensor = cfg.placement.kind, cfg.rollout.generate_tensor
  if kind == "auto":  # the auto-mapper's best plan on a profile measured here (cached)
    from hflax.launch.plan import ranked_plans
    return ranked_plans(cfg, policy_cfg, device_list, top=1)[0].to_config()
  if kind == "colocated":
    spec = colocated(roles, devices, tensor)
  elif kind == "standalone":
    if devices % len(roles):
      raise ValueError(f"config.placement: 'standalone' needs the {devices} devices to divide "
                       f"among the {len(roles)} roles {roles}")
    spec = standalone(roles, devices // len(roles), tensor)
  else:
    spec = {"pools": cfg.placement.pools.to_dict(), "roles": cfg.placement.roles.to_dict()}
    if reference_in_actor(cfg) and spec["roles"].pop("ref", None):
      # The actor serves the reference: a pool that only the reference used would idle.
      used = {r.get("pool") for r in spec["roles"].values()}
      spec["pools"] = {p: n for p, n in spec["pools"].items() if p in used}
    actor = spec["roles"].get("actor")
    if actor is None or "generate_tensor" in actor:
      return spec
    actor["generate_tensor"] = tensor  # the actor generates with rollout.generate_tensor
  pool = spec["pools"].get(spec["roles"].get("actor", {}).get("pool"))
  if pool and int(pool) % tensor:  # named here: the placement's own check names its copy
    raise ValueError(f"config.rollout.generate_tensor: {tensor} does not divide the actor's "
                     f"pool of {pool} devices")
  return spec


def policy_model(cfg, vocab_size: int, tokenizer=None):
  """(model config, graphdef, state) of the initial policy: a checkpoint or the built-in."""
  if cfg.model.path:
    return hf.load_checkpoint(cfg.model.path, param_dtype=cfg.model.param_dtype,
                              dtype=cfg.model.dtype, remat=cfg.model.remat)
  model_cfg = builtin_config(cfg, vocab_size, tokenizer)
  return (model_cfg, *create(model_cfg, seed=cfg.trainer.seed))


def builtin_config(cfg, vocab_size: int, tokenizer=None) -> ModelConfig:
  """The shape of config.model.builtin (no parameters are built)."""
  b = cfg.model.builtin
  return ModelConfig(
      vocab_size=vocab_size, hidden_size=b.hidden_size, intermediate_size=b.intermediate_size,
      num_layers=b.num_layers, num_heads=b.num_heads, num_kv_heads=b.num_kv_heads,
      rope_theta=b.rope_theta, tie_word_embeddings=True, dtype=cfg.model.dtype,
      param_dtype=cfg.model.param_dtype, remat=cfg.model.remat,
      eos_token_id=tuple(tokenizer.eos_ids) if tokenizer else None,
      pad_token_id=tokenizer.pad_id if tokenizer else None)


def with_lora(model_cfg: ModelConfig, section) -> ModelConfig:
  """model_cfg with the adapters a config section (model, critic) asks for, if any."""
  s = section
  return lora_config(model_cfg, s.lora_rank, s.lora_alpha, s.target_modules) if s.lora_rank \
      else model_cfg


def actor_config(cfg, model_cfg: ModelConfig) -> ModelConfig:
  """The policy's model config as the actor trains it: with LoRA adapters if asked."""
  return with_lora(model_cfg, cfg.model)


def _value_model(path: str, policy, seed: int, lora=None):
  """A value-head model: from a checkpoint, else the policy's backbone with a fresh head;
  `lora` (a config section with lora_rank > 0) adds adapters to it."""
  if path:
    model_cfg, graphdef, state = hf.load_checkpoint(path, head="value", seed=seed)
  else:
    model_cfg, _, policy_state = policy
    graphdef, state = create(model_cfg, seed=seed, head="value")
    for key in policy_state:
      if key in state and key != "lm_head":
        state[key] = policy_state[key]
  if lora is not None and lora.lora_rank:
    graphdef, state = add_adapters(with_lora(model_cfg, lora), state, seed, head="value")
  return graphdef, state


def _update(section, n: int) -> UpdateConfig:
  rows = section.ppo_mini_batch_size * n
  return UpdateConfig(mini_batch_size=rows, micro_batch_size=section.ppo_micro_batch_size or rows,
                      epochs=section.ppo_epochs, shuffle=section.shuffle)


def check_micro_batches(cfg, placed, wanted, n: int):
  """Before any parameters move: a micro-batch needs a row on every data-parallel device
  (batches the data width does not divide are padded, but a micro-batch of fewer rows
  than devices would be mostly padding)."""
  for role in ("actor", "critic"):
    if role not in wanted or role not in placed:
      continue
    micro = _update(getattr(cfg, role), n).micro_batch_size
    dp = data_parallel_size(placed[role].mesh)
    if micro < dp:
      raise ValueError(f"config.{role}.ppo_micro_batch_size: {micro} rows per micro-batch are "
                       f"fewer than the {role}'s data-parallel size {dp}; use at least {dp} "
                       "(or a mesh with a narrower data axis)")


def build_roles(cfg, policy, *, tokenizer, reward_fn: Callable | None = None,
                cost_fn: Callable | None = None, devices=None, spec: dict | None = None,
                only: tuple[str, ...] | None = None) -> Roles:
  """policy: (model config, graphdef, state) the actor and reference start from.

  A remote backend builds one pool's share: `spec` places just that pool's roles on
  `devices` (the pool's global devices) and `only` names the roles to build there.
  """
  devices = list(devices if devices is not None else jax.devices())
  roles = needed_roles(cfg)
  placed = build_placement(spec or placement_spec(cfg, roles, len(devices), policy[0], devices),
                           devices)
  wanted = [r for r in roles if only is None or r in only]
  check_placed(cfg, placed, wanted)
  n, seed = cfg.rollout.n, cfg.trainer.seed
  home = jax.sharding.SingleDeviceSharding(placed[wanted[0] if wanted else "actor"].pool.devices[0])
  model_cfg, graphdef, state = policy
  actor_graphdef, actor_state = graphdef, state
  if cfg.model.lora_rank and "actor" in wanted:
    lora_cfg = actor_config(cfg, model_cfg)
    actor_graphdef, actor_state = add_adapters(lora_cfg, state, seed)
    if cfg.model.lora_adapter_path:
      actor_state = nnx.merge_state(split_adapters(actor_state)[1],
                                    load_adapter(cfg.model.lora_adapter_path, lora_cfg))
  sampling = SamplingParams(
      max_new_tokens=cfg.data.max_response_length, temperature=cfg.rollout.temperature,
      top_k=cfg.rollout.top_k, top_p=cfg.rollout.top_p, n=n, eos_ids=tuple(tokenizer.eos_ids),
      pad_id=tokenizer.pad_id)
  out = Roles(actor=ActorRolloutWorker(
      placed["actor"], actor_graphdef, actor_state, sampling=sampling, loss_fn=actor_loss(cfg.actor),
      loss_fields=("ref_log_prob",) if cfg.actor.use_kl_loss else (),
      generate_dtype=cfg.rollout.dtype, recompute_log_prob=cfg.actor.recompute_log_prob,
      optimizer_offload=cfg.actor.optimizer_offload, max_num_seqs=cfg.rollout.max_num_seqs,
      optim=OptimConfig(**cfg.actor.optim), update=_update(cfg.actor, n), home=home, seed=seed)
      if "actor" in wanted else None)
  if reference_in_actor(cfg):
    out.ref = out.actor
  if "ref" in wanted:
    out.ref = ReferenceWorker(placed["ref"], graphdef, state, home=home,
                              temperature=cfg.rollout.temperature or 1.0)
  if "critic" in wanted:
    out.critic = CriticWorker(placed["critic"], *_value_model(cfg.critic.model_path, policy,
                                                              seed + 1, lora=cfg.critic),
                              loss_fn=critic_loss(cfg.critic), optim=OptimConfig(**cfg.critic.optim),
                              update=_update(cfg.critic, n), home=home, seed=seed)
  for role, section, fn, output in (("reward", cfg.reward, reward_fn, "token_level_scores"),
                                    ("cost", cfg.cost, cost_fn, "token_level_costs")):
    if role == "cost" and cfg.algorithm.name != "safe_rlhf" or only is not None and role not in only:
      continue
    if section.kind == "model":
      worker = RewardModelWorker(placed[role], *_value_model(section.model_path, policy, seed),
                                 output=output, home=home)
    else:
      if fn is None:
        raise ValueError(f"config.{role}: kind='rule' needs a {role} function")
      worker = FunctionRewardWorker(fn, home=home, output=output)
    setattr(out, role, worker)
  return out
