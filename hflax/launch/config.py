"""The configuration tree every config file starts from, and its validation.

Field names follow verl's where one exists (train_batch_size, ppo_mini_batch_size,
rollout.n, clip_ratio, kl_loss_coef, critic_warmup, ...). Batch sizes count prompts;
the actor and critic see `n` rows per prompt.
"""
from __future__ import annotations

import importlib.util
import os

import ml_collections
from ml_collections import config_dict

from hflax.algorithms import LOSS_AGG_MODES, advantage_estimator_names, policy_loss_names
from hflax.algorithms.correction import correction_problem
from hflax.algorithms.drivers import algorithm_names, get_algorithm
from hflax.launch.ranges import check_numbers
from hflax.models.lora import lora_targets
from hflax.platforms.compile_cache import default_compile_cache_dir
from hflax.sharding.automap.profile import PRESETS

FLOAT_DTYPES = ("float32", "bfloat16", "float16")


def _optim(lr: float) -> dict:
  return dict(lr=lr, weight_decay=0.0, b1=0.9, b2=0.999, grad_clip=1.0, warmup_steps=0,
              schedule="constant", total_steps=0, min_lr_ratio=0.0)


def base_config() -> ml_collections.ConfigDict:
  c = ml_collections.ConfigDict()
  c.algorithm = dict(
      name="ppo", adv_estimator="gae", gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=True,
      use_kl_in_reward=False, kl_penalty="kl",
      kl_ctrl=dict(type="fixed", kl_coef=0.001, target_kl=0.1, horizon=10000),
      max_num_gen_batches=8, overlong_buffer_len=0, overlong_penalty_factor=1.0,
      # lambda_max: lambda multiplies its own log-step, so a cost held above the limit grows
      # it faster than exponentially (to inf within ~25 steps at these defaults).
      cost_limit=0.0, lambda_lr=0.05, lambda_init=1.0, lambda_max=100.0,
      # verl's rollout correction (hflax.algorithms.correction, docs/async.md): rollout_is
      # None | "token" | "sequence" (truncated IS, capped at rollout_is_threshold);
      # rollout_rs None | "token" | "sequence" | "geometric" (masked IS / IcePop: out of
      # the loss where the ratio leaves [rollout_rs_threshold_lower (None: 1 / upper),
      # rollout_rs_threshold]).
      rollout_correction=dict(
          rollout_is=config_dict.placeholder(str), rollout_is_threshold=2.0,
          rollout_rs=config_dict.placeholder(str), rollout_rs_threshold=2.0,
          rollout_rs_threshold_lower=config_dict.placeholder(float)))
  c.data = dict(
      train_files="builtin:arithmetic", val_files="builtin:arithmetic",
      train_batch_size=16, val_batch_size=64, max_prompt_length=48, max_response_length=8,
      truncate_prompts=False, filter_overlong_prompts=False, shuffle=True, seed=0,
      # train_files / val_files: a file, a directory (its .parquet/.jsonl/.json files), or
      # several as "[a.parquet,b.parquet]" or "a.parquet,b.parquet" (verl's list form).
      # prompt_key: the column holding the chat messages (verl's data.prompt_key).
      prompt_key="prompt",
      # Switches of the tokenizer's chat template (verl's apply_chat_template_kwargs), set
      # in a config file: c.data.chat_template_kwargs = {"enable_thinking": False}.
      chat_template_kwargs={},
      # data_source "arithmetic_chat": the chat form for pretrained instruct models ("...?
      # Answer with just the number.", judged by the last integer); template "": its own.
      builtin=dict(num_train=7000, num_val=500, digits=(2, 2), ops="+",
                   data_source="arithmetic", template=""))
  c.model = dict(
      # tokenizer: "byte", or an HF tokenizer directory; "" is model.path's, or "byte" for
      # the built-in model. dtype: compute (e.g. "bfloat16" with float32 master weights in
      # param_dtype).
      path="", tokenizer="", dtype="float32", param_dtype="float32", remat=False,
      # use_remove_padding (verl's name): training and log-prob passes on packed rows (the
      # valid tokens of several sequences per row, segment ids keeping them apart), equal
      # to the padded passes; the shipped configs turn it on. attention: "auto" (dense up
      # to 512 keys, then blockwise, linear in memory; cuDNN on GPU, splash on TPU),
      # "reference", "blockwise", "cudnn" or "splash". share_prompts: packed passes lay a
      # prompt that several rows of a micro-batch repeat (GRPO's n samples) once, its
      # responses attending to it (the same results, fewer tokens).
      use_remove_padding=False, attention="auto", share_prompts=True,
      # moe_dispatch: how a mixture of experts' sparse layers compute their experts:
      # "dense" (every expert on every token; the default: jax lowers the grouped matmul
      # on CPU to k times dense's FLOPs), "sorted" (tokens grouped by expert for
      # jax.lax.ragged_dot's grouped matmul) or "all_to_all" (expert parallelism: each
      # pick sent to its expert's device over the placement mesh's expert axis and back;
      # docs/models.md). moe_capacity_factor: all_to_all's rows a device sends another, as
      # a multiple of a balanced share (0: all its picks, none dropped).
      moe_dispatch="dense", moe_capacity_factor=0.0,
      # LoRA (verl's names): lora_rank 0 trains every weight; > 0 trains rank-r adapters
      # on target_modules ("all-linear", or HF names such as "q_proj,v_proj") and nothing
      # else, and the reference policy is the frozen base (no copy of its own).
      # lora_adapter_path: a PEFT adapter directory to start the adapters from (its r,
      # lora_alpha and target_modules must be the three above).
      lora_rank=0, lora_alpha=16.0, target_modules="all-linear", lora_adapter_path="",
      builtin=dict(hidden_size=64, intermediate_size=192, num_layers=2, num_heads=4,
                   num_kv_heads=2, rope_theta=10000.0))
  c.actor = dict(
      optim=_optim(1e-5), ppo_mini_batch_size=8, ppo_micro_batch_size=0, ppo_epochs=1,
      shuffle=False, policy_loss="vanilla", clip_ratio=0.2,
      clip_ratio_low=config_dict.placeholder(float), clip_ratio_high=config_dict.placeholder(float),
      clip_ratio_c=3.0, loss_agg_mode="token-mean", entropy_coeff=0.0, use_kl_loss=False,
      kl_loss_coef=0.001, kl_loss_type="low_var_kl", recompute_log_prob=False,
      # SAPO's gate temperatures for positive and negative advantages (verl's names).
      tau_pos=1.0, tau_neg=1.05,
      # Optimizer state in host memory from generation until the next update (verl's
      # optimizer_offload, for the KV cache's sake on accelerators).
      optimizer_offload=False,
      # Mixture-of-experts models: the rollout records each token's experts and the
      # actor's log-prob and update forwards replay them (rollout routing replay, R3);
      # padded passes only (use_remove_padding false), waves (no continuous batching).
      router_replay=False,
      # Mixture-of-experts models: the load-balancing (Switch) loss's weight in the actor's
      # loss. 0 by default, as transformers adds router_aux_loss_coef x aux only when
      # output_router_logits is set (Qwen3-MoE's configs leave it off) and verl's FSDP
      # actor trains without it; the aux loss and experts' load are logged either way.
      moe_aux_loss_coef=0.0,
      # Token-budget micro-batches (verl's use_dynamic_bsz): packed micro-batches of at most
      # ppo_max_token_len_per_gpu tokens per device (log_prob_max_token_len_per_gpu for
      # the log-prob passes) instead of ppo_micro_batch_size rows; needs use_remove_padding.
      use_dynamic_bsz=False, ppo_max_token_len_per_gpu=16384,
      log_prob_max_token_len_per_gpu=16384)
  # val_*: how held-out prompts are sampled (verl's rollout.val_kwargs); val_n > 1 adds
  # best@k, worst@k and maj@N to the validation metrics. max_num_seqs (as vLLM's): at most
  # this many sequences per generation replica at once, the rest in further waves (0: all).
  # continuous_batching: max_num_seqs decode slots per replica instead of waves, a finished
  # sequence's slot taken by the next waiting one (same tokens and log-probs as waves).
  # multi_turn (verl's rollout.multi_turn): each sample a trajectory of model turns and
  # tool messages (hflax.rollout.agents), data.max_response_length tokens after its prompt.
  c.rollout = dict(n=1, temperature=1.0, top_k=0, top_p=1.0, generate_tensor=1,
                   dtype=config_dict.placeholder(str), val_n=1, val_temperature=0.0,
                   val_top_k=0, val_top_p=1.0, max_num_seqs=0, continuous_batching=False,
                   multi_turn=dict(enable=False, max_assistant_turns=4,
                                   max_tool_response_length=256, max_turn_tokens=0,
                                   tool_config_path="", format="hermes",
                                   tool_timeout_s=30.0, rewrite_history=False))
  c.critic = dict(optim=_optim(1e-4), ppo_mini_batch_size=8, ppo_micro_batch_size=0,
                  ppo_epochs=1, shuffle=False, cliprange_value=0.5,
                  loss_agg_mode="token-mean", model_path="",
                  # LoRA for the critic (as model.lora_*): adapters and the value head train.
                  lora_rank=0, lora_alpha=16.0, target_modules="all-linear",
                  use_dynamic_bsz=False, ppo_max_token_len_per_gpu=16384)
  # custom_fn: a Python file and a function in it (name "" is verl's default,
  # compute_score), run in a worker process (hflax.sandbox); timeout_s: the most seconds
  # one batch's scoring may take, then the worker is killed (0: no limit);
  # memory_limit_gb: the worker's address-space limit, so a reward that allocates without
  # bound fails with MemoryError instead of taking the host's memory (0: no limit).
  c.reward = dict(kind="rule", model_path="", custom_fn=dict(path="", name=""), timeout_s=600.0,
                  memory_limit_gb=16.0)
  c.cost = dict(kind="rule", model_path="", custom_fn=dict(path="", name=""), timeout_s=600.0,
                memory_limit_gb=16.0)
  # On-policy distillation (hflax.algorithms.distill, docs/distillation.md): a teacher
  # checkpoint (an HF directory, a LoRA-merged export or a .gguf file; the student's
  # vocabulary) scores the student's samples, and each response token's advantage is
  # coef * (teacher log-prob - student log-prob) + task_reward_coef * the algorithm's own
  # advantage (0: distillation alone). teacher_path "" turns it off. The teacher runs on
  # placement role "teacher" (custom placements without one: the reference's place).
  c.distill = dict(teacher_path="", coef=1.0, task_reward_coef=0.0)
  # kind: "colocated" (every role on all devices), "standalone" (a pool per role), "auto"
  # (the auto-mapper's best plan, meshes and generation width t_g included: it overrides
  # rollout.generate_tensor) or "custom" (pools and roles as in hflax.sharding.placement).
  # With trainer.mode one_step_off or async, "auto" also weighs a rollout pool of its own
  # against generating on the training devices (hflax.sharding.automap.split). profile:
  # what "auto" plans with, "calibrate" (measured on the devices here, cached) or a preset.
  c.placement = dict(kind="colocated", pools={}, roles={}, profile="calibrate")
  c.trainer = dict(
      total_steps=20, critic_warmup=0, seed=0, run_dir="runs/default", resume=True,
      save_every=10, keep=2, val_every=10, val_before_train=True,
      # wandb_project turns wandb on; verl's project_name names the project only when log
      # has "wandb". experiment_name: the run's name (default: run_dir's last part).
      # WANDB_MODE=offline keeps the run local.
      log=("console", "jsonl", "tensorboard"), wandb_project="", project_name="",
      experiment_name="",
      profile_steps=(),
      stage_timing=True, export_hf=True, devices=0, val_only=False,
      # export_gguf: also write the actor (LoRA merged) as run_dir/gguf_actor/model.gguf,
      # F32, for llama.cpp and ollama (hflax.models.gguf_export).
      export_gguf=False,
      # verl's: each step's samples (text, score, advantage) as {dir}/{step}.jsonl.
      rollout_data_dir="", validation_data_dir="",
      # verl's: this many validation samples (the same prompts each time) to the console,
      # run_dir/val_generations.jsonl, TensorBoard's text tab and a wandb table.
      log_val_generations=0,
      sft_warmup=dict(steps=0, lr=1e-3, batch_size=64, cache_dir="", target_loss=0.0),
      # mode: "sync" (a step trains on the batch it generated), "one_step_off" (step
      # k + 1's batch is generated while step k trains; hflax.launch.modes) or "async"
      # (requests stream through a rollout engine while the trainer trains, partial
      # rollouts; hflax.launch.async_mode). docs/async.md.
      # max_staleness: the most weight versions a trained token lags; one_step_off takes
      # 1, or 0 (the next batch generated after the update: sync's schedule); async any
      # integer >= 0 (0: sync's schedule). async_decode_steps: async's decode steps per
      # busy request between a step's take and its weight sync (while the update runs).
      mode="sync", max_staleness=1, async_decode_steps=16,
      # JAX's persistent compilation cache: a rerun or resume reads its compiled programs
      # back (hflax.platforms.compile_cache.use_compile_cache). "" turns it off; a
      # directory JAX already has (JAX_COMPILATION_CACHE_DIR) wins.
      compile_cache_dir=default_compile_cache_dir())
  # Where the roles run: "local" (this process's devices) or "ray" (each placement pool is
  # a group of Ray actor processes forming one jax.distributed job; see
  # hflax/controller/ray_backend). A pool of S devices runs on processes_per_pool
  # processes of devices_per_process devices each (set either; 0 derives it from the
  # other, both 0: one process per pool).
  c.cluster = dict(
      backend="local", address="", processes_per_pool=0, devices_per_process=0,
      platform="cpu", cpus_per_process=0.0, gpus_per_process=0.0, strategy="",
      max_restarts=0, require_loopback=False, temp_dir="", init_timeout_s=120,
      # Ray's own defaults: worker logs on the driver, the dashboard as Ray decides (None).
      # require_loopback=True is this project's test setting: a private local cluster on
      # 127.0.0.1, started only inside a loopback-only network namespace (netless).
      log_to_driver=True, include_dashboard=config_dict.placeholder(bool),
      # On a Ray session the caller started (ray.init in a notebook, a test fixture), a
      # closed run's healthy worker processes wait for the next run of the same layout.
      reuse_workers=True)
  return c


