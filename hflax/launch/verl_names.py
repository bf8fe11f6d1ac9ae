"""verl's config names, accepted next to hflax's: a verl command line ports by changing its
entry point.

  python -m hflax.launch --config grpo.py data.train_files=[a.parquet,b.parquet] \
      actor_rollout_ref.actor.optim.lr=1e-6 trainer.total_training_steps=5

Both `name=value` (hydra's spelling) and `--config.name=value` work, with either name.
A verl name is mapped to hflax's field (VERL_NAMES, listed in the README); a value that
differs in kind is translated (trainer.resume_mode, trainer.logger).
"""
from __future__ import annotations

_ARR = "actor_rollout_ref."
_ACTOR_FIELDS = ("ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_epochs", "shuffle",
                 "clip_ratio", "clip_ratio_low", "clip_ratio_high", "clip_ratio_c",
                 "loss_agg_mode", "entropy_coeff", "use_kl_loss", "kl_loss_coef", "kl_loss_type",
                 "tau_pos", "tau_neg", "optim.lr", "optim.weight_decay")
_CRITIC_FIELDS = ("ppo_mini_batch_size", "ppo_micro_batch_size", "ppo_epochs", "shuffle",
                  "cliprange_value", "loss_agg_mode", "optim.lr", "optim.weight_decay")
_ROLLOUT_FIELDS = ("n", "temperature", "top_k", "top_p", "max_num_seqs")

VERL_NAMES = {
    # trainer
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.save_freq": "trainer.save_every",
    "trainer.test_freq": "trainer.val_every",
    "trainer.default_local_dir": "trainer.run_dir",
    "trainer.max_actor_ckpt_to_keep": "trainer.keep",
    "trainer.n_gpus_per_node": "trainer.devices",
    "trainer.logger": "trainer.log",
    "trainer.resume_mode": "trainer.resume",
    # the policy, its rollout and reference
    **{f"{_ARR}actor.{f}": f"actor.{f}" for f in _ACTOR_FIELDS},
    f"{_ARR}actor.optim.lr_warmup_steps": "actor.optim.warmup_steps",
    f"{_ARR}actor.optim.total_training_steps": "actor.optim.total_steps",
    f"{_ARR}actor.grad_clip": "actor.optim.grad_clip",
    f"{_ARR}actor.policy_loss.loss_mode": "actor.policy_loss",
    f"{_ARR}actor.optimizer_offload": "actor.optimizer_offload",
    **{f"{_ARR}rollout.{f}": f"rollout.{f}" for f in _ROLLOUT_FIELDS},
    **{f"{_ARR}rollout.val_kwargs.{f}": f"rollout.val_{f}"
       for f in ("n", "temperature", "top_k", "top_p")},
    f"{_ARR}rollout.tensor_model_parallel_size": "rollout.generate_tensor",
    **{f"{_ARR}rollout.multi_turn.{f}": f"rollout.multi_turn.{f}" for f in (
        "enable", "max_assistant_turns", "max_tool_response_length", "tool_config_path",
        "format")},
    f"{_ARR}rollout.dtype": "rollout.dtype",
    f"{_ARR}rollout.response_length": "data.max_response_length",
    f"{_ARR}rollout.prompt_length": "data.max_prompt_length",
    f"{_ARR}model.path": "model.path",
    f"{_ARR}model.lora_rank": "model.lora_rank",
    f"{_ARR}model.lora_alpha": "model.lora_alpha",
    f"{_ARR}model.target_modules": "model.target_modules",
    f"{_ARR}model.enable_gradient_checkpointing": "model.remat",
    # packed passes and token-budget micro-batches (one switch for every model's passes)
    f"{_ARR}model.use_remove_padding": "model.use_remove_padding",
    "critic.model.use_remove_padding": "model.use_remove_padding",
    f"{_ARR}actor.use_dynamic_bsz": "actor.use_dynamic_bsz",
    f"{_ARR}actor.ppo_max_token_len_per_gpu": "actor.ppo_max_token_len_per_gpu",
    f"{_ARR}ref.log_prob_max_token_len_per_gpu": "actor.log_prob_max_token_len_per_gpu",
    f"{_ARR}rollout.log_prob_max_token_len_per_gpu": "actor.log_prob_max_token_len_per_gpu",
    "critic.use_dynamic_bsz": "critic.use_dynamic_bsz",
    "critic.ppo_max_token_len_per_gpu": "critic.ppo_max_token_len_per_gpu",
    # critic, reward model, custom reward
    **{f"critic.{f}": f"critic.{f}" for f in _CRITIC_FIELDS},
    "critic.grad_clip": "critic.optim.grad_clip",
    "critic.optim.lr_warmup_steps": "critic.optim.warmup_steps",
    "critic.model.path": "critic.model_path",
    "reward_model.model.path": "reward.model_path",
    "custom_reward_function.path": "reward.custom_fn.path",
    "custom_reward_function.name": "reward.custom_fn.name",
}
# Same name in both: accepted as they are (listed so the README's table is complete).
SAME_NAMES = ("data.train_files", "data.val_files", "data.train_batch_size",
              "data.val_batch_size", "data.max_prompt_length", "data.max_response_length",
              "data.prompt_key", "data.filter_overlong_prompts", "data.shuffle", "data.seed",
              "algorithm.adv_estimator", "algorithm.gamma", "algorithm.lam",
              "algorithm.norm_adv_by_std_in_grpo", "algorithm.use_kl_in_reward",
              "algorithm.kl_penalty", "algorithm.kl_ctrl.kl_coef", "trainer.critic_warmup",
              "trainer.val_before_train", "trainer.project_name", "trainer.experiment_name",
              "trainer.rollout_data_dir", "trainer.validation_data_dir",
              "trainer.log_val_generations")
