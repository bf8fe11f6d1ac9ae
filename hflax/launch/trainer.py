"""The main job: data, rewards, roles, the algorithm's step loop, validation, checkpoints,
metrics and the final export. `run(cfg)` is what `python -m hflax.launch` calls."""
from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np

from hflax.algorithms.drivers import DRIVERS, TAKES_PROMPT_ITERATOR, init_state
from hflax.algorithms.drivers.common import step_metrics, timed_roles
from hflax.checkpoint import Checkpointer
from hflax.controller.batch import Batch
from hflax.data import PromptLoader, arithmetic_task, load_prompts
from hflax.launch.config import tokenizer_spec, validate
from hflax.launch.roles import (actor_config, build_roles, check_placed, needed_roles,
                                placement_spec, policy_model, read_model_configs,
                                reference_in_actor)
from hflax.launch.sft import sft_warmup, warmup_cache_dir
from hflax.metrics import MetricsLogger, plot_metrics, throughput
from hflax.metrics.generations import generation_rows, write_generations
from hflax.models import hf
from hflax.models.lora import export_adapter, merge_adapters
from hflax.models.tokenizer import load_tokenizer, save_tokenizer
from hflax.rewards import RuleRewardScorer, load_reward_function, validation_metrics
from hflax.rewards.registry import check_rule_rows
from hflax.sharding.placement import build_placement


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
    if not os.path.exists(spec):
      raise FileNotFoundError(f"config.data.{'train' if which == 0 else 'val'}_files: "
                              f"{spec!r} does not exist")
    return load_prompts(spec)
  return load(d.train_files, 0), load(d.val_files, 1)


def make_reward_fn(section, tokenizer, field: str = "reward"):
  """score_fn(host batch) -> [B] scores from a rule (per data source) or a user function
  (details=True: the scorer's whole output, answers included)."""
  custom = None
  if section.custom_fn.path:
    where = f"config.{field}.custom_fn ({section.custom_fn.path})"
    try:
      custom = load_reward_function(section.custom_fn.path, section.custom_fn.name)
    except (FileNotFoundError, ValueError, TypeError) as e:
      raise ValueError(f"{where}: {e}") from None
    except Exception as e:  # noqa: BLE001 - the user's file failed while importing
      raise ValueError(f"{where}: importing it raised {type(e).__name__}: {e}") from None
  scorer = RuleRewardScorer(tokenizer, custom)

  def score(batch: Batch, details: bool = False):
    try:
      out = scorer(batch["responses"], list(batch["ground_truth"]), list(batch["data_source"]),
                   list(batch["extra_info"]), response_mask=batch["response_mask"])
      return out if details else out["scores"]
    except ValueError:
      raise
    except Exception as e:  # noqa: BLE001 - name the user's function, not our call stack
      name = section.custom_fn.name or "the rule reward"
      raise ValueError(f"config.{field}: {name} raised {type(e).__name__}: {e}") from None
  return score


def _check_rule_rows(cfg, train, val):
  """Rows a rule reward will judge: each data_source has a rule, each ground truth suits it."""
  sections = [("reward", cfg.reward)]
  if cfg.algorithm.name == "safe_rlhf":
    sections.append(("cost", cfg.cost))
  for name, section in sections:
    if section.kind == "rule" and not section.custom_fn.path:
      for which, rows in (("train_files", train), ("val_files", val)):
        check_rule_rows(rows, f"config.data.{which} under config.{name}.kind='rule'")


def _check_vocab(cfg, model_cfg, tokenizer):
  if tokenizer.vocab_size > model_cfg.vocab_size:
    raise ValueError(
        f"config.model.tokenizer: {tokenizer_spec(cfg)!r} has {tokenizer.vocab_size} token ids "
        f"but the model at config.model.path={cfg.model.path!r} embeds {model_cfg.vocab_size}; "
        "set model.tokenizer to the checkpoint's tokenizer (empty: model.path's)")


