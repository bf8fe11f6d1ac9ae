"""The main job: one training loop for every backend. `run(cfg)` is what
`python -m hflax.launch` calls.

Trainer(cfg) checks the config, reads the data and the policy, runs the warm-up, turns
the config into a plan and has the backend build the roles. `fit` steps the algorithm's
driver and runs the side jobs as hooks (see hflax.launch.hooks); `add_hook(fn, every=N)`
adds one.
"""
from __future__ import annotations

import dataclasses
import os
import time

import jax
import numpy as np

from hflax.algorithms.drivers import get_algorithm, init_state
from hflax.algorithms.drivers.common import step_metrics, timed_roles
from hflax.checkpoint import Checkpointer, CorruptCheckpoint
from hflax.controller.backend import WorkerFailure
from hflax.controller.batch import Batch
from hflax.launch import hooks as side_jobs, interrupts
from hflax.launch.backends import make_backend
from hflax.launch.config import tokenizer_spec, validate, wandb_project
from hflax.launch.hooks import Hooks, StepInfo
from hflax.launch.async_mode import AsyncRollouts
from hflax.launch.modes import OneStepOff
from hflax.launch.inputs import (check_rule_rows, check_vocab, cost_function, load_datasets,
                                 make_loaders, make_reward_fn)
from hflax.launch.roles import (make_plan, needed_roles, placement_spec, policy_model,
                                read_model_configs, step_config)
from hflax.launch.models import check_teacher
from hflax.launch.sft import sft_warmup, warmup_cache_dir
from hflax.metrics import MetricsLogger, throughput
from hflax.models.tokenizer import load_tokenizer
from hflax.launch.validation import validate_policy
from hflax import platforms
from hflax.platforms.compile_cache import (CompileCacheStats, compile_cache_summary,
                                           use_compile_cache)
from hflax.platforms import cpu_has_bf16


def emulated_bf16(cfg) -> list[str]:
  """The dtype fields that ask for bfloat16 compute which this host's CPU would emulate:
  a local run on JAX's CPU backend without bf16 instructions
  (hflax.platforms.cpu_has_bf16)."""
  fields = [f"{part}.dtype" for part in ("model", "rollout") if cfg[part].dtype == "bfloat16"]
  if (not fields or cfg.cluster.backend != "local" or not platforms.on_cpu()
      or cpu_has_bf16() is not False):
    return []
  return fields