# verl settings that do not apply to hflax: accepted and ignored, with a reason.
IGNORED = {
    "trainer.nnodes": "hflax counts devices in trainer.devices (or the placement's pools)",
    "trainer.device": "JAX picks the platform",
    f"{_ARR}rollout.name": "hflax generates with its own JAX sampler",
    f"{_ARR}rollout.gpu_memory_utilization": "the sampler sizes its KV cache per wave",
    f"{_ARR}actor.ppo_micro_batch_size_per_gpu": "set actor.ppo_micro_batch_size (rows)",
    f"{_ARR}ref.log_prob_micro_batch_size_per_gpu": "forward passes take whole batches",
    f"{_ARR}rollout.log_prob_micro_batch_size_per_gpu": "forward passes take whole batches",
    "critic.ppo_micro_batch_size_per_gpu": "set critic.ppo_micro_batch_size (rows)",
    f"{_ARR}actor.fsdp_config.param_offload": "placement and meshes are hflax's",
    f"{_ARR}actor.fsdp_config.optimizer_offload": "see actor.optimizer_offload",
    f"{_ARR}ref.fsdp_config.param_offload": "placement and meshes are hflax's",
}


def _translate_value(name: str, value: str) -> str:
  """A verl value where hflax's field takes another kind (by the verl name given)."""
  if name == "trainer.resume_mode":
    modes = {"auto": "True", "disable": "False"}
    if value not in modes:
      raise ValueError(f"trainer.resume_mode: {value!r} is not one of {sorted(modes)} "
                       "(resume_path is not supported: use trainer.run_dir)")
    return modes[value]
  if name == "trainer.logger" and value.startswith("["):  # ['console','wandb'] -> a tuple
    names = [v.strip().strip("'\"") for v in value.strip("[]").split(",") if v.strip()]
    return "(" + ",".join(repr(n) for n in names) + ("," if len(names) == 1 else "") + ")"
  return value


def translate_overrides(argv: list[str], log=None) -> list[str]:
  """argv with every `name=value` and `--config.name=value` given hflax's field name."""
  out = []
  for arg in argv:
    hydra = "=" in arg and not arg.startswith("-") and "." in arg.split("=", 1)[0]
    flag = arg.startswith("--config.") and "=" in arg
    if not (hydra or flag):
      out.append(arg)
      continue
    name, value = arg.split("=", 1)
    name = name.removeprefix("--config.").lstrip("+")  # hydra's +key=value adds a key
    if name in IGNORED:
      if log is not None:
        log(f"{name}: ignored ({IGNORED[name]})")
      continue
    if name not in VERL_NAMES and name.split(".")[0] in _verl_only_roots():
      raise ValueError(_unknown_verl_name(name))
    field = VERL_NAMES.get(name, name)
    out.append(f"--config.{field}={_translate_value(name, value)}")
  return out


def _verl_only_roots() -> set[str]:
  """First parts of verl names that no hflax field starts with (actor_rollout_ref, ...):
  a name under one is verl's, so hflax's own did-you-mean cannot help."""
  hflax_roots = {n.split(".")[0] for n in (*VERL_NAMES.values(), *SAME_NAMES)}
  return {k.split(".")[0] for k in (*VERL_NAMES, *IGNORED)} - hflax_roots


def _unknown_verl_name(name: str) -> str:
  import difflib
  close = difflib.get_close_matches(name, [*VERL_NAMES, *IGNORED], n=1, cutoff=0.75)
  hint = ""
  if close:
    known = close[0]
    hint = (f"; did you mean {known}" + (f" (hflax's {VERL_NAMES[known]})" if known in VERL_NAMES
                                         else f" (ignored: {IGNORED[known]})") + "?")
  return (f"{name}: not a verl name hflax knows{hint} (the README's table lists verl's names "
          "and hflax's)")