def _get(c, field):
  for key in field.split("."):
    c = c[key]
  return c


def _check_int(c, field, least, fail, note=""):
  value = _get(c, field)
  if not isinstance(value, int) or isinstance(value, bool) or value < least:
    fail(field, f"must be an integer >= {least}{' ' + note if note else ''}, got {value!r}")


def _check_choices(c, fail):
  """Names and ranges that are otherwise only read deep inside a step."""
  from hflax.algorithms import KL_KINDS
  from hflax.controller.training import SCHEDULES
  from hflax.data.arithmetic import TEMPLATES
  from hflax.metrics.logger import BACKENDS
  from hflax.models.config import ATTENTION_IMPLEMENTATIONS, MOE_DISPATCHES
  choices = {"model.attention": ATTENTION_IMPLEMENTATIONS, "model.moe_dispatch": MOE_DISPATCHES,
             "algorithm.kl_ctrl.type": ("fixed", "adaptive"),
             "algorithm.kl_penalty": KL_KINDS, "actor.kl_loss_type": KL_KINDS,
             "actor.optim.schedule": SCHEDULES, "critic.optim.schedule": SCHEDULES,
             "data.builtin.data_source": tuple(TEMPLATES)}
  for field, valid in choices.items():
    if _get(c, field) not in valid:
      fail(field, f"{_get(c, field)!r} is not one of {tuple(valid)}")
  log = c.trainer.log
  names = (log,) if isinstance(log, str) else tuple(log)
  unknown = [b for b in names if b not in BACKENDS]
  if unknown:
    fail("trainer.log", f"unknown metrics backends {unknown}; choose from {BACKENDS}")
  if "wandb" in names and not wandb_project(c):
    fail("trainer.wandb_project", "trainer.log has 'wandb', which needs a project name "
         "(trainer.wandb_project, or verl's trainer.project_name)")
  if wandb_project(c) and not importlib.util.find_spec("wandb"):
    fail("trainer.wandb_project", "logging to wandb needs the wandb package "
         "(pip install 'hflax[wandb]')")
  if c.trainer.export_gguf and not importlib.util.find_spec("gguf"):
    fail("trainer.export_gguf", "writing a .gguf file needs the gguf package "
         "(pip install 'hflax[gguf]')")
  for field in ("model.dtype", "model.param_dtype", "rollout.dtype"):
    name = _get(c, field)
    if name is not None and name not in FLOAT_DTYPES:
      fail(field, f"{name!r} is not one of {FLOAT_DTYPES}")
  for prefix in ("", "val_"):
    top_p = c.rollout[f"{prefix}top_p"]
    if not 0 < top_p <= 1:
      fail(f"rollout.{prefix}top_p", f"must be in (0, 1], got {top_p!r}")
    _check_int(c, f"rollout.{prefix}top_k", 0, fail, "(0: no top-k filter)")
  _check_int(c, "rollout.val_n", 1, fail, "(samples per held-out prompt)")
  _check_int(c, "rollout.max_num_seqs", 0, fail, "(0: no cap)")
  if not isinstance(c.model.get("share_prompts", True), bool):
    fail("model.share_prompts", f"must be True or False, got {c.model.share_prompts!r}")
  _check_multi_turn(c, fail)
  if not isinstance(c.rollout.get("continuous_batching", False), bool):
    fail("rollout.continuous_batching", f"must be True or False, got "
         f"{c.rollout.continuous_batching!r}")
  _check_router_replay(c, fail)
  problem = generation_cap_problem(c, c.rollout.max_num_seqs)
  if problem:
    fail("rollout.max_num_seqs", problem)
  if c.rollout.val_n > 1 and c.rollout.val_temperature == 0:
    fail("rollout.val_n", f"{c.rollout.val_n} samples per prompt with rollout.val_temperature=0 "
         "(greedy) are copies of one response; set val_temperature > 0 (e.g. 1.0)")
  for role in ("actor", "critic"):
    o = c[role].optim
    if o.schedule == "cosine" and o.total_steps <= o.warmup_steps:
      fail(f"{role}.optim.total_steps", f"a cosine schedule needs total_steps > warmup_steps="
           f"{o.warmup_steps}, got {o.total_steps}")