class Trainer:
  def __init__(self, cfg, log=print):
    validate(cfg)
    self.cfg, self.log = cfg, log
    self.ckpt = Checkpointer(os.path.join(cfg.trainer.run_dir, "checkpoints"),
                             keep=cfg.trainer.keep, save_every=cfg.trainer.save_every)
    self._check_run_dir()
    devices = jax.devices()
    if cfg.cluster.backend == "local" and cfg.trainer.devices > len(devices):
      raise ValueError(f"config.trainer.devices: {cfg.trainer.devices} asked for, "
                       f"{len(devices)} {devices[0].platform} device(s) here")
    devices = devices[:cfg.trainer.devices] if cfg.trainer.devices else devices
    self.check_placement(devices)
    # An unsupported architecture or vocabulary, a missing checkpoint: before anything runs.
    checkpoint = read_model_configs(cfg, driver_only=cfg.cluster.backend == "ray")
    self.tokenizer = load_tokenizer(tokenizer_spec(cfg))
    if checkpoint is not None:
      _check_vocab(cfg, checkpoint, self.tokenizer)
    train, val = load_datasets(cfg)
    _check_rule_rows(cfg, train, val)
    template = cfg.data.chat_template_kwargs.to_dict()
    long_prompts = dict(truncate=cfg.data.truncate_prompts,
                        filter_overlong=cfg.data.filter_overlong_prompts)
    self.loader = PromptLoader(train, self.tokenizer, cfg.data.train_batch_size,
                               cfg.data.max_prompt_length, seed=cfg.data.seed,
                               shuffle=cfg.data.shuffle, chat_template_kwargs=template,
                               **long_prompts)
    # Batch size 1: validation takes val_batch_size rows at a time, the last batch short.
    self.val_loader = PromptLoader(val, self.tokenizer, 1, cfg.data.max_prompt_length,
                                   shuffle=False, chat_template_kwargs=template, **long_prompts)
    for which, loader in (("train_files", self.loader), ("val_files", self.val_loader)):
      if loader.dropped:
        log(f"data.{which}: left out {loader.dropped} of {len(loader.dataset)} rows longer "
            f"than max_prompt_length={cfg.data.max_prompt_length} (data.filter_overlong_prompts)")
    self.reward_fn = make_reward_fn(cfg.reward, self.tokenizer)
    self.cost_fn = make_reward_fn(cfg.cost, self.tokenizer, "cost") if \
        cfg.algorithm.name == "safe_rlhf" and cfg.cost.kind == "rule" else None
    policy = policy_model(cfg, self.tokenizer.vocab_size, self.tokenizer)
    # What LoRA adapters sit on: model.path, or the warm-up's cached checkpoint.
    self.base_path = cfg.model.path
    if cfg.trainer.sft_warmup.steps:
      self.base_path = warmup_cache_dir(cfg, policy[0])
      policy = sft_warmup(cfg, policy, self.tokenizer, [train[i] for i in self.loader.kept],
                          log=log)
    self.model_cfg = policy[0]
    self.roles = self.make_roles(policy, devices)
    self.devices = len(devices)
    self.state = init_state(cfg.algorithm)
    self.state.lagrange_lambda = cfg.algorithm.lambda_init
    self.val_generations: list[dict] = []  # trainer.log_val_generations of the last validation

  def check_placement(self, devices):
    """Placement errors surface before any work is done (an auto plan needs the policy's
    shape, so it is checked when it is made)."""
    if self.cfg.placement.kind != "auto":
      roles = needed_roles(self.cfg)
      placed = build_placement(placement_spec(self.cfg, roles, len(devices)), devices,
                               where="config.placement")
      check_placed(self.cfg, placed, roles)
    if reference_in_actor(self.cfg) and "ref" in self.cfg.placement.roles:
      self.log("model.lora_rank: the actor computes the reference log-probs from its frozen "
               "base, so placement.roles.ref is not used (nor a pool only it used)")

  def make_roles(self, policy, devices):
    """The role workers on this process's devices (the Ray backend overrides this)."""
    return build_roles(self.cfg, policy, tokenizer=self.tokenizer, reward_fn=self.reward_fn,
                       cost_fn=self.cost_fn, devices=devices)

  # -- checkpoints --------------------------------------------------------------------------
  def _trained(self):
    return {name: w for name, w in (("actor", self.roles.actor), ("critic", self.roles.critic))
            if w is not None}

  def save(self, step: int, force: bool = False):
    if self.ckpt.latest_step() == step:
      return
    arrays = {f"{name}_{k}": v for name, w in self._trained().items()
              for k, v in w.checkpoint_arrays().items()}
    host = {"step": step, "loader": self.loader.state_dict(), "kl_ctrl": self.state.kl_ctrl,
            "lagrange_lambda": self.state.lagrange_lambda,
            "workers": {name: w.checkpoint_counters() for name, w in self._trained().items()}}
    self.ckpt.save(step, arrays, host, force=force)

  def _latest_checkpoint(self):
    return self.ckpt.latest_step() if os.path.isdir(self.ckpt.directory) else None

  def _check_run_dir(self):
    """Before any work: a run_dir that holds checkpoints is only ever continued."""
    latest, t = self._latest_checkpoint(), self.cfg.trainer
    if latest is None:
      return
    if not t.resume:
      raise ValueError(f"config.trainer.run_dir: {t.run_dir} already holds checkpoints up to "
                       f"step {latest}; set trainer.resume=True to continue it, or use a new "
                       "run_dir (nothing is overwritten)")
    if latest > t.total_steps and not t.val_only:
      raise ValueError(f"config.trainer.total_steps: {t.total_steps}, but {t.run_dir} already "
                       f"holds checkpoints up to step {latest}; raise total_steps to continue "
                       "it, or use a new run_dir")

  def resume(self) -> int:
    step = self._latest_checkpoint()
    if step is None:
      return 0
    targets = {f"{name}_{k}": v for name, w in self._trained().items()
               for k, v in w.checkpoint_arrays().items()}
    try:
      arrays, host = self.ckpt.restore(step, targets)
    except Exception as e:  # noqa: BLE001 - say which checkpoint, and what to do
      raise ValueError(f"config.trainer.run_dir: checkpoint step {step} in "
                       f"{self.ckpt.directory} cannot be restored ({type(e).__name__}: {e}); "
                       "remove it or set --config.trainer.resume=False") from None
    for name, w in self._trained().items():
      w.restore_checkpoint({k: arrays[f"{name}_{k}"] for k in ("params", "opt_state")},
                           host["workers"][name], step)
    self.loader.load_state_dict(host["loader"])
    self.state.step, self.state.kl_ctrl = host["step"], host["kl_ctrl"]
    self.state.lagrange_lambda = host["lagrange_lambda"]
    self.log(f"resumed from step {step} ({self.ckpt.directory})")
    return step

  # -- validation ---------------------------------------------------------------------------
  def validate(self, step: int | None = None) -> dict:
    """Scores of rollout.val_n samples per held-out prompt, per data source (greedy with
    the default val_temperature=0). The same keys every time, so that validations at
    different steps sample alike. With trainer.validation_data_dir, the samples go to
    {dir}/{step}.jsonl."""
    actor, r = self.roles.actor, self.cfg.rollout
    sampling = dataclasses.replace(actor.sampling, n=r.val_n, temperature=r.val_temperature,
                                   top_k=r.val_top_k, top_p=r.val_top_p)
    t = self.cfg.trainer
    scores, sources, preds, samples = [], [], [], []
    keep_samples = step is not None and (t.validation_data_dir or t.log_val_generations)
    # Not the rollouts' keys (seed, call): a tag of its own keeps the two apart.
    key = jax.random.fold_in(jax.random.key(t.seed), _VALIDATION_TAG)
    for i, raw in enumerate(_full_pass(self.val_loader, self.cfg.data.val_batch_size)):
      batch = actor.generate_sequences(Batch.from_dict(raw), sampling=sampling,
                                       rng=jax.random.fold_in(key, i))
      host = batch.to_host()
      scored = self.reward_fn(host, details=True)
      if keep_samples:
        samples += generation_rows(self.tokenizer, host, scored["scores"], step,
                                   outputs=scored["response_text"])
      scores.append(scored["scores"])
      preds += scored["pred"]
      sources += list(batch["data_source"])
    if samples and t.validation_data_dir:
      write_generations(t.validation_data_dir, step, samples)
    if samples and t.log_val_generations:
      # The same samples at every validation (a fixed draw over a fixed order), so the
      # logs show how the answers to the same prompts change.
      pick = np.random.default_rng(_VALIDATION_TAG).permutation(len(samples))
      self.val_generations = [{k: samples[j][k] for k in ("input", "output", "score")}
                              for j in sorted(pick[:t.log_val_generations])]
    return validation_metrics(np.concatenate(scores), sources, r.val_n, preds)

  def _log_validation(self, logger: MetricsLogger, step: int, metrics: dict):
    logger.log(step, metrics)
    if self.val_generations:
      logger.log_generations(step, self.val_generations)

  def validate_only(self, step: int) -> dict:
    """trainer.val_only: validates the policy as it stands (the run's latest checkpoint,
    else the start) and logs the metrics at its step; nothing trains, saves or exports."""
    metrics = self.validate(step)
    t = self.cfg.trainer
    logger = MetricsLogger(t.run_dir, step, backends=tuple(b for b in t.log if b != "console"),
                           wandb=t.wandb_project or None, start_step=step)
    self._log_validation(logger, step, metrics)
    logger.close()
    self.log(f"held-out accuracy at step {step}: " + _fmt(metrics))
    return {"before": metrics, "after": None}

  # -- the loop -----------------------------------------------------------------------------
  def prompt_batches(self):
    while True:
      yield Batch.from_dict(self.loader.next_batch())

  def fit(self) -> dict:
    cfg = self.cfg
    start = self.resume()
    if cfg.trainer.val_only:
      return self.validate_only(start)
    total = cfg.trainer.total_steps
    logger = MetricsLogger(cfg.trainer.run_dir, total, backends=tuple(cfg.trainer.log),
                           wandb=cfg.trainer.wandb_project or None, start_step=start)
    first_val = last_val = None
    if cfg.trainer.val_before_train and start == 0:
      first_val = self.validate(0)
      self.log("held-out accuracy before RL: " + _fmt(first_val))
      # step 0, as verl logs it: the curves start from the baseline
      self._log_validation(logger, 0, first_val)
    driver, prompts = DRIVERS[cfg.algorithm.name], self.prompt_batches()
    profile = set(cfg.trainer.profile_steps)
    for step in range(start + 1, total + 1):
      metrics: dict = {}
      roles = timed_roles(self.roles, metrics, block=cfg.trainer.stage_timing)
      if step in profile:
        jax.profiler.start_trace(os.path.join(cfg.trainer.run_dir, "profile", f"step{step}"))
      began = time.perf_counter()
      batch = driver(roles, prompts if cfg.algorithm.name in TAKES_PROMPT_ITERATOR else next(prompts),
                     cfg, self.state)
      metrics.update(batch.meta.get("metrics", {}))
      metrics.update(step_metrics(batch, cfg.data.max_response_length,
                                  cfg.data.max_prompt_length))
      jax.block_until_ready(metrics)
      elapsed = time.perf_counter() - began
      if step in profile:
        jax.profiler.stop_trace()
      if cfg.trainer.rollout_data_dir:
        host = batch.to_host()
        write_generations(cfg.trainer.rollout_data_dir, step, generation_rows(
            self.tokenizer, host, host["token_level_scores"].sum(axis=1), step))
      tokens = float(np.asarray(batch["attention_mask"]).sum())
      metrics.update({"timing_s/step": elapsed,
                      "perf/throughput": throughput(tokens, elapsed, self.devices),
                      "perf/total_num_tokens": tokens})
      self.state.step = step
      validated = cfg.trainer.val_every and (step % cfg.trainer.val_every == 0 or step == total)
      if validated:
        last_val = self.validate(step)
        metrics.update(last_val)
      logger.log(step, metrics)
      if validated and self.val_generations:
        logger.log_generations(step, self.val_generations)
      self.save(step)
    self.save(total, force=True)
    logger.close()
    if first_val is not None and last_val is not None:
      self.log("held-out accuracy before RL: " + _fmt(first_val))
      self.log("held-out accuracy after RL:  " + _fmt(last_val))
    if cfg.trainer.export_hf:
      out = os.path.join(cfg.trainer.run_dir, "hf_actor")
      params = self.roles.actor.params
      if cfg.model.lora_rank:  # the adapters in PEFT's format, and merged into hf_actor
        adapter = os.path.join(cfg.trainer.run_dir, "lora_adapter")
        lora_cfg = actor_config(cfg, self.model_cfg)
        export_adapter(adapter, lora_cfg, params, base_model=self.base_path)
        params = merge_adapters(lora_cfg, params)
        self.log(f"exported the LoRA adapters to {adapter}")
      hf.export_checkpoint(out, self.model_cfg, params)
      save_tokenizer(self.tokenizer, out)
      self.log(f"exported the actor to {out}")
    self._plot()
    return {"before": first_val, "after": last_val}

  def _plot(self):
    path = os.path.join(self.cfg.trainer.run_dir, "metrics.jsonl")
    if os.path.exists(path):
      try:
        plot_metrics(path, os.path.join(self.cfg.trainer.run_dir, "metrics.png"))
      except ImportError as e:  # matplotlib missing: the JSONL is still there to re-plot
        self.log(f"no plot: {e}")


_VALIDATION_TAG = 0x76616C  # "val"


def _full_pass(loader: PromptLoader, size: int):
  """Every row the loader keeps once, in order, `size` at a time (the last batch short)."""
  for start in range(0, len(loader.kept), size):
    yield loader.collate(loader.kept[start:start + size])


def _fmt(metrics: dict) -> str:
  """The val-core metrics (val-aux ones are in the logs)."""
  return ", ".join(f"{k} = {v:.3f}" for k, v in sorted(metrics.items())
                   if k.startswith("val-core/"))


def run(cfg, log=print) -> dict:
  if cfg.cluster.backend == "ray":  # the driver here, role workers in Ray actor processes
    from hflax.controller.ray_backend.trainer import run as run_on_ray
    return run_on_ray(cfg, log=log)
  return Trainer(cfg, log=log).fit()
