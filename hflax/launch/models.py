"""What a config asks for before any placement: the roles its algorithm needs (and why),
and the models they start from (checkpoints, the built-in model, LoRA adapters)."""
from __future__ import annotations

from hflax.algorithms.drivers import get_algorithm
from hflax.controller import build
from hflax.controller.plan import LoraPlan
from hflax.launch.atomic_export import refuse_incomplete
from hflax.models import ModelConfig, create, hf
from hflax.models.config import lora_target_problem
from hflax.models.lora import lora_config, lora_targets, read_adapter_config


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
  algorithm = get_algorithm(cfg.algorithm.name)
  if algorithm.uses_critic:
    roles["critic"] = f"algorithm.name={cfg.algorithm.name!r}"
  if cfg.reward.kind == "model":
    roles["reward"] = "reward.kind='model'"
  if algorithm.uses_cost and cfg.cost.kind == "model":
    roles["cost"] = "cost.kind='model'"
  if teacher_path(cfg):
    roles["teacher"] = "distill.teacher_path"
  return roles


def teacher_path(cfg) -> str:
  """On-policy distillation's teacher checkpoint ("": none)."""
  return cfg.distill.teacher_path if "distill" in cfg else ""


def read_teacher_config(cfg) -> ModelConfig:
  """The teacher checkpoint's model config (a file read, no weights), errors naming
  distill.teacher_path."""
  path = teacher_path(cfg)
  try:
    refuse_incomplete(path)
    return hf.read_config(path)
  except (OSError, ValueError) as e:
    raise ValueError(f"config.distill.teacher_path: {e}") from None


def teacher_config(cfg, student_cfg: ModelConfig) -> ModelConfig:
  """The teacher's shape as it runs: its checkpoint's, in the student's dtypes and
  attention (hflax.controller.build.teacher_model loads it so)."""
  return read_teacher_config(cfg).replace(param_dtype=student_cfg.param_dtype,
                                          dtype=student_cfg.dtype,
                                          attention=student_cfg.attention)


def check_teacher(cfg, student_vocab: int) -> None:
  """Before any device work: the teacher's checkpoint reads, and embeds the student's
  vocabulary (distillation compares log-probs of the same token ids)."""
  from hflax.algorithms.distill import check_distill_vocab
  if not teacher_path(cfg):
    return
  teacher = read_teacher_config(cfg)
  problem = check_distill_vocab(teacher.vocab_size, student_vocab)
  if problem:
    raise ValueError(f"config.distill.teacher_path: {teacher_path(cfg)}: {problem}")


def needed_roles(cfg) -> list[str]:
  return list(role_reasons(cfg))


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
        refuse_incomplete(path)
        read[field] = hf.read_config(path)
      except (OSError, ValueError) as e:
        raise ValueError(f"config.{field}: {e}") from None
  policy = read.get("model.path")
  coef = cfg.actor.get("moe_aux_loss_coef", 0.0)
  if coef and not (policy is not None and policy.num_sparse_layers):
    raise ValueError(f"config.actor.moe_aux_loss_coef: {coef} weighs a mixture of experts' "
                     "load-balancing loss, but the policy has no sparse layers; set it to 0")
  for section, model in (("model", policy), ("critic", read.get("critic.model_path", policy))):
    if section in ("model", *reasons) and cfg[section].lora_rank:
      problem = lora_target_problem(lora_targets(cfg[section].target_modules), model)
      if problem:
        raise ValueError(f"config.{section}.target_modules: {problem}")
  if cfg.model.lora_adapter_path:
    check_adapter(cfg, policy)
  return policy


def check_adapter(cfg, policy: ModelConfig | None = None) -> None:
  """model.lora_adapter_path holds adapters of the rank, alpha and targets configured
  (the targets as the policy reads them: "all-linear" covers a shared expert gate)."""
  m = cfg.model
  try:
    found = read_adapter_config(m.lora_adapter_path)
  except (OSError, ValueError) as e:
    raise ValueError(f"config.model.lora_adapter_path: {e}") from None
  wanted = {"rank": m.lora_rank, "alpha": float(m.lora_alpha),
            "targets": set(lora_config(policy, m.lora_rank, m.lora_alpha, m.target_modules)
                           .lora_targets if policy is not None else
                           lora_targets(m.target_modules))}
  found["targets"] = set(found["targets"])
  if found != wanted:
    raise ValueError(
        f"config.model.lora_adapter_path: {m.lora_adapter_path} has r={found['rank']}, "
        f"lora_alpha={found['alpha']:g}, target_modules {sorted(found['targets'])}; set "
        f"model.lora_rank={found['rank']} model.lora_alpha={found['alpha']:g} "
        f"model.target_modules={','.join(sorted(found['targets']))}")


def policy_model(cfg, vocab_size: int, tokenizer=None):
  """(model config, graphdef, state) of the initial policy: a checkpoint or the built-in."""
  if cfg.model.path:
    try:
      return hf.load_checkpoint(cfg.model.path, param_dtype=cfg.model.param_dtype,
                                dtype=cfg.model.dtype, remat=cfg.model.remat,
                                attention=cfg.model.get("attention", "auto"),
                                moe_dispatch=cfg.model.get("moe_dispatch", "dense"),
                                moe_capacity_factor=cfg.model.get("moe_capacity_factor", 0.0))
    except (OSError, ValueError) as e:
      raise ValueError(f"config.model.path: {e}") from None
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
      attention=cfg.model.get("attention", "auto"),
      eos_token_id=tuple(tokenizer.eos_ids) if tokenizer else None,
      pad_token_id=tokenizer.pad_id if tokenizer else None)


def lora_plan(section) -> LoraPlan | None:
  """The adapters a config section (model, critic) asks for; None: no LoRA."""
  if not section.lora_rank:
    return None
  return LoraPlan(rank=section.lora_rank, alpha=float(section.lora_alpha),
                  target_modules=section.target_modules,
                  adapter_path=section.get("lora_adapter_path", ""))


def with_lora(model_cfg: ModelConfig, section) -> ModelConfig:
  """model_cfg with the adapters a config section (model, critic) asks for, if any."""
  return build.with_lora(model_cfg, lora_plan(section))


def actor_config(cfg, model_cfg: ModelConfig) -> ModelConfig:
  """The policy's model config as the actor trains it: with LoRA adapters if asked."""
  return with_lora(model_cfg, cfg.model)


def remove_padding(model) -> bool:
  return bool(model is not None and model.get("use_remove_padding", False))


def token_budgets(section) -> tuple[int, int]:
  """(update, forward pass) tokens per device with use_dynamic_bsz, else (0, 0). The
  critic's forward passes take its update's budget (verl's forward_max_token_len_per_gpu
  defaults to it)."""
  if not section.get("use_dynamic_bsz", False):
    return 0, 0
  budget = int(section.get("ppo_max_token_len_per_gpu", 0))
  return budget, int(section.get("log_prob_max_token_len_per_gpu", budget))