def _check_batches(c, fail, with_critic: bool) -> None:
  """Counts are positive integers, and mini- and micro-batches divide what they cut."""
  positive = ["data.train_batch_size", "data.val_batch_size", "data.max_prompt_length",
              "data.max_response_length", "rollout.n", "trainer.total_steps",
              "trainer.save_every"]
  if c.trainer.keep is not None:  # None keeps every checkpoint
    positive.append("trainer.keep")
  for role in ("actor", "critic") if with_critic else ("actor",):
    positive += [f"{role}.ppo_mini_batch_size", f"{role}.ppo_epochs"]
    _check_int(c, f"{role}.ppo_micro_batch_size", 0, fail, "(0: the whole mini-batch)")
  for field in positive:
    _check_int(c, field, 1, fail)
  _check_int(c, "trainer.devices", 0, fail, "(0: every local device)")
  _check_int(c, "trainer.log_val_generations", 0, fail, "(validation samples to log; 0: none)")
  for which, count in (("train_files", "num_train"), ("val_files", "num_val")):
    if c.data[which] == "builtin:arithmetic":
      _check_int(c, f"data.builtin.{count}", 1, fail, f"(data.{which} is builtin:arithmetic)")
  _check_choices(c, fail)
  for role in ("actor", "critic") if with_critic else ("actor",):
    mini = c[role].ppo_mini_batch_size
    if c.data.train_batch_size % mini:
      fail(f"{role}.ppo_mini_batch_size", f"{mini} does not divide data.train_batch_size="
           f"{c.data.train_batch_size} (both count prompts)")
    micro = c[role].ppo_micro_batch_size
    if micro and (mini * c.rollout.n) % micro:
      fail(f"{role}.ppo_micro_batch_size", f"{micro} rows do not divide the mini-batch of "
           f"{mini} prompts x rollout.n={c.rollout.n} = {mini * c.rollout.n} rows")


