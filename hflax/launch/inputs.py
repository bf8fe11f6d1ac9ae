"""What a run reads before any model work: its datasets and prompt loaders, and the reward
and cost functions of rule rewards, each checked against the config."""
from __future__ import annotations

import os

from hflax.algorithms.drivers import get_algorithm
from hflax.controller.batch import Batch
from hflax.data import PromptLoader, arithmetic_task, load_prompts
from hflax.launch.config import tokenizer_spec
from hflax.rewards import RuleRewardScorer
from hflax.rewards.registry import check_rule_rows as check_rows
from hflax.sandbox.reward_calls import PooledRewardFn


def data_paths(spec: str) -> list[str]:
  """The files and directories a data.*_files value names: one path, or several as
  "[a.parquet,b.parquet]" (verl's list on a command line) or "a.parquet,b.parquet"."""
  text = spec.strip()
  if text.startswith("[") and text.endswith("]"):
    text = text[1:-1]
  return [os.path.expanduser(p.strip().strip("'\"")) for p in text.split(",") if p.strip()]


def learned_rewards_only(cfg) -> bool:
  """Every score comes from a reward (and cost) model: rows need no ground truth."""
  sections = [cfg.reward] + ([cfg.cost] if get_algorithm(cfg.algorithm.name).uses_cost else [])
  return all(s.kind == "model" and not s.custom_fn.path for s in sections)


def load_datasets(cfg):
  """(train, val) datasets: files in verl's schema, or "builtin:arithmetic"."""
  d = cfg.data
  builtin = None
  if "builtin:arithmetic" in (d.train_files, d.val_files):
    b = d.builtin
    builtin = arithmetic_task(b.num_train, b.num_val, seed=d.seed, digits=tuple(b.digits),
                              ops=b.ops, data_source=b.data_source, template=b.template)

  def load(spec, which):
    if spec == "builtin:arithmetic":
      return builtin[which]
    field = f"config.data.{'train' if which == 0 else 'val'}_files"
    paths = data_paths(spec)
    if not paths:
      raise ValueError(f"{field}: names no file")
    for path in paths:
      if not os.path.exists(path):
        raise FileNotFoundError(f"{field}: {path!r} does not exist")
    try:
      return load_prompts(paths if len(paths) > 1 else paths[0], prompt_key=d.prompt_key,
                          require_ground_truth=not learned_rewards_only(cfg))
    except FileNotFoundError:
      raise
    except (ValueError, KeyError, OSError) as e:
      why = e.args[0] if isinstance(e, KeyError) and e.args else e
      raise ValueError(f"{field}: {why}") from None
  return load(d.train_files, 0), load(d.val_files, 1)


def make_reward_fn(section, tokenizer, field: str = "reward"):
  """score_fn(host batch) -> [B] scores from a rule (per data source) or a user function
  (details=True: the scorer's whole output, answers included)."""
  custom = None
  name = section.custom_fn.name or "compute_score"  # verl's default name
  if section.custom_fn.path:
    where = f"config.{field}.custom_fn ({section.custom_fn.path})"
    try:
      # In a worker process: nothing the user's code does can end the trainer.
      custom = PooledRewardFn(section.custom_fn.path, name, timeout_s=section.timeout_s,
                              memory_limit_gb=section.memory_limit_gb, field=field)
    except (FileNotFoundError, ValueError) as e:
      raise ValueError(f"{where}: {e}") from None
  scorer = RuleRewardScorer(tokenizer, custom, timeout_s=section.timeout_s or None)

  def score(batch: Batch, details: bool = False):
    try:
      out = scorer(batch["responses"], list(batch["ground_truth"]), list(batch["data_source"]),
                   list(batch["extra_info"]), response_mask=batch["response_mask"])
      return out if details else out["scores"]
    except ValueError:
      raise
    except Exception as e:  # noqa: BLE001 - name the user's function, not our call stack
      who = name if custom is not None else "the rule reward"
      raise ValueError(f"config.{field}: {who} raised {type(e).__name__}: {e}") from None
  return score


def check_rule_rows(cfg, train, val):
  """Rows a rule reward will judge: each data_source has a rule, each ground truth suits it."""
  sections = [("reward", cfg.reward)]
  if get_algorithm(cfg.algorithm.name).uses_cost:
    sections.append(("cost", cfg.cost))
  for name, section in sections:
    if section.kind == "rule" and not section.custom_fn.path:
      for which, rows in (("train_files", train), ("val_files", val)):
        check_rows(rows, f"config.data.{which} under config.{name}.kind='rule'")


def check_vocab(cfg, model_cfg, tokenizer):
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise ValueError(
        f"config.model.tokenizer: {tokenizer_spec(cfg)!r} has {tokenizer.vocab_size} token ids "
        f"but the model at config.model.path={cfg.model.path!r} embeds {model_cfg.vocab_size}; "
        "set model.tokenizer to the checkpoint's tokenizer (empty: model.path's)")


def make_loaders(cfg, tokenizer, train, val, log=print):
  """(train loader, validation loader); the validation one yields every kept row once."""
  template = cfg.data.chat_template_kwargs.to_dict()
  long_prompts = dict(truncate=cfg.data.truncate_prompts,
                      filter_overlong=cfg.data.filter_overlong_prompts)
  loader = PromptLoader(train, tokenizer, cfg.data.train_batch_size, cfg.data.max_prompt_length,
                        seed=cfg.data.seed, shuffle=cfg.data.shuffle,
                        chat_template_kwargs=template, **long_prompts)
  # Batch size 1: validation takes val_batch_size rows at a time, the last batch short.
  val_loader = PromptLoader(val, tokenizer, 1, cfg.data.max_prompt_length, shuffle=False,
                            chat_template_kwargs=template, **long_prompts)
  for which, each in (("train_files", loader), ("val_files", val_loader)):
    if each.dropped:
      log(f"data.{which}: left out {each.dropped} of {len(each.dataset)} rows longer "
          f"than max_prompt_length={cfg.data.max_prompt_length} (data.filter_overlong_prompts)")
  return loader, val_loader


def cost_function(cfg, tokenizer):
  """The rule cost of an algorithm with a cost role and cost.kind='rule' (else None)."""
  if get_algorithm(cfg.algorithm.name).uses_cost and cfg.cost.kind == "rule":
    return make_reward_fn(cfg.cost, tokenizer, "cost")
  return None
