"""Scoring a batch of responses with rule rewards or a user's reward function.

A reward function is called in verl's convention (by keyword: data_source, solution_str,
ground_truth, extra_info) when its parameter names are verl's, else in hflax's
(response_text, ground_truth, extra_info) by position: see hflax.rewards.registry.

User code is contained: whatever a reward function does, the scorer either returns
finite float32 scores or raises a one-line ValueError naming the function (and the row,
where one row is at fault):
- a return that is not a number (nor a dict with a numeric "score"), or is nan or inf;
- SystemExit, KeyboardInterrupt and any other BaseException that is not an Exception
  (a `sys.exit(0)` in a reward file must not end the run with status 0). Ordinary
  exceptions propagate unchanged, for the caller to report;
- a PooledRewardFn (a user's file, as the launcher loads it) is scored in its worker
  process: its os._exit, segfault, hang or signal is such a ValueError too, and its
  timeout_s (the pool's) kills the worker. The rest of this list is about in-process
  functions (the built-in rules, or a function passed in):
- with timeout_s, a batch that takes longer: the batch is then scored in a worker
  thread that the scorer waits on for at most timeout_s seconds. Python cannot stop a
  thread, so a function that hangs keeps running in the background (a daemon thread,
  which does not keep the process alive) and its results are discarded. Without
  timeout_s (the default) scoring runs in the calling thread, with no overhead.
"""
from __future__ import annotations

import math
import numbers
import threading
from typing import Any, Sequence

import numpy as np

from hflax.models.tokenizer import Tokenizer
from hflax.rewards.registry import (RewardFn, default_reward_fn, describe_reward_fn,
                                    prediction_fn, reward_caller)
from hflax.sandbox.reward_calls import PooledRewardFn


_FLOAT32_MAX = float(np.finfo(np.float32).max)


def _is_number(value) -> bool:
  return isinstance(value, (numbers.Real, np.bool_)) and not isinstance(value, str)


def _as_float(result: Any, fn, row: int) -> float:
  """The score in a reward function's result; ValueError naming fn and row otherwise."""
  value = result
  if isinstance(result, dict):  # verl-style: {"score": ..., other diagnostics}
    if "score" not in result:
      raise ValueError(f"reward function {describe_reward_fn(fn)} returned a dict without "
                       f"'score' for row {row} (keys: {', '.join(map(str, result))})")
    value = result["score"]
  if not _is_number(value):
    raise ValueError(f"reward function {describe_reward_fn(fn)} returned "
                     f"{_short(value)} ({type(value).__name__}) for row {row}; a reward is a "
                     "number or a dict with a numeric 'score'")
  value = float(value)
  if not math.isfinite(value) or abs(value) > _FLOAT32_MAX:
    raise ValueError(f"reward function {describe_reward_fn(fn)} returned {value} for row "
                     f"{row}; rewards must be finite (in float32, where scores are kept)")
  return value


def _short(value, limit: int = 60, quote: bool = True) -> str:
  text = (repr(value) if quote else str(value)).replace("\n", " ")
  return text if len(text) <= limit else text[:limit - 3] + "..."


def _extra_info(results: list) -> dict[str, list]:
  """verl's reward_extra_info: each numeric entry every row's dict result has ("pred"
  aside: votes read it), as one list over the rows."""
  if not results or not all(isinstance(r, dict) for r in results):
    return {}
  keys = [k for k in results[0] if k != "pred"
          and all(k in r and _is_number(r[k]) for r in results)]
  return {k: [float(r[k]) for r in results] for k in keys}


def last_token_scores(scores_B: np.ndarray, response_mask_BxT: np.ndarray) -> np.ndarray:
  """[B, T] zeros with each score on its response's last valid token (position 0 if none)."""
  mask = np.asarray(response_mask_BxT, bool)
  width = mask.shape[1]
  has_tokens = mask.any(axis=1)
  last = np.where(has_tokens, width - 1 - np.argmax(mask[:, ::-1], axis=1), 0)
  out = np.zeros(mask.shape, np.float32)
  out[np.arange(mask.shape[0]), last] = scores_B
  return out


def _raised(e: BaseException) -> str:
  """'SystemExit(0)', 'KeyboardInterrupt()': the exception as it was raised, short."""
  return f"{type(e).__name__}({_short(', '.join(map(repr, e.args)), quote=False)})"