def _check_settings(c, fail) -> None:
  """The warm-up, sampling, discounting and clipping settings."""
  sft = c.trainer.sft_warmup
  if not isinstance(sft.steps, int) or sft.steps < 0:
    fail("trainer.sft_warmup.steps", f"must be an integer >= 0 (0 = no warm-up), got {sft.steps!r}")
  if not sft.target_loss >= 0:
    fail("trainer.sft_warmup.target_loss", f"must be >= 0 (0 = run all steps), got "
         f"{sft.target_loss!r}")
  if sft.steps:
    _check_int(c, "trainer.sft_warmup.batch_size", 1, fail, "(rows per warm-up step)")
  for field in ("rollout.temperature", "rollout.val_temperature"):
    if not 0 <= _get(c, field):
      fail(field, f"must be >= 0 (0: greedy), got {_get(c, field)!r}")
  if c.trainer.val_every is not None:  # None, like 0: no validation during training
    _check_int(c, "trainer.val_every", 0, fail, "(0: no validation during training)")
  _check_int(c, "rollout.generate_tensor", 1, fail, "(the actor's tensor width in generation)")
  _check_int(c, "trainer.critic_warmup", 0, fail, "(steps that train only the critic)")
  for field in ("algorithm.gamma", "algorithm.lam"):
    if not 0 <= _get(c, field) <= 1:
      fail(field, f"must be in [0, 1], got {_get(c, field)!r}")
  for field in ("actor.clip_ratio", "actor.clip_ratio_low", "actor.clip_ratio_high",
                "critic.cliprange_value"):
    value = _get(c, field)
    if value is not None and not value > 0:
      fail(field, f"must be > 0, got {value!r}")
  if c.actor.clip_ratio_c is not None and not c.actor.clip_ratio_c > 1:
    fail("actor.clip_ratio_c", f"dual-clip's bound must be > 1, got {c.actor.clip_ratio_c!r}")


