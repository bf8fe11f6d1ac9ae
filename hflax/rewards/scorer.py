"""Scoring a batch of responses with rule rewards."""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from hflax.models.tokenizer import Tokenizer
from hflax.rewards.registry import RewardFn, default_reward_fn, prediction_fn


def _as_float(result: Any, data_source: str) -> float:
  # verl-style reward functions may return {"score": ..., other diagnostics}.
  if isinstance(result, dict):
    if "score" not in result:
      raise ValueError(f"reward for {data_source!r} returned a dict without 'score'")
    result = result["score"]
  return float(result)


def last_token_scores(scores_B: np.ndarray, response_mask_BxT: np.ndarray) -> np.ndarray:
  """[B, T] zeros with each score on its response's last valid token (position 0 if none)."""
  mask = np.asarray(response_mask_BxT, bool)
  width = mask.shape[1]
  has_tokens = mask.any(axis=1)
  last = np.where(has_tokens, width - 1 - np.argmax(mask[:, ::-1], axis=1), 0)
  out = np.zeros(mask.shape, np.float32)
  out[np.arange(mask.shape[0]), last] = scores_B
  return out


class RuleRewardScorer:
  """Scores responses with `reward_fn`, or with each sample's data_source default.

  Call with token ids [B, T] plus response_mask [B, T] (decoded here, special tokens
  skipped), or with a list of strings (response_mask then only shapes the token-level
  output). Returns a dict: scores [B] float32, response_text list, pred list (each
  response's answer, or None: see _pred), and token_level_scores [B, T] float32 (the score
  on the last valid response token) whenever a mask is known.
  """

  def __init__(self, tokenizer: Tokenizer | None = None, reward_fn: RewardFn | None = None):
    self.tokenizer, self.reward_fn = tokenizer, reward_fn

  def decode(self, response_ids_BxT, response_mask_BxT) -> list[str]:
    if self.tokenizer is None:
      raise ValueError("scoring token ids needs a tokenizer; pass one or pass strings")
    return self.tokenizer.decode_rows(response_ids_BxT, response_mask_BxT)

  def _fn(self, data_source: str | None) -> RewardFn:
    if self.reward_fn is not None:
      return self.reward_fn
    if data_source is None:
      raise ValueError("without a custom reward_fn every sample needs a data_source")
    return default_reward_fn(data_source)

  def _pred(self, result, text: str, data_source: str | None):
    """The answer a response gives, for majority votes: a custom reward's "pred", or what
    the data source's rule reads; None when neither says."""
    if isinstance(result, dict):
      return result.get("pred")
    extract = None if self.reward_fn is not None else prediction_fn(data_source)
    return None if extract is None else extract(text)

  def __call__(self, responses, ground_truth: Sequence, data_source: Sequence[str] | None = None,
               extra_info: Sequence[dict | None] | None = None,
               response_mask=None) -> dict[str, Any]:
    if isinstance(responses, (list, tuple)) and all(isinstance(r, str) for r in responses):
      texts = list(responses)
    else:
      if response_mask is None:
        raise ValueError("token id responses need a response_mask")
      texts = self.decode(responses, response_mask)
    size = len(texts)
    data_source = [None] * size if data_source is None else list(data_source)
    extra_info = [None] * size if extra_info is None else list(extra_info)
    for name, values in (("ground_truth", ground_truth), ("data_source", data_source),
                         ("extra_info", extra_info)):
      if len(values) != size:
        raise ValueError(f"{len(values)} {name} entries for {size} responses")
    results = [self._fn(source)(text, truth, info) for text, truth, source, info
               in zip(texts, ground_truth, data_source, extra_info)]
    scores = np.array([_as_float(r, s) for r, s in zip(results, data_source)], np.float32)
    out = {"scores": scores, "response_text": texts,
           "pred": [self._pred(r, text, source)
                    for r, text, source in zip(results, texts, data_source)]}
    if response_mask is not None:
      if np.shape(response_mask)[0] != size:
        raise ValueError(f"response_mask has {np.shape(response_mask)[0]} rows for {size} "
                         "responses")
      out["token_level_scores"] = last_token_scores(scores, response_mask)
    return out