class RuleRewardScorer:
  """Scores responses with `reward_fn`, or with each sample's data_source default.

  Call with token ids [B, T] plus response_mask [B, T] (decoded here, special tokens
  skipped), or with a list of strings (response_mask then only shapes the token-level
  output). Returns a dict: scores [B] float32, response_text list, pred list (each
  response's answer, or None: see _pred), reward_extra_info (the numeric entries of dict
  results, see _extra_info: what validation reports beside the reward, e.g. "acc"), and
  token_level_scores [B, T] float32 (the score on the last valid response token) whenever
  a mask is known.

  timeout_s: a limit in seconds on scoring one batch (None or 0: none); see the module
  docstring. reward_fn's signature is checked here, so a function no convention can call
  is refused before any scoring.
  """

  def __init__(self, tokenizer: Tokenizer | None = None, reward_fn: RewardFn | None = None,
               timeout_s: float | None = None):
    if timeout_s is not None and (not _is_number(timeout_s) or not math.isfinite(timeout_s)
                                  or timeout_s < 0):
      raise ValueError(f"reward timeout_s must be a finite number of seconds >= 0 (0: no "
                       f"limit), got {timeout_s!r}")
    self.tokenizer, self.reward_fn = tokenizer, reward_fn
    self.timeout_s = float(timeout_s) if timeout_s else None
    self._callers = {}
    if reward_fn is not None and not isinstance(reward_fn, PooledRewardFn):
      self._caller(reward_fn)

  def _caller(self, fn):
    # By id, kept with the function (so the id stays its own): a callable object need
    # not be hashable.
    entry = self._callers.get(id(fn))
    if entry is None:
      entry = self._callers[id(fn)] = (fn, reward_caller(fn))
    return entry[1]

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

  def _score_rows(self, fns, texts, truths, sources, infos) -> list:
    results = []
    for row, (fn, text, truth, source, info) in enumerate(
        zip(fns, texts, truths, sources, infos)):
      try:
        results.append(self._caller(fn)(text, truth, info, source))
      except Exception:
        raise
      except BaseException as e:  # sys.exit, KeyboardInterrupt, ... from the user's code
        raise ValueError(f"reward function {describe_reward_fn(fn)} raised {_raised(e)} on "
                         f"row {row}") from None
    return results

  def _run(self, fns, texts, truths, sources, infos) -> list:
    if isinstance(self.reward_fn, PooledRewardFn):  # its worker process keeps the limit
      return self.reward_fn.score_rows(texts, truths, infos, sources)
    if self.timeout_s is None:
      return self._score_rows(fns, texts, truths, sources, infos)
    outcome = {}

    def work():
      try:
        outcome["results"] = self._score_rows(fns, texts, truths, sources, infos)
      except BaseException as e:  # noqa: BLE001 - handed to the waiting thread
        outcome["error"] = e

    worker = threading.Thread(target=work, name="hflax-reward", daemon=True)
    worker.start()
    worker.join(self.timeout_s)
    if worker.is_alive():
      names = ", ".join(dict.fromkeys(describe_reward_fn(fn) for fn in fns))
      raise ValueError(f"reward function {names} took longer than timeout_s="
                       f"{self.timeout_s:g} s on a batch of {len(texts)} responses")
    if "error" in outcome:
      raise outcome["error"]
    return outcome["results"]

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
    by_source = {}  # one registry look-up per distinct source, not per row
    fns = [by_source[source] if source in by_source else by_source.setdefault(
        source, self._fn(source)) for source in data_source]
    results = self._run(fns, texts, ground_truth, data_source, extra_info)
    scores = np.array([_as_float(r, fn, i) for i, (r, fn) in enumerate(zip(results, fns))],
                      np.float32)
    out = {"scores": scores, "response_text": texts,
           "pred": [self._pred(r, text, source)
                    for r, text, source in zip(results, texts, data_source)],
           "reward_extra_info": _extra_info(results)}
    if response_mask is not None:
      if np.shape(response_mask)[0] != size:
        raise ValueError(f"response_mask has {np.shape(response_mask)[0]} rows for {size} "
                         "responses")
      out["token_level_scores"] = last_token_scores(scores, response_mask)
    return out