# Losses defined per sequence: only averaging each sequence's tokens, then the sequences,
# gives their papers' objective.
SEQUENCE_LOSSES = {"gspo": "GSPO", "gmpo": "GMPO", "geo_mean": "GMPO"}


def _check_policy_loss(c, fail) -> None:
  """The chosen policy loss's own parameters (tau_pos / tau_neg > 0 are in ranges)."""
  a = c.actor
  if a.policy_loss in SEQUENCE_LOSSES and a.loss_agg_mode != "seq-mean-token-mean":
    fail("actor.loss_agg_mode", f"{a.loss_agg_mode!r} with policy_loss={a.policy_loss!r}: "
         f"{SEQUENCE_LOSSES[a.policy_loss]}'s objective averages each sequence's tokens, then "
         "the sequences; set 'seq-mean-token-mean' (as the paper and verl do)")
  if a.policy_loss == "cispo" and a.clip_ratio_low is not None and not a.clip_ratio_low <= 1:
    fail("actor.clip_ratio_low", f"CISPO clips its weight below at 1 - clip_ratio_low, so "
         f"more than 1 means nothing (1: no lower bound, as the paper), got {a.clip_ratio_low!r}")


def _check_mode(c, fail, algorithm) -> None:
  """trainer.mode and its staleness bound."""
  from hflax.launch.modes import MODES
  t = c.trainer
  if t.get("mode", "sync") not in MODES:
    fail("trainer.mode", f"{t.mode!r} is not one of {MODES}")
  _check_int(c, "trainer.max_staleness", 0, fail, "(weight versions a sample may lag)")
  if t.mode == "async":
    _check_int(c, "trainer.async_decode_steps", 0, fail, "(decode steps per update)")
    if algorithm.takes_prompt_iterator:
      fail("trainer.mode", f"async trains one batch of groups per step; "
           f"{algorithm.name} draws as many as it needs within a step")
  if t.mode == "one_step_off":
    if t.max_staleness > 1:
      fail("trainer.max_staleness", f"one_step_off lags 1 version (0: sync's schedule), "
           f"got {t.max_staleness}")
    if algorithm.takes_prompt_iterator:
      fail("trainer.mode", f"one_step_off pre-generates one batch per step; "
           f"{algorithm.name} draws as many as it needs within a step")


