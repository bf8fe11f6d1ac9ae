"""The config reference (docs/config.md), generated from the config tree.

  python -m hflax.launch.config_reference > docs/config.md

Every leaf of `hflax.launch.config.base_config()` is listed with its default, the check
`validate` holds it to and the verl names that set it (`hflax.launch.verl_names`). The
check is not copied from the code by hand: each field is given a value that is out of
range or not a valid name (-1, 0, 2 for numbers, an unknown name for strings) and the
one-line error `validate` answers for that field is kept, less its "got ..." part. So
the reference says what the run will refuse, and changes when the checks change
(tests/test_config_reference.py compares it with the committed file).

Checks that only apply in some settings (LoRA's fields when lora_rank > 0, the cost
model's for safe_rlhf, ...) are found by probing under those settings too.
"""
from __future__ import annotations

import os
import re
import sys

# Settings under which a field's check is active (field -> overrides applied first).
_CONTEXT = {
    "model.lora_alpha": {"model.lora_rank": 8},
    "model.target_modules": {"model.lora_rank": 8},
    "critic.lora_alpha": {"critic.lora_rank": 8},
    "critic.target_modules": {"critic.lora_rank": 8},
    "trainer.sft_warmup.batch_size": {"trainer.sft_warmup.steps": 10},
    "cost.timeout_s": {"algorithm.name": "safe_rlhf"},
    "cost.memory_limit_gb": {"algorithm.name": "safe_rlhf"},
}
# Fields whose check depends on the machine (an installed package, a file), not the tree.
_NOT_PROBED = {"trainer.wandb_project", "trainer.project_name", "trainer.export_gguf"}
_BOGUS = "no-such-name"