class Trainer:
  def __init__(self, cfg, log=print):
    validate(cfg)
    self.cfg, self.log = cfg, log
    cache = use_compile_cache(cfg.trainer.compile_cache_dir)  # before anything compiles
    if cache:
      log(f"compile cache: {cache} ({compile_cache_summary(cache)}; safe to delete)")
    self.algorithm = get_algorithm(cfg.algorithm.name)
    t = cfg.trainer
    self.ckpt = Checkpointer(os.path.join(t.run_dir, "checkpoints"), keep=t.keep,
                             save_every=t.save_every)
    self._check_run_dir()
    # Placement and process layouts, an unsupported architecture or vocabulary, a missing
    # checkpoint, bad data rows: all before anything runs.
    self.backend, spec = make_backend(cfg, log)
    emulated = emulated_bf16(cfg)
    if emulated:
      log(f"warning: {' and '.join(emulated)} = 'bfloat16' on a CPU without bfloat16 "
          "instructions (/proc/cpuinfo lists no avx512_bf16, amx_bf16 or bf16): XLA emulates "
          "them through float32, so this run is slower than with 'float32'")
    # This process's lookups: the local backend's programs (Ray workers compile their own).
    self.cache_stats = CompileCacheStats() if cache else None
    try:
      self._setup(spec)
    except BaseException:
      self.close()
      raise

  def _setup(self, spec):
    cfg, log = self.cfg, self.log
    checkpoint = read_model_configs(cfg, driver_only=cfg.cluster.backend == "ray")
    self.tokenizer = load_tokenizer(tokenizer_spec(cfg))
    if cfg.trainer.export_gguf:
      side_jobs.check_gguf_export(checkpoint, self.tokenizer)
    if checkpoint is not None:
      check_vocab(cfg, checkpoint, self.tokenizer)
    check_teacher(cfg, checkpoint.vocab_size if checkpoint else self.tokenizer.vocab_size)
    train, val = load_datasets(cfg)
    check_rule_rows(cfg, train, val)
    self.loader, self.val_loader = make_loaders(cfg, self.tokenizer, train, val, log)
    self.reward_fn = make_reward_fn(cfg.reward, self.tokenizer)
    self.cost_fn = cost_function(cfg, self.tokenizer)
    policy = policy_model(cfg, self.tokenizer.vocab_size, self.tokenizer)
    # What LoRA adapters sit on: model.path, or the warm-up's cached checkpoint.
    self.base_path = cfg.model.path
    if cfg.trainer.sft_warmup.steps:
      self.base_path = warmup_cache_dir(cfg, policy[0])
      policy = sft_warmup(cfg, policy, self.tokenizer, [train[i] for i in self.loader.kept],
                          log=log)
    self.model_cfg = policy[0]
    if spec is None:  # local devices: an auto plan is made for the policy's shape
      devices = self.backend.device_list
      spec = placement_spec(cfg, needed_roles(cfg), len(devices), policy[0], devices, log=log)
    self.plan = make_plan(cfg, spec, self.tokenizer)
    self.roles = self.backend.build(self.plan, policy, reward_fn=self.reward_fn,
                                    cost_fn=self.cost_fn)
    self.devices = self.backend.devices
    self.state = init_state(cfg.algorithm)
    self.schedule = self._schedule()
    self._initial_loader = self.loader.state_dict()
    self.val_generations: list[dict] = []  # trainer.log_val_generations of the last validation
    self.hooks = Hooks()
    self.logger: MetricsLogger | None = None
    self.first_val = self.last_val = None

  def _schedule(self) -> OneStepOff | AsyncRollouts | None:
    """trainer.mode's pending-batch schedule (hflax.launch.modes); None for sync."""
    cfg = self.cfg
    t = cfg.trainer
    if t.get("mode", "sync") == "sync":
      return None
    if t.mode == "async":
      return AsyncRollouts(self.roles.actor, self.loader.collate,
                           groups=cfg.data.train_batch_size, n=cfg.rollout.n,
                           max_staleness=t.max_staleness, decode_steps=t.async_decode_steps,
                           max_prompt_len=cfg.data.max_prompt_length,
                           max_num_seqs=cfg.rollout.max_num_seqs)
    return OneStepOff(t.get("max_staleness", 1))

  def add_hook(self, fn, every: int = 1, **kw):
    """fn(StepInfo) after every `every`-th step (see hflax.launch.hooks)."""
    return self.hooks.add_hook(fn, every, **kw)

  def close(self):
    if self.cache_stats is not None:
      self.cache_stats.close()
      self.cache_stats = None  # closing again is harmless
    self.backend.close()

  # -- checkpoints --------------------------------------------------------------------------
  def save(self, step: int):
    if self.ckpt.latest_step() == step:
      return
    host = {"step": step, "loader": self.loader.state_dict(), "kl_ctrl": self.state.kl_ctrl,
            "lagrange_lambda": self.state.lagrange_lambda}
    if self.schedule is not None:  # the batches sampled and not yet trained
      host["pending"] = self.schedule.state_dict()
    self.backend.save(self.ckpt, step, host)

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
    """Restores the newest checkpoint that restores: one that fails its checksums or
    cannot be read is skipped with a warning (and set aside once an older one restored)."""
    if self._latest_checkpoint() is None:
      return 0
    steps, skipped, first = self.ckpt.all_steps(), [], None
    for step in reversed(steps):
      try:
        host = self.backend.restore(self.ckpt, step)
        break
      except CorruptCheckpoint as e:
        first = first or e
        self.log(f"warning: skipping {e}")
        skipped.append(step)
      except WorkerFailure:
        raise
      except Exception as e:  # noqa: BLE001 - say which checkpoint, and what to do
        raise ValueError(f"config.trainer.run_dir: checkpoint step {step} in "
                         f"{self.ckpt.directory} cannot be restored ({type(e).__name__}: "
                         f"{e}); move it aside to resume from the one before, or use a new "
                         "run_dir") from None
    else:
      raise CorruptCheckpoint(f"config.trainer.run_dir: no checkpoint in {self.ckpt.directory} "
                              f"can be restored (steps {steps}); the latest: {first}; use a "
                              "new run_dir")
    if skipped:
      self.ckpt.set_aside(skipped, step, self.log)
    self.loader.load_state_dict(host["loader"])
    self.state.step, self.state.kl_ctrl = host["step"], host["kl_ctrl"]
    self.state.lagrange_lambda = host["lagrange_lambda"]
    if self.schedule is not None:
      self.schedule.load_state_dict(host.get("pending"), self.loader.collate)
    self.log(f"resumed from step {step} ({self.ckpt.directory})")
    return step

  # -- validation ---------------------------------------------------------------------------
  def validate(self, step: int | None = None) -> dict:
    """The held-out metrics (see hflax.launch.validation); with step, the samples go to
    trainer.validation_data_dir and trainer.log_val_generations of them to the logs."""
    metrics, shown = validate_policy(self.roles.actor, self.val_loader, self.reward_fn,
                                     self.tokenizer, self.cfg, step)
    if shown is not None:
      self.val_generations = shown
    return metrics

  def _metrics_logger(self, total: int, start: int, backends) -> MetricsLogger:
    t = self.cfg.trainer
    name = t.experiment_name or os.path.basename(os.path.normpath(t.run_dir))
    return MetricsLogger(t.run_dir, total, backends=tuple(backends),
                         wandb=wandb_project(self.cfg) or None, start_step=start, name=name,
                         config=self.cfg.to_dict())

  def _log_validation(self, step: int, metrics: dict):
    self.logger.log(step, metrics)
    if self.val_generations:
      self.logger.log_generations(step, self.val_generations)

  def validate_only(self, step: int) -> dict:
    """trainer.val_only: validates the policy as it stands (the run's latest checkpoint,
    else the start) and logs the metrics at its step; nothing trains, saves or exports."""
    metrics = self.validate(step)
    t = self.cfg.trainer
    self.logger = self._metrics_logger(step, step, [b for b in t.log if b != "console"])
    self._log_validation(step, metrics)
    self.logger.close()
    self.log(f"held-out accuracy at step {step}: " + _fmt(metrics))
    return {"before": metrics, "after": None}

  # -- the loop -----------------------------------------------------------------------------
  def _add_side_jobs(self):
    """The built-in hooks, in the order they run after a step."""
    t, hooks = self.cfg.trainer, Hooks()
    if t.profile_steps:
      side_jobs.add_profiler(hooks, t.profile_steps, os.path.join(t.run_dir, "profile"))
    hooks.add_hook(side_jobs.finite_guard(self._latest_checkpoint))
    if t.rollout_data_dir:
      hooks.add_hook(side_jobs.rollout_dump(t.rollout_data_dir, self.tokenizer))
    if t.val_every:
      hooks.add_hook(self._validation_hook, every=t.val_every, final=True)
    hooks.add_hook(self._log_hook)
    if self.cache_stats is not None:
      hooks.add_hook(self._compile_cache_hook)
    hooks.add_hook(lambda info: self.save(info.step), every=t.save_every)
    hooks.add_hook(lambda info: self.save(info.total), at_end=True)
    hooks.add_hook(lambda info: self.logger.close(), at_end=True)
    hooks.add_hook(self._report_hook, at_end=True)
    if t.export_hf:
      hooks.add_hook(side_jobs.export_actor(self), at_end=True)
    if t.export_gguf:
      hooks.add_hook(side_jobs.export_gguf_actor(self), at_end=True)
    hooks.add_hook(side_jobs.plot(t.run_dir, self.log), at_end=True)
    hooks.extend(self.hooks)  # hooks a caller added run after the built-in ones
    return hooks

  def _validation_hook(self, info: StepInfo):
    self.last_val = self.validate(info.step)
    info.metrics.update(self.last_val)

  def _log_hook(self, info: StepInfo):
    self.logger.log(info.step, info.metrics)
    if self.last_val is not None and any(k in info.metrics for k in self.last_val) \
        and self.val_generations:
      self.logger.log_generations(info.step, self.val_generations)

  def _compile_cache_hook(self, info: StepInfo):
    """After the first step this process runs, where most programs have been compiled;
    then the counters stop listening (nothing reads them later)."""
    if self.cache_stats is not None and self.cache_stats.lookups:
      self.log(f"compile cache: {self.cache_stats}")
      self.cache_stats.close()
      self.cache_stats = None

  def _report_hook(self, info: StepInfo):
    if self.first_val is not None and self.last_val is not None:
      self.log("held-out accuracy before RL: " + _fmt(self.first_val))
      self.log("held-out accuracy after RL:  " + _fmt(self.last_val))

  def prompt_batches(self):
    while True:
      yield Batch.from_dict(self.loader.next_batch())

  def run_step(self, prompts) -> tuple[Batch, dict]:
    """One step of the algorithm's driver: its rollouts and metrics (per-stage times,
    verl's batch statistics, throughput)."""
    cfg, metrics, roles = self.cfg, {}, self.roles
    began = time.perf_counter()
    if self.schedule is None:
      feed = prompts if self.algorithm.takes_prompt_iterator else next(prompts)
    else:
      feed = self.schedule.step_prompts(prompts)
      roles = dataclasses.replace(roles, actor=self.schedule.actor(roles.actor, prompts))
    roles = timed_roles(roles, metrics, block=cfg.trainer.stage_timing)
    batch = self.algorithm.step(roles, feed, step_config(cfg), self.state)
    if self.schedule is not None:
      self.schedule.after_update(self.roles.actor, prompts)
    metrics.update(batch.meta.get("metrics", {}))
    metrics.update(step_metrics(batch, cfg.data.max_response_length,
                                cfg.data.max_prompt_length))
    jax.block_until_ready(metrics)
    elapsed = time.perf_counter() - began
    tokens = float(np.asarray(batch["attention_mask"]).sum())
    metrics.update({"timing_s/step": elapsed,
                    "perf/throughput": throughput(tokens, elapsed, self.devices),
                    "perf/total_num_tokens": tokens})
    return batch, metrics

  def fit(self) -> dict:
    """Trains to trainer.total_steps; after a WorkerFailure the backend starts the roles
    afresh and the run resumes from its latest checkpoint (cluster.max_restarts times)."""
    restarts = 0
    while True:
      try:
        return self._fit()
      except WorkerFailure as e:
        self.log(f"ray: {e}")
        if restarts >= self.backend.max_restarts:
          raise
        restarts += 1
        self.log(f"ray: restart {restarts} of {self.backend.max_restarts}: new worker groups, "
                 "resuming from the latest checkpoint")
        self.roles = self.backend.restart()
        self.loader.load_state_dict(self._initial_loader)
        self.state = init_state(self.cfg.algorithm)
        self.schedule = self._schedule()

  def _fit(self) -> dict:
    t = self.cfg.trainer
    start = self.resume()
    if t.val_only:
      return self.validate_only(start)
    total = t.total_steps
    hooks = self._add_side_jobs()
    self.logger = self._metrics_logger(total, start, t.log)
    self.first_val = self.last_val = None
    if t.val_before_train and start == 0:
      self.first_val = self.validate(0)
      self.log("held-out accuracy before RL: " + _fmt(self.first_val))
      # step 0, as verl logs it: the curves start from the baseline
      self._log_validation(0, self.first_val)
    prompts = self.prompt_batches()
    for step in range(start + 1, total + 1):
      interrupts.raise_pending()  # a Ctrl-C or SIGTERM whose exception was swallowed
      hooks.before_step(step)
      batch, metrics = self.run_step(prompts)
      self.state.step = step
      hooks.after_step(StepInfo(step, total, batch, metrics))
    hooks.at_end(StepInfo(total, total, None, {}))
    return {"before": self.first_val, "after": self.last_val}


def _fmt(metrics: dict) -> str:
  """The val-core metrics and, for tool tasks, the tool-call rates beside them (the other
  val-aux ones are in the logs)."""
  shown = sorted((not k.startswith("val-core/"), k) for k in metrics
                 if k.startswith("val-core/") or k.endswith("_call_rate"))
  return ", ".join(f"{k} = {metrics[k]:.3f}" for _, k in shown)


def run(cfg, log=print) -> dict:
  if cfg.cluster.backend == "ray":
    try:  # the driver holds no devices: never let it claim an accelerator the workers need
      jax.config.update("jax_platforms", "cpu")
    except Exception:  # noqa: BLE001 - backend already up (e.g. inside tests): nothing to do
      pass
  trainer = Trainer(cfg, log=log)
  try:
    return trainer.fit()
  finally:
    trainer.close()