def _check_directories(c, fail) -> None:
  """Directories the run writes: none may be an existing file (found before any work)."""
  t = c.trainer
  for field, path in (("trainer.run_dir", t.run_dir), ("trainer.rollout_data_dir",
                                                       t.rollout_data_dir),
                      ("trainer.validation_data_dir", t.validation_data_dir),
                      ("trainer.sft_warmup.cache_dir", t.sft_warmup.cache_dir),
                      ("trainer.compile_cache_dir", t.compile_cache_dir)):
    if not path:
      continue
    path = os.path.expanduser(path)
    if os.path.exists(path) and not os.path.isdir(path):
      fail(field, f"{path!r} is a file; the run writes a directory there")
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
      parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
      fail(field, f"{path!r} lies under {parent!r}, which is a file")


def _check_models_and_rewards(c, fail) -> None:
  """LoRA, prompt length handling, reward and cost sources, placement kinds."""
  for section in ("model", "critic"):
    _check_int(c, f"{section}.lora_rank", 0, fail, "(0: no LoRA, every weight is trained)")
    if c[section].lora_rank:
      if not c[section].lora_alpha > 0:
        fail(f"{section}.lora_alpha", f"must be > 0, got {c[section].lora_alpha!r}")
      try:
        lora_targets(c[section].target_modules)
      except ValueError as e:
        fail(f"{section}.target_modules", str(e))
  if c.model.lora_adapter_path and not c.model.lora_rank:
    fail("model.lora_rank", "model.lora_adapter_path is set: set lora_rank (and lora_alpha, "
         "target_modules) to the adapter's r (lora_alpha, target_modules)")
  if c.data.truncate_prompts and c.data.filter_overlong_prompts:
    fail("data.filter_overlong_prompts", "and data.truncate_prompts both say what to do with a "
         "prompt longer than data.max_prompt_length (leave it out, or keep its last tokens): "
         "choose one")
  if c.reward.kind not in ("rule", "model"):
    fail("reward.kind", f"{c.reward.kind!r} is not 'rule' or 'model'")
  if c.reward.kind == "model" and not c.reward.model_path:
    fail("reward.model_path", "reward.kind='model' needs a checkpoint directory")
  for section in ("reward", "cost"):
    if c[section].custom_fn.name and not c[section].custom_fn.path:
      fail(f"{section}.custom_fn.path", f"custom_fn.name={c[section].custom_fn.name!r} needs "
           "the Python file that defines it")
    if not c[section].timeout_s >= 0:
      fail(f"{section}.timeout_s", f"must be >= 0 (0: no limit), got {c[section].timeout_s!r}")
    limit = c[section].memory_limit_gb
    if not (isinstance(limit, (int, float)) and not isinstance(limit, bool)
            and (limit == 0 or 0.5 <= limit < 1e6)):
      fail(f"{section}.memory_limit_gb", "must be 0 (no limit) or a number of GB >= 0.5 (a "
           f"worker process needs that much address space to start), got {limit!r}")
  kinds = ("colocated", "standalone", "auto", "custom")
  if c.placement.kind not in kinds:
    fail("placement.kind", f"{c.placement.kind!r} is not one of {kinds}")
  profiles = ("calibrate",) + tuple(sorted(PRESETS))
  if c.placement.get("profile", "calibrate") not in profiles:
    fail("placement.profile", f"{c.placement.profile!r} is not one of {profiles}")
  if c.placement.kind == "custom" and not (c.placement.pools and c.placement.roles):
    fail("placement", "kind='custom' needs placement.pools and placement.roles")


