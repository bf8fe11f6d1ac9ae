"""The training loop's side jobs as hooks with a period: `trainer.add_hook(fn, every=N)`.

A hook fn(info) runs after every step whose number is a multiple of `every` (and after
the last step too with final=True), in the order hooks were added; `info.metrics` is the
step's metrics, which a hook may extend before the logging hook writes them. Hooks added
with `at_end=True` run once after the loop. The built-in ones: profiling, rollout dumps,
validation, metrics logging, checkpoints, and at the end the last checkpoint, the
export and the plot.
"""
from __future__ import annotations

import dataclasses
import math
import os
from typing import Callable

import jax
import numpy as np

from hflax.checkpoint import pause_for_test
from hflax.controller.batch import Batch
from hflax.launch.atomic_export import atomic_directory
from hflax.metrics import plot_metrics
from hflax.metrics.generations import generation_rows, write_generations
from hflax.models import hf
from hflax.models.lora import export_adapter, merge_adapters
from hflax.models.tokenizer import save_tokenizer


@dataclasses.dataclass
class StepInfo:
  step: int
  total: int  # the run's last step
  batch: Batch | None  # None in end-of-run hooks
  metrics: dict


@dataclasses.dataclass(frozen=True)
class _Hook:
  fn: Callable[[StepInfo], None]
  every: int
  final: bool

  def due(self, step: int, total: int) -> bool:
    return step % self.every == 0 or (self.final and step == total)


class Hooks:
  def __init__(self):
    self._before: list[Callable[[int], None]] = []
    self._after: list[_Hook] = []
    self._end: list[Callable[[StepInfo], None]] = []

  def add_hook(self, fn: Callable[[StepInfo], None], every: int = 1, *, final: bool = False,
               at_end: bool = False):
    if at_end:
      self._end.append(fn)
    else:
      if not isinstance(every, int) or every < 1:
        raise ValueError(f"add_hook: every must be an integer >= 1, got {every!r}")
      self._after.append(_Hook(fn, every, final))
    return fn

  def add_before_step(self, fn: Callable[[int], None]):
    """fn(step) before the step's work starts (e.g. to start a profiler trace)."""
    self._before.append(fn)
    return fn

  def extend(self, other: "Hooks"):
    """Appends other's hooks after these, kind by kind."""
    self._before += other._before
    self._after += other._after
    self._end += other._end

  def before_step(self, step: int):
    for fn in self._before:
      fn(step)

  def after_step(self, info: StepInfo):
    for hook in self._after:
      if hook.due(info.step, info.total):
        hook.fn(info)

  def at_end(self, info: StepInfo):
    for fn in self._end:
      fn(info)


class NonFinite(ValueError):
  """A step produced a NaN or an infinity: the run stops before anything saves it."""


# metric prefix -> the stage that produced it, in dataflow order: the first non-finite one
# names where the trouble started.
GUARDED = {"critic/score/": "reward", "critic/rewards/": "reward (with the KL penalty)",
           "critic/values/": "critic values", "critic/advantages/": "advantage",
           "critic/returns/": "advantage", "critic/vf_loss": "update_critic",
           "critic/grad_norm": "update_critic", "actor/pg_loss": "update_actor",
           "actor/kl_loss": "update_actor", "actor/entropy": "update_actor",
           "actor/grad_norm": "update_actor"}


def finite_guard(last_saved: Callable[[], int | None]):
  """Stops the run at the first step whose rewards, advantages, losses or gradient norms
  are not finite, before any hook after it logs, validates, saves or exports that step.
  last_saved() is the newest checkpoint's step, named so the user knows where a rerun
  with the same run_dir continues from."""

  def check(info: StepInfo):
    for prefix, stage in GUARDED.items():
      key = next((k for k, v in info.metrics.items()
                  if k.startswith(prefix) and not math.isfinite(float(v))), None)
      if key is not None:
        value = info.metrics[key]
        saved = last_saved()
        where = (f"the last checkpoint is step {saved}" if saved is not None else
                 "no checkpoint was written")
        raise NonFinite(f"step {info.step}: {key} is {float(value)} ({stage} stage); nothing "
                        f"of this step was saved or exported, {where}: fix the cause and "
                        "rerun with the same trainer.run_dir to continue from it")
  return check