# What each field means, in a few words (shown beside its check; a field without an entry
# shows none, so a new field renders before it is described).
MEANINGS = {
    "algorithm.name": "the driver: the RL loop and the roles it builds",
    "algorithm.adv_estimator": "how advantages are computed",
    "algorithm.gamma": "discount factor (GAE)",
    "algorithm.lam": "GAE's lambda",
    "algorithm.norm_adv_by_std_in_grpo": "GRPO divides by the group's std (False: Dr.GRPO)",
    "algorithm.use_kl_in_reward": "subtract a KL penalty from the reward",
    "algorithm.kl_penalty": "KL estimator of the reward penalty",
    "algorithm.kl_ctrl.type": "fixed or adaptive KL coefficient",
    "algorithm.kl_ctrl.kl_coef": "the KL coefficient (adaptive: its start)",
    "algorithm.kl_ctrl.target_kl": "adaptive control's target KL",
    "algorithm.kl_ctrl.horizon": "adaptive control's horizon, in samples",
    "algorithm.max_num_gen_batches": "DAPO: most generation rounds to fill a batch",
    "algorithm.overlong_buffer_len": "DAPO: tokens before the length limit where the penalty ramps",
    "algorithm.overlong_penalty_factor": "DAPO: the penalty at the length limit",
    "algorithm.cost_limit": "Safe-RLHF: the bound on the expected cost",
    "algorithm.lambda_lr": "Safe-RLHF: the Lagrange multiplier's step size",
    "algorithm.lambda_init": "Safe-RLHF: the multiplier's start",
    "algorithm.lambda_max": "Safe-RLHF: the multiplier's cap",
    "algorithm.rollout_correction.rollout_is": "truncated IS of stale rows, per token or sequence",
    "algorithm.rollout_correction.rollout_is_threshold": "truncated IS's cap on the weight",
    "algorithm.rollout_correction.rollout_rs": "masked IS (IcePop): drop rows/tokens off the bounds",
    "algorithm.rollout_correction.rollout_rs_threshold": "masked IS's upper bound on the ratio",
    "algorithm.rollout_correction.rollout_rs_threshold_lower": "masked IS's lower bound (None: 1 / upper)",
    "data.train_files": "training prompts: file(s) or directory, or builtin:arithmetic",
    "data.val_files": "held-out prompts, as train_files",
    "data.train_batch_size": "prompts per step",
    "data.val_batch_size": "prompts per validation batch",
    "data.max_prompt_length": "longest prompt, in tokens",
    "data.max_response_length": "most tokens generated per response",
    "data.truncate_prompts": "keep a long prompt's last tokens",
    "data.filter_overlong_prompts": "leave long prompts out (counted)",
    "data.shuffle": "shuffle the training prompts each epoch",
    "data.seed": "the data order's seed",
    "data.prompt_key": "the column holding the chat messages",
    "data.chat_template_kwargs": "switches for the chat template (set in a config file)",
    "data.builtin.num_train": "built-in task: training questions",
    "data.builtin.num_val": "built-in task: held-out questions",
    "data.builtin.digits": "built-in task: operand digits, or a (min, max) range",
    "data.builtin.ops": "built-in task: operators, any of +-*",
    "data.builtin.data_source": "built-in task: plain or chat form",
    "data.builtin.template": "built-in task: question template ('': the source's own)",
    "model.path": "the policy's checkpoint: HF directory, .gguf file or shipped name",
    "model.tokenizer": "tokenizer directory or 'byte' ('': the checkpoint's)",
    "model.dtype": "compute dtype",
    "model.param_dtype": "stored (master) weight dtype",
    "model.remat": "recompute layer activations in the backward pass",
    "model.moe_dispatch": "MoE: experts computed dense, sorted (grouped matmul) or all_to_all",
    "model.moe_capacity_factor": "MoE all_to_all: rows sent a device (0: every pick)",
    "model.use_remove_padding": "packed training and log-prob passes",
    "model.attention": "attention implementation",
    "model.share_prompts": "packed passes compute a repeated prompt once",
    "model.lora_rank": "LoRA rank (0: train every weight)",
    "model.lora_alpha": "LoRA scale numerator (alpha / rank)",
    "model.target_modules": "layers LoRA adapts",
    "model.lora_adapter_path": "a PEFT adapter to start the adapters from",
    "model.builtin.hidden_size": "built-in model: hidden width",
    "model.builtin.intermediate_size": "built-in model: MLP width",
    "model.builtin.num_layers": "built-in model: layers",
    "model.builtin.num_heads": "built-in model: attention heads",
    "model.builtin.num_kv_heads": "built-in model: key/value heads",
    "model.builtin.rope_theta": "built-in model: RoPE base",
    "rollout.n": "samples per prompt",
    "rollout.temperature": "sampling temperature (0: greedy)",
    "rollout.top_k": "top-k filter (0: off)",
    "rollout.top_p": "nucleus filter (1: off)",
    "rollout.generate_tensor": "the actor's tensor-parallel width when generating",
    "rollout.dtype": "dtype the actor generates in (None: the weights' own)",
    "rollout.val_n": "samples per held-out prompt",
    "rollout.val_temperature": "validation temperature (0: greedy)",
    "rollout.val_top_k": "validation top-k (0: off)",
    "rollout.val_top_p": "validation top-p (1: off)",
    "rollout.max_num_seqs": "most sequences a generation replica holds at once (0: all; "
                            "async: its decode slots, docs/async.md)",
    "rollout.continuous_batching": "decode slots refilled as sequences end, instead of waves",
    "rollout.multi_turn.enable": "each sample a multi-turn trajectory with tools (docs/agents.md)",
    "rollout.multi_turn.max_assistant_turns": "model turns a trajectory",
    "rollout.multi_turn.max_tool_response_length": "tokens the messages after a turn may add",
    "rollout.multi_turn.tool_config_path": "a verl-format tool file (empty: built-in tools)",
    "rollout.multi_turn.max_turn_tokens": "tokens one model turn samples (0: the response's)",
    "rollout.multi_turn.format": "how tool calls are written: hermes (<tool_call>{json})",
    "rollout.multi_turn.tool_timeout_s": "a tool call's time limit, in seconds",
    "rollout.multi_turn.rewrite_history": "re-render each turn's history; a rewrite: segments",
    "trainer.total_steps": "RL steps",
    "trainer.critic_warmup": "first steps that train only the critic",
    "trainer.seed": "the run's seed",
    "trainer.run_dir": "checkpoints, metrics and exports go here",
    "trainer.resume": "resume from run_dir's latest checkpoint",
    "trainer.save_every": "steps between checkpoints",
    "trainer.keep": "checkpoints kept (None: all)",
    "trainer.val_every": "steps between validations (0: none during training)",
    "trainer.val_before_train": "validate before the first step",
    "trainer.log": "metrics backends",
    "trainer.wandb_project": "wandb project (turns wandb on)",
    "trainer.project_name": "wandb project when log has 'wandb'",
    "trainer.experiment_name": "the run's name ('': run_dir's last part)",
    "trainer.profile_steps": "steps to trace with the JAX profiler",
    "trainer.stage_timing": "wait for each stage to time it (False: overlap roles)",
    "trainer.export_hf": "write the actor as an HF directory at the end",
    "trainer.export_gguf": "also write the actor as run_dir/gguf_actor/model.gguf (F32)",
    "trainer.devices": "devices to use (0: every local device)",
    "trainer.val_only": "validate the current policy and exit",
    "trainer.mode": "sync, one_step_off (next batch generated while this one trains) or "
                    "async (requests stream while the trainer trains, partial rollouts)",
    "trainer.max_staleness": "most weight versions a trained token lags (one_step_off: 0 or 1)",
    "trainer.async_decode_steps": "async: decode steps per request between a step's batch "
                                  "and its weight sync",
    "trainer.rollout_data_dir": "write each step's samples here",
    "trainer.validation_data_dir": "write each validation's samples here",
    "trainer.log_val_generations": "validation samples to log",
    "trainer.sft_warmup.steps": "supervised warm-up steps before RL (0: none)",
    "trainer.sft_warmup.lr": "warm-up learning rate",
    "trainer.sft_warmup.batch_size": "warm-up rows per step",
    "trainer.sft_warmup.cache_dir": "where warmed-up policies are cached ('': the default)",
    "trainer.sft_warmup.target_loss": "stop the warm-up at this loss (0: run every step)",
    "trainer.compile_cache_dir": "JAX's persistent compilation cache ('': off)",
    "placement.kind": "which devices each role uses",
    "placement.profile": "auto: the device profile it plans with (calibrate: measured "
                         "here, cached)",
    "placement.pools": "custom: pool name -> device count",
    "placement.roles": "custom: role -> pool, mesh and generation width; role rollout: "
                       "the actor's generation on a pool of its own",
    "reward.kind": "rule (by data_source or custom_fn) or model",
    "reward.model_path": "the reward model's checkpoint",
    "reward.custom_fn.path": "a Python file with the reward function",
    "reward.custom_fn.name": "its name ('': compute_score)",
    "reward.timeout_s": "most seconds one batch's scoring may take; a custom_fn's worker "
                      "process is then killed (0: no limit)",
    "reward.memory_limit_gb": "a custom_fn's worker process's address-space limit: "
                            "beyond it the function raises MemoryError (0: no limit)",
    "cost.kind": "Safe-RLHF's cost: rule or model",
    "cost.model_path": "the cost model's checkpoint",
    "cost.custom_fn.path": "a Python file with the cost function",
    "cost.custom_fn.name": "its name",
    "cost.timeout_s": "most seconds one batch's scoring may take; a custom_fn's worker "
                      "process is then killed (0: no limit)",
    "cost.memory_limit_gb": "a custom_fn's worker process's address-space limit: "
                            "beyond it the function raises MemoryError (0: no limit)",
    "distill.teacher_path": "on-policy distillation's teacher: an HF directory, a LoRA-merged "
                            "export or a .gguf file with the student's vocabulary ('': off)",
    "distill.coef": "weight of the per-token advantage teacher log-prob - student log-prob",
    "distill.task_reward_coef": "weight of the algorithm's own (task reward) advantage added "
                                "to it (0: distillation alone)",
    "cluster.backend": "local (this process) or ray",
    "cluster.address": "a Ray cluster to join ('': start a local one)",
    "cluster.processes_per_pool": "processes per placement pool (0: derived)",
    "cluster.devices_per_process": "devices per process (0: derived)",
    "cluster.platform": "the workers' JAX platform",
    "cluster.cpus_per_process": "CPUs Ray reserves per process",
    "cluster.gpus_per_process": "GPUs Ray reserves per process",
    "cluster.strategy": "Ray placement-group strategy ('': none)",
    "cluster.max_restarts": "restarts after a worker dies (0: stop)",
    "cluster.require_loopback": "private loopback-only cluster (the tests' setting)",
    "cluster.reuse_workers": "keep a closed run's healthy workers for the next run of "
                             "the same layout (on a Ray session the caller started)",
    "cluster.temp_dir": "Ray's temp directory ('': Ray's default)",
    "cluster.init_timeout_s": "most seconds for the processes to start and connect",
    "cluster.log_to_driver": "forward worker logs to this process",
    "cluster.include_dashboard": "start Ray's dashboard (None: Ray decides)",
}
for _role in ("actor", "critic"):
  MEANINGS.update({
      f"{_role}.optim.lr": "learning rate",
      f"{_role}.optim.weight_decay": "AdamW weight decay",
      f"{_role}.optim.b1": "Adam's b1",
      f"{_role}.optim.b2": "Adam's b2",
      f"{_role}.optim.grad_clip": "gradient norm clip (0: none)",
      f"{_role}.optim.warmup_steps": "learning-rate warm-up steps",
      f"{_role}.optim.schedule": "learning-rate schedule after the warm-up",
      f"{_role}.optim.total_steps": "the schedule's length (cosine)",
      f"{_role}.optim.min_lr_ratio": "cosine's floor, as a share of lr",
      f"{_role}.ppo_mini_batch_size": "prompts per optimizer step",
      f"{_role}.ppo_micro_batch_size": "rows per micro-batch (0: the whole mini-batch)",
      f"{_role}.ppo_epochs": "passes over each batch",
      f"{_role}.shuffle": "shuffle the rows before cutting mini-batches",
      f"{_role}.loss_agg_mode": "how token losses are averaged",
      f"{_role}.use_dynamic_bsz": "micro-batches by token budget (needs packed passes)",
      f"{_role}.ppo_max_token_len_per_gpu": "token budget per device of a micro-batch",
  })