# The drivers that call the teacher (hflax.algorithms.drivers.grpo's step).
DISTILL_ALGORITHMS = ("grpo", "rloo", "reinforce_pp")


def _check_distill(c, fail, algorithm) -> None:
  """distill: its algorithm and weights; the teacher's vocabulary is checked
  once the checkpoint's config is read (hflax.launch.models.check_teacher)."""
  d = c.get("distill")
  if d is None or not d.teacher_path:
    return
  if algorithm.name not in DISTILL_ALGORITHMS:
    fail("distill.teacher_path", f"on-policy distillation runs with algorithm.name in "
         f"{DISTILL_ALGORITHMS}, not {algorithm.name!r}")
  if not d.coef and not d.task_reward_coef:
    fail("distill.coef", "and distill.task_reward_coef are both 0: no advantage is left")


def wandb_project(c) -> str:
  """The wandb project of a run ("" for none): trainer.wandb_project turns wandb on by
  itself; verl's trainer.project_name names the project when trainer.log has 'wandb'."""
  log = c.trainer.log
  names = (log,) if isinstance(log, str) else tuple(log)
  return c.trainer.wandb_project or (c.trainer.project_name if "wandb" in names else "")


def generation_cap_problem(c, cap) -> str | None:
  """Why a max_num_seqs (the config's or a placement's) cannot hold one prompt's samples."""
  samples = max(c.rollout.n, c.rollout.val_n)
  if c.rollout.get("continuous_batching", False):
    return None  # a decode slot holds one sample, not a prompt's n
  if isinstance(cap, int) and 0 < cap < samples:
    return (f"{cap} is less than the {samples} samples of one prompt (rollout.n / val_n), "
            "which are generated together")
  return None


def _check_router_replay(c, fail) -> None:
  """Routing replay's routes are recorded by the wave sampler and read by padded passes."""
  replay = c.actor.get("router_replay", False)
  if not isinstance(replay, bool):
    fail("actor.router_replay", f"must be True or False, got {replay!r}")
  conflicts = [("model.use_remove_padding", c.model.use_remove_padding),
               ("rollout.continuous_batching", c.rollout.get("continuous_batching", False)),
               ("rollout.multi_turn.enable", c.rollout.multi_turn.enable)]
  for field, on in conflicts if replay else ():
    if on:
      fail("actor.router_replay", f"replaying routes does not work with {field}=True yet; "
           "turn one of them off")


# Advantage estimators that give a sequence one advantage (segments share their trajectory's).
SEGMENT_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus_baseline")