# -- the built-in side jobs ------------------------------------------------------------------
def add_profiler(hooks: Hooks, steps, directory: str):
  """A jax.profiler trace of each step in `steps`, to directory/step<N>."""
  steps = set(steps)
  hooks.add_before_step(lambda step: step in steps and jax.profiler.start_trace(
      os.path.join(directory, f"step{step}")))
  hooks.add_hook(lambda info: info.step in steps and jax.profiler.stop_trace())


def rollout_dump(directory: str, tokenizer):
  """Each step's samples (prompt, response, score) to directory/<step>.jsonl."""

  def dump(info: StepInfo):
    host = info.batch.to_host()
    rows = generation_rows(tokenizer, host, host["token_level_scores"].sum(axis=1), info.step)
    # Where each sample came from and which weights sampled it: its prompt's dataset row and
    # its tokens' versions (the oldest is its staleness; several: a partial rollout).
    for key, name in (("row_index", "row_index"), ("rollout_version", "rollout_version")):
      if key in host.keys():
        for row, value in zip(rows, np.asarray(host[key]).tolist()):
          row[name] = value
    if "rollout_versions" in host.keys():
      versions, mask = np.asarray(host["rollout_versions"]), np.asarray(host["response_mask"])
      for row, v, m in zip(rows, versions, mask):
        row["versions"] = sorted(set(v[m.astype(bool)].tolist()))
    write_generations(directory, info.step, rows)
  return dump


def export_actor(trainer):
  """The trained actor as an HF checkpoint in run_dir/hf_actor (with LoRA: the adapters in
  PEFT's format in run_dir/lora_adapter, and merged into hf_actor)."""

  def export(info: StepInfo):
    from hflax.launch.roles import actor_config
    cfg = trainer.cfg
    out = os.path.join(cfg.trainer.run_dir, "hf_actor")
    params = trainer.roles.actor.params
    if cfg.model.lora_rank:
      adapter = os.path.join(cfg.trainer.run_dir, "lora_adapter")
      lora_cfg = actor_config(cfg, trainer.model_cfg)
      with atomic_directory(adapter) as partial:
        export_adapter(partial, lora_cfg, params, base_model=trainer.base_path)
      params = merge_adapters(lora_cfg, params)
      trainer.log(f"exported the LoRA adapters to {adapter}")
    # Whole or absent: a kill mid-export never leaves an hf_actor that looks like a model.
    with atomic_directory(out) as partial:
      hf.export_checkpoint(partial, trainer.model_cfg, params)
      pause_for_test("export")  # HFLAX_TEST_PAUSE: tests kill the launcher here
      save_tokenizer(trainer.tokenizer, partial)
    trainer.log(f"exported the actor to {out}")
  return export


def export_gguf_actor(trainer):
  """The trained actor (LoRA merged) as run_dir/gguf_actor/model.gguf, in F32, with its
  tokenizer: a file llama.cpp and ollama run (hflax.models.gguf_export)."""

  def export(info: StepInfo):
    from hflax.launch.roles import actor_config
    from hflax.models.gguf_export import write_gguf
    cfg = trainer.cfg
    out = os.path.join(cfg.trainer.run_dir, "gguf_actor")
    model_cfg = actor_config(cfg, trainer.model_cfg) if cfg.model.lora_rank else trainer.model_cfg
    with atomic_directory(out) as partial:  # whole or absent, as hf_actor
      write_gguf(os.path.join(partial, "model.gguf"), model_cfg, trainer.roles.actor.params,
                 trainer.tokenizer)
    trainer.log(f"exported the actor as GGUF to {out}/model.gguf")
  return export


def check_gguf_export(model_cfg, tokenizer) -> None:
  """trainer.export_gguf's refusals before the run: a policy (None: the built-in llama) or
  a tokenizer llama.cpp cannot take, in one line naming the field."""
  from hflax.models import gguf_export
  try:
    if model_cfg is not None:
      gguf_export.check_exportable(model_cfg)
    gguf_export.check_tokenizer(tokenizer)
  except ValueError as e:
    raise ValueError(f"config.trainer.export_gguf: {e}") from None


def plot(run_dir: str, log=print):
  """run_dir/metrics.png from run_dir/metrics.jsonl (skipped, said, without matplotlib)."""

  def draw(info: StepInfo):
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
      try:
        plot_metrics(path, os.path.join(run_dir, "metrics.png"))
      except ImportError as e:  # matplotlib missing: the JSONL is still there to re-plot
        log(f"no plot: {e}")
  return draw