MEANINGS.update({
    "actor.policy_loss": "policy loss",
    "actor.clip_ratio": "PPO clip range",
    "actor.clip_ratio_low": "lower clip range (None: clip_ratio)",
    "actor.clip_ratio_high": "upper clip range (None: clip_ratio)",
    "actor.clip_ratio_c": "dual-clip's bound",
    "actor.tau_pos": "SAPO's gate temperature, advantage > 0",
    "actor.tau_neg": "SAPO's gate temperature, advantage <= 0",
    "actor.entropy_coeff": "entropy bonus coefficient",
    "actor.use_kl_loss": "add a KL loss to the reference policy",
    "actor.kl_loss_coef": "its coefficient",
    "actor.kl_loss_type": "its estimator",
    "actor.recompute_log_prob": "always recompute old log-probs with a forward pass",
    "actor.optimizer_offload": "optimizer state in host memory between updates",
    "actor.router_replay": "MoE: replay the rollout's experts in training (R3)",
    "actor.moe_aux_loss_coef": "MoE: load-balancing loss weight in the actor's loss",
    "actor.log_prob_max_token_len_per_gpu": "token budget per device of a log-prob pass",
    "critic.cliprange_value": "value clip range",
    "critic.model_path": "the critic's checkpoint ('': the policy's)",
    "critic.lora_rank": "LoRA rank (0: train every weight)",
    "critic.lora_alpha": "LoRA scale numerator",
    "critic.target_modules": "layers LoRA adapts",
})