def _check_multi_turn(c, fail) -> None:
  m = c.rollout.multi_turn
  if not isinstance(m.enable, bool):
    fail("rollout.multi_turn.enable", f"must be True or False, got {m.enable!r}")
  _check_int(c, "rollout.multi_turn.max_assistant_turns", 1, fail, "(model turns a trajectory)")
  _check_int(c, "rollout.multi_turn.max_tool_response_length", 1, fail,
             "(tokens the messages after a turn may add)")
  _check_int(c, "rollout.multi_turn.max_turn_tokens", 0, fail,
             "(tokens one model turn samples; 0: as many as data.max_response_length leaves)")
  if not (isinstance(m.tool_timeout_s, (int, float)) and m.tool_timeout_s > 0):
    fail("rollout.multi_turn.tool_timeout_s", f"must be > 0 seconds, got {m.tool_timeout_s!r}")
  if not isinstance(m.rewrite_history, bool):
    fail("rollout.multi_turn.rewrite_history", f"must be True or False, got {m.rewrite_history!r}")
  if m.enable and m.rewrite_history and c.algorithm.adv_estimator not in SEGMENT_ESTIMATORS:
    fail("rollout.multi_turn.rewrite_history", "segments train with one advantage a "
         f"trajectory: algorithm.adv_estimator must be one of {SEGMENT_ESTIMATORS}, got "
         f"{c.algorithm.adv_estimator!r}")
  if m.enable and m.rewrite_history and c.algorithm.name == "dapo":
    fail("rollout.multi_turn.rewrite_history", "DAPO's dynamic sampling keeps rows by "
         "group, which would split a trajectory's segments; use algorithm.name=grpo")
  from hflax.rollout.agents.tools import PARSERS
  if m.format not in PARSERS:
    fail("rollout.multi_turn.format", f"must be one of {sorted(PARSERS)}, got {m.format!r}")
  if m.enable and m.tool_config_path:
    from hflax.rollout.agents.tool_config import load_tools
    from hflax.sandbox.class_tool import close_tools
    try:  # a user's tool class is imported and built in a worker process, not here
      close_tools(load_tools(m.tool_config_path, timeout_s=float(m.tool_timeout_s)))
    except ValueError as e:
      fail("rollout.multi_turn.tool_config_path", str(e))


def tokenizer_spec(c) -> str:
  """What load_tokenizer gets: model.tokenizer, else the checkpoint's, else "byte"."""
  return c.model.tokenizer or c.model.path or "byte"


def validate(c) -> None:
  """Raises ValueError naming the field and what would be valid; touches no device."""

  def fail(field, why):
    raise ValueError(f"config.{field}: {why}")

  check_numbers(c, fail)  # every float finite, numeric fields in range (hflax.launch.ranges)
  if c.algorithm.name not in algorithm_names():
    fail("algorithm.name", f"{c.algorithm.name!r} is not one of {tuple(algorithm_names())}")
  algorithm = get_algorithm(c.algorithm.name)
  if c.algorithm.adv_estimator not in advantage_estimator_names():
    fail("algorithm.adv_estimator", f"{c.algorithm.adv_estimator!r} is not one of "
         f"{advantage_estimator_names()}")
  if c.actor.policy_loss not in policy_loss_names():
    fail("actor.policy_loss", f"{c.actor.policy_loss!r} is not one of {policy_loss_names()}")
  _check_policy_loss(c, fail)
  _check_mode(c, fail, algorithm)
  problem = correction_problem(c.algorithm.get("rollout_correction", {}))
  if problem:
    fail(f"algorithm.rollout_correction.{problem[0]}", problem[1])
  for role in ("actor", "critic"):
    if c[role].loss_agg_mode not in LOSS_AGG_MODES:
      fail(f"{role}.loss_agg_mode", f"{c[role].loss_agg_mode!r} is not one of {LOSS_AGG_MODES}")
  with_critic = algorithm.uses_critic
  if not 0 < c.algorithm.lambda_init <= c.algorithm.lambda_max:
    fail("algorithm.lambda_max", f"need 0 < lambda_init={c.algorithm.lambda_init} <= "
         f"lambda_max={c.algorithm.lambda_max}")
  _check_batches(c, fail, with_critic)
  if algorithm.check is not None:
    algorithm.check(c, fail)
  if c.algorithm.adv_estimator == "gae" and not algorithm.uses_critic:
    fail("algorithm.adv_estimator", f"'gae' needs a critic, which {c.algorithm.name} has not")
  _check_settings(c, fail)
  _check_models_and_rewards(c, fail)
  _check_distill(c, fail, algorithm)
  _check_directories(c, fail)
  if "cluster" in c:
    from hflax.launch.cluster import validate_cluster
    validate_cluster(c, fail, _check_int)
