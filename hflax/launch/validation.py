"""Validation: rollout.val_n samples per held-out prompt (greedy with the default
val_temperature=0), scored per data source with verl's metric names. The same keys every
time, so that validations at different steps sample alike."""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from hflax.controller.batch import Batch
from hflax.data import PromptLoader
from hflax.metrics.generations import generation_rows, write_generations
from hflax.rewards import validation_metrics
from hflax.rewards.validation import concat_extra_info

_VALIDATION_TAG = 0x76616C  # "val"


def validate_policy(actor, val_loader: PromptLoader, reward_fn, tokenizer, cfg,
                    step: int | None = None) -> tuple[dict, list[dict] | None]:
  """(metrics, the trainer.log_val_generations samples to show, or None). With `step`,
  every sample goes to trainer.validation_data_dir/{step}.jsonl when that is set."""
  r, t = cfg.rollout, cfg.trainer
  sampling = dataclasses.replace(actor.sampling, n=r.val_n, temperature=r.val_temperature,
                                 top_k=r.val_top_k, top_p=r.val_top_p)
  scores, sources, preds, samples, extras, sizes = [], [], [], [], [], []
  agents = []  # the agent loop's record of each multi-turn sample (None for single-turn)
  keep_samples = step is not None and (t.validation_data_dir or t.log_val_generations)
  # Not the rollouts' keys (seed, call): a tag of its own keeps the two apart.
  key = jax.random.fold_in(jax.random.key(t.seed), _VALIDATION_TAG)
  for i, raw in enumerate(_full_pass(val_loader, cfg.data.val_batch_size)):
    batch = actor.generate_sequences(Batch.from_dict(raw), sampling=sampling,
                                     rng=jax.random.fold_in(key, i))
    host = batch.to_host()
    scored = reward_fn(host, details=True)
    if keep_samples:
      samples += generation_rows(tokenizer, host, scored["scores"], step,
                                 outputs=scored["response_text"])
    scores.append(scored["scores"])
    extras.append(scored.get("reward_extra_info", {}))
    sizes.append(len(scored["scores"]))
    preds += scored["pred"]
    sources += list(batch["data_source"])
    agents += [(info or {}).get("agent") for info in host["extra_info"]]
  if samples and t.validation_data_dir:
    write_generations(t.validation_data_dir, step, samples)
  shown = None
  if samples and t.log_val_generations:
    # The same samples at every validation (a fixed draw over a fixed order), so the
    # logs show how the answers to the same prompts change.
    pick = np.random.default_rng(_VALIDATION_TAG).permutation(len(samples))
    shown = [{k: samples[j][k] for k in ("input", "output", "score")}
             for j in sorted(pick[:t.log_val_generations])]
  metrics = validation_metrics(np.concatenate(scores), sources, r.val_n, preds,
                               extra_info=concat_extra_info(extras, sizes))
  metrics.update(tool_use_metrics(agents, sources))
  return metrics, shown


def tool_use_metrics(agents, sources) -> dict:
  """Per data source of multi-turn samples: the share of samples that called a tool
  (tool_call_rate) and that made a well-formed call, one that parsed and ran without an
  error (well_formed_call_rate). They say whether a tool task's accuracy is limited by
  the model not calling the tool or by the calls it writes."""
  by_source: dict = {}
  for agent, source in zip(agents, sources):
    if agent is not None:
      calls, errors = agent.get("tool_calls", 0), agent.get("tool_errors", 0)
      by_source.setdefault(source, []).append((calls >= 1, calls - errors >= 1))
  metrics = {}
  for source, rows in by_source.items():
    called, well_formed = np.mean(rows, axis=0)
    metrics[f"val-aux/{source}/tool_call_rate"] = float(called)
    metrics[f"val-aux/{source}/well_formed_call_rate"] = float(well_formed)
  return metrics


def _full_pass(loader: PromptLoader, size: int):
  """Every row the loader keeps once, in order, `size` at a time (the last batch short)."""
  for start in range(0, len(loader.kept), size):
    yield loader.collate(loader.kept[start:start + size])