_INTRO = """\
# Config reference

Generated by `python -m hflax.launch.config_reference` from
`hflax.launch.config.base_config()`: do not edit by hand
(`tests/test_config_reference.py` fails when this file and the config tree disagree).

Every config file starts from this tree (`hflax/configs/*.py` change some defaults:
`python -m hflax.launch --config NAME --help` prints a file's values). Set a field on
the command line as `--config.section.field=value` or `section.field=value`, or under
its verl name in the last column.

**check** is what `validate` refuses before any device work, each with a one-line error
naming the field and exit status 2. Besides these:

- every float anywhere in the tree must be finite (NaN, inf and `1e400` are refused);
- `actor.ppo_mini_batch_size` (and the critic's) must divide `data.train_batch_size`,
  and `ppo_micro_batch_size` the mini-batch's rows (`ppo_mini_batch_size * rollout.n`);
- `rollout.max_num_seqs` must hold one prompt's samples (`rollout.n`, `val_n`) unless
  `rollout.continuous_batching` is on; `val_n > 1` needs `val_temperature > 0`;
- a cosine schedule needs `optim.total_steps > optim.warmup_steps`;
- `policy_loss="gspo"` and `"gmpo"` (`"geo_mean"`) need
  `loss_agg_mode="seq-mean-token-mean"`; `"cispo"` needs `clip_ratio_low <= 1`;
  `adv_estimator="gae"` needs an algorithm with a critic;
- `data.truncate_prompts` and `data.filter_overlong_prompts` exclude each other;
- `reward.kind="model"` needs `reward.model_path`; `custom_fn.name` needs `custom_fn.path`;
- `model.lora_adapter_path` needs `model.lora_rank`;
- the directories a run writes (`trainer.run_dir`, ...) must not be files;
- `trainer.log` with `"wandb"` needs a project name and the `wandb` package;
- with `cluster.backend="ray"`, `placement.kind` must not be `auto`, and `colocated` or
  `standalone` need `trainer.devices`.

Data files, model directories, reward files and placements are checked when the run
loads them, also before any device work.
"""

