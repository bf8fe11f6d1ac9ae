"""What the policy wrote: one JSONL file of samples per step, as verl's rollout_data_dir
and validation_data_dir hold them (input, output, gts, score, step, and more here).

Each step's file is written whole and renamed into place, so a killed run leaves either
the complete file or none, and a resumed run that redoes a step replaces its file.
"""
from __future__ import annotations

import json
import os
from typing import Sequence

import numpy as np

from hflax.models.tokenizer import Tokenizer


def generation_rows(tokenizer: Tokenizer, batch, scores: Sequence[float], step: int,
                    outputs: Sequence[str] | None = None) -> list[dict]:
  """One dict per sample of a generated batch (host arrays): prompt text (with special
  tokens) and response text (without), ground truth, data source, score, and the
  advantage where the step computed one."""
  # The prompt as the model saw it, chat template tokens and all.
  inputs = tokenizer.decode_rows(batch["prompts"], batch["prompt_mask"], False)
  if outputs is None:
    outputs = tokenizer.decode_rows(batch["responses"], batch["response_mask"])
  rows = [{"step": step, "input": i, "output": o, "gts": g, "score": float(s),
           "data_source": d}
          for i, o, g, s, d in zip(inputs, outputs, batch["ground_truth"], scores,
                                   batch["data_source"], strict=True)]
  if "advantages" in batch.keys():
    # A sequence's advantage: constant over its tokens for outcome estimators (GRPO,
    # RLOO, ...), per token for GAE, where the mean over the response is shown.
    adv, mask = np.asarray(batch["advantages"]), np.asarray(batch["response_mask"], bool)
    per_row = (adv * mask).sum(axis=1) / np.maximum(mask.sum(axis=1), 1)
    for row, value in zip(rows, per_row):
      row["advantage"] = float(value)
  return rows


def write_generations(directory: str, step: int, rows: list[dict]) -> str:
  """Writes directory/{step}.jsonl atomically; returns its path."""
  os.makedirs(directory, exist_ok=True)
  path = os.path.join(directory, f"{step}.jsonl")
  partial = f"{path}.partial"
  with open(partial, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
  os.replace(partial, path)
  return path
