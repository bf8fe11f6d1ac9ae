"""PromptLoader: deterministic, resumable batches of tokenized, left-padded prompts.

Each epoch visits the rows in a fresh order drawn from (seed, epoch) alone, so the state
needed to resume is just (seed, epoch, position in epoch): a loader restored from
state_dict() yields exactly the batches the saved one would have yielded next.

Batches are always full (drop_last): the rows left over after the last full batch of an
epoch are skipped that epoch; a new shuffle gives them their turn in later epochs.
"""
from __future__ import annotations

import hashlib
from typing import Any, Iterator

import numpy as np

from hflax.data.schema import PromptDataset
from hflax.models.tokenizer import Tokenizer
from hflax.rollout import left_pad


class PromptLoader:
  """Batches of `batch_size` prompts, tokenized with `tokenizer.encode_chat`.

  A batch is a dict: prompts [B, P] int32 and prompt_mask [B, P] bool (left-padded to
  P = max_prompt_length), row_index [B] int64, and per-sample lists ground_truth,
  data_source, extra_info, raw_prompt (the chat messages).

  A prompt longer than max_prompt_length raises ValueError naming its row, unless
  truncate=True, which keeps its last max_prompt_length tokens (the end of the
  conversation and the generation prompt matter most), or filter_overlong=True, which
  leaves the row out (verl's data.filter_overlong_prompts; `kept` lists the dataset rows
  that remain, `dropped` counts the others). All rows are tokenized up front, so such
  errors surface before training starts.

  Iterating (`for batch in loader`) yields the rest of the current epoch; next_batch()
  keeps going across epochs. chat_template_kwargs go to the chat template (verl's
  data.apply_chat_template_kwargs, e.g. {"enable_thinking": False} for Qwen3).
  """

  def __init__(self, dataset: PromptDataset, tokenizer: Tokenizer, batch_size: int,
               max_prompt_length: int, seed: int = 0, shuffle: bool = True,
               truncate: bool = False, chat_template_kwargs: dict | None = None,
               filter_overlong: bool = False):
    if batch_size < 1 or max_prompt_length < 1:
      raise ValueError(f"batch_size and max_prompt_length must be >= 1, got {batch_size}, "
                       f"{max_prompt_length}")
    if truncate and filter_overlong:
      raise ValueError("truncate and filter_overlong both say what to do with a long prompt: "
                       "choose one")
    self.dataset, self.tokenizer = dataset, tokenizer
    self.batch_size, self.max_prompt_length = batch_size, max_prompt_length
    self.seed, self.shuffle = seed, shuffle
    self.truncate, self.filter_overlong = truncate, filter_overlong
    self.chat_template_kwargs = dict(chat_template_kwargs or {})
    self.epoch, self.position = 0, 0
    self._tokens = [self._tokenize(i, row) for i, row in enumerate(dataset)]
    self.kept = np.array([i for i, ids in enumerate(self._tokens) if ids is not None], np.int64)
    self.dropped = len(dataset) - len(self.kept)
    if len(self.kept) < batch_size:
      left = (f" ({self.dropped} longer than max_prompt_length={max_prompt_length} left out)"
              if self.dropped else "")
      raise ValueError(f"{dataset.source}: {len(self.kept)} rows{left} cannot fill one batch "
                       f"of {batch_size} (batches are always full)")

  def _tokenize(self, index: int, row: dict) -> list[int] | None:
    ids = self.tokenizer.encode_chat(row["prompt"], **self.chat_template_kwargs)
    if len(ids) > self.max_prompt_length:
      if self.filter_overlong:
        return None
      if not self.truncate:
        raise ValueError(f"{self.dataset.where(index)}: field 'prompt' is {len(ids)} "
                         f"tokens, longer than max_prompt_length={self.max_prompt_length} "
                         "(raise data.max_prompt_length, leave such rows out: "
                         "data.filter_overlong_prompts=True, or keep their last tokens: "
                         "data.truncate_prompts=True)")
      ids = ids[-self.max_prompt_length:]
    return ids

  def __len__(self) -> int:
    """Batches per epoch."""
    return len(self.kept) // self.batch_size

  def _order(self, epoch: int) -> np.ndarray:
    """The epoch's dataset rows, in order."""
    if not self.shuffle:
      return self.kept
    return self.kept[np.random.default_rng([self.seed, epoch]).permutation(len(self.kept))]

  def _roll_over(self) -> None:
    if self.position >= len(self):
      self.epoch, self.position = self.epoch + 1, 0

  def next_batch(self) -> dict[str, Any]:
    self._roll_over()
    start = self.position * self.batch_size
    rows = self._order(self.epoch)[start:start + self.batch_size]
    self.position += 1
    return self.collate(rows)

  def __iter__(self) -> Iterator[dict[str, Any]]:
    self._roll_over()
    epoch = self.epoch
    while self.epoch == epoch and self.position < len(self):
      yield self.next_batch()

  def collate(self, row_indices) -> dict[str, Any]:
    """The batch of the given dataset rows (used by iteration; handy for validation)."""
    row_indices = [int(i) for i in row_indices]
    dropped = [i for i in row_indices if self._tokens[i] is None]
    if dropped:
      raise ValueError(f"{self.dataset.source}: rows {dropped} were left out as longer than "
                       f"max_prompt_length={self.max_prompt_length}")
    prompts, prompt_mask = left_pad([self._tokens[i] for i in row_indices],
                                    self.tokenizer.pad_id, self.max_prompt_length)
    rows = [self.dataset[i] for i in row_indices]
    return {"prompts": prompts.astype(np.int32), "prompt_mask": prompt_mask.astype(bool),
            "row_index": np.asarray(row_indices, np.int64),
            "ground_truth": [row["reward_model"]["ground_truth"] for row in rows],
            "data_source": [row["data_source"] for row in rows],
            "extra_info": [row["extra_info"] for row in rows],
            "raw_prompt": [row["prompt"] for row in rows]}

  def state_dict(self) -> dict[str, int]:
    # Size and batch size travel along so a resume against different data fails loudly
    # instead of silently skipping or repeating rows.
    return {"seed": self.seed, "epoch": self.epoch, "position": self.position,
            "num_rows": len(self.kept), "batch_size": self.batch_size,
            "rows_digest": self._rows_digest()}

  def _rows_digest(self) -> str:
    # Which rows were left out, not just how many: another max_prompt_length can keep a
    # different set of the same size.
    return hashlib.sha256(self.kept.tobytes()).hexdigest()[:16]

  def load_state_dict(self, state: dict[str, int]) -> None:
    for key, ours in (("num_rows", len(self.kept)), ("batch_size", self.batch_size),
                      ("rows_digest", self._rows_digest())):
      if key in state and str(state[key]) != str(ours):
        raise ValueError(f"loader state was saved with {key}={state[key]}, this loader has "
                         f"{ours}: resuming would not continue with the next batch")
    position = int(state["position"])
    if not 0 <= position <= len(self):
      raise ValueError(f"loader state position {position} is outside 0..{len(self)}")
    self.seed, self.epoch, self.position = int(state["seed"]), int(state["epoch"]), position