_SECTIONS = {
    "algorithm": "Which algorithm, its advantage estimator, KL control, DAPO's overlong "
                 "shaping and Safe-RLHF's Lagrange multiplier.",
    "data": "Prompt files (verl's schema) or the built-in arithmetic task, batch sizes "
            "(counting prompts) and lengths.",
    "model": "The policy's checkpoint, tokenizer, dtypes, attention, packing and LoRA; "
             "`builtin` sizes the tiny model used when `path` is empty.",
    "actor": "The policy's optimiser, mini- and micro-batches and loss.",
    "rollout": "Sampling for training (`n`, `temperature`, ...) and validation (`val_*`), "
               "the generation's tensor width and batching.",
    "critic": "PPO's value model: optimiser, batches, value clipping, LoRA.",
    "reward": "`rule` (by `data_source`, or `custom_fn`) or a learned `model`.",
    "cost": "Safe-RLHF's cost, as `reward`.",
    "distill": "On-policy distillation (docs/distillation.md): a teacher's per-token "
               "log-probs on the student's samples as the advantage.",
    "placement": "Where the roles run: `colocated`, `standalone`, `auto` or `custom`.",
    "trainer": "Steps, validation, checkpoints, logging, the supervised warm-up and the "
               "compilation cache.",
    "cluster": "The Ray backend (`backend=\"ray\"`): processes per pool, devices and "
               "resources per process, restarts.",
}


def _leaves(node, prefix=""):
  """(path, value) of every leaf; an empty mapping is a leaf."""
  for key, value in node.items():
    path = f"{prefix}{key}"
    if hasattr(value, "items") and len(value):
      yield from _leaves(value, path + ".")
    else:
      yield path, value


def _set(c, path, value):
  *parents, last = path.split(".")
  for key in parents:
    c = c[key]
  c[last] = value


def _probes(value):
  if isinstance(value, bool):
    return []
  if isinstance(value, int):
    return [-1, 0]
  if isinstance(value, float):
    return [-1.0, 0.0, 2.0]
  if isinstance(value, str):
    return [_BOGUS]
  if isinstance(value, tuple):
    if value and all(isinstance(v, str) for v in value):
      return [(_BOGUS,)]
    return [(-1,)]
  return []


def _probe_values(field, value, placeholder_type):
  if value is None:
    return {float: [-1.0, 0.0], str: [_BOGUS], bool: []}.get(placeholder_type, [])
  return _probes(value)


def _check_text(field: str, message: str) -> str:
  why = message.split(": ", 1)[1] if message.startswith(f"config.{field}: ") else message
  why = re.sub(r",? got .*$", "", why)
  why = re.sub(r";? unknown: \[.*?\]$", "", why)
  for bogus in (repr([_BOGUS]), repr((_BOGUS,)), repr(_BOGUS)):
    why = why.replace(bogus, "").strip()
  why = re.sub(r"^: ", "", why)
  why = re.sub(r"=-?[0-9.e+-]+\b", "", why)  # the probe's value after a field's name
  why = re.sub(r"^must be ", "", why)
  why = re.sub(r"^unknown metrics backends\s*;\s*choose from ", "one of ", why)
  why = re.sub(r"^is not one of ", "one of ", why)
  why = re.sub(r"^is not ", "", why)
  return why


def probe_check(field: str, value, placeholder_type=None) -> str:
  """What validate says when `field` gets a bad value ("" if nothing is refused)."""
  from hflax.launch.config import base_config, validate
  if field in _NOT_PROBED:
    return ""
  found = []
  for bad in _probe_values(field, value, placeholder_type):
    c = base_config()
    for other, setting in _CONTEXT.get(field, {}).items():
      _set(c, other, setting)
    try:
      _set(c, field, bad)
    except (TypeError, ValueError):
      continue
    try:
      validate(c)
    except ValueError as e:
      message = str(e)
      if message.startswith(f"config.{field}: "):
        text = _check_text(field, message)
        if text not in found:
          found.append(text)
  return "; ".join(found)


def _placeholder_type(c, path):
  *parents, last = path.split(".")
  for key in parents:
    c = c[key]
  field = c._fields.get(last)  # a placeholder keeps its type beside its None
  return getattr(field, "_field_type", None)


def _default(path: str, value) -> str:
  # The cache's default depends on the environment (where it lives moves with the
  # platform layer, so it is recomputed here rather than imported).
  cache = os.path.join(os.environ.get("XDG_CACHE_HOME") or "~/.cache", "hflax", "jax")
  if path == "trainer.compile_cache_dir" and value == cache:
    return "`$XDG_CACHE_HOME/hflax/jax`, else `~/.cache/hflax/jax`"
  if hasattr(value, "to_dict"):
    value = value.to_dict()
  return f"`{value!r}`"


def verl_names_by_field() -> dict[str, list[str]]:
  from hflax.launch.verl_names import SAME_NAMES, VERL_NAMES
  out: dict[str, list[str]] = {}
  for verl, field in VERL_NAMES.items():
    if verl != field:
      out.setdefault(field, []).append(verl)
  for field in SAME_NAMES:
    out.setdefault(field, []).insert(0, "(same name)")
  for field, names in VERL_NAMES.items():
    if names == field and field not in SAME_NAMES:
      out.setdefault(field, []).insert(0, "(same name)")
  return out


def _cell(text: str) -> str:
  return text.replace("|", "\\|").replace("\n", " ")


def render() -> str:
  from hflax.launch.config import base_config
  from hflax.launch.verl_names import IGNORED
  c = base_config()
  verl = verl_names_by_field()
  lines = [_INTRO]
  section = None
  for path, value in _leaves(c):
    top = path.split(".")[0]
    if top != section:
      section = top
      lines += ["", f"## `{top}`", "", _SECTIONS.get(top, ""), "",
                "| field | meaning | default | check | verl name |", "|---|---|---|---|---|"]
    ptype = _placeholder_type(c, path) if value is None else None
    default = _default(path, value) + (f" ({ptype.__name__})" if ptype else "")
    check = probe_check(path, value, ptype)
    names = ", ".join(n if n.startswith("(") else f"`{n}`" for n in verl.get(path, []))
    meaning = _cell(MEANINGS.get(path, ""))
    lines.append(f"| `{path}` | {meaning} | {_cell(default)} | {_cell(check) or '-'} | "
                 f"{_cell(names)} |")
  lines += ["", "## verl settings accepted and ignored", "",
            "These verl names are accepted on the command line and ignored, with a line "
            "saying why:", "", "| verl name | why |", "|---|---|"]
  lines += [f"| `{name}` | {_cell(why)} |" for name, why in IGNORED.items()]
  return "\n".join(lines) + "\n"


def main() -> None:
  sys.stdout.write(render())


if __name__ == "__main__":
  main()
