"""Which rule reward judges which data_source, and loading a user's reward from a file.

Every reward function has the signature (response_text, ground_truth, extra_info) -> float,
or -> {"score": float, "pred": the answer it read, ...} as verl's may return; a rule's
answer for majority votes comes from its extractor in _PREDICTIONS.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from typing import Callable

from hflax.rewards.competition_math import boxed_answer, math_boxed, math_ground_truth
from hflax.rewards.rules import (arithmetic_exact_match, arithmetic_ground_truth,
                                 arithmetic_last_integer, extract_gsm8k_answer, gsm8k,
                                 last_integer, leading_integer)

RewardFn = Callable[[str, object, "dict | None"], float]

_BY_DATA_SOURCE: dict[str, RewardFn] = {
    "arithmetic": arithmetic_exact_match,
    "arithmetic_chat": arithmetic_last_integer,  # the task's chat form, for instruct models
    "openai/gsm8k": gsm8k,  # the data_source verl's GSM8K preprocessing writes
    "gsm8k": gsm8k,
    # The data_source names verl's MATH preprocessing and MATH-500 evaluation write.
    **dict.fromkeys(("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval",
                     "HuggingFaceH4/MATH-500", "math"), math_boxed),
}


# Rules whose ground truth has a required form, checked when the data loads.
_GROUND_TRUTH_CHECKS: dict[RewardFn, Callable] = {arithmetic_exact_match: arithmetic_ground_truth,
                                                   arithmetic_last_integer: arithmetic_ground_truth,
                                                   math_boxed: math_ground_truth}


# What each rule reads as a response's answer: majority votes in validation count these.
_PREDICTIONS: dict[RewardFn, Callable[[str], object]] = {
    arithmetic_exact_match: leading_integer, arithmetic_last_integer: last_integer,
    gsm8k: extract_gsm8k_answer, math_boxed: boxed_answer}


def prediction_fn(data_source: str | None) -> Callable[[str], object] | None:
  """The answer extractor of the data source's rule reward, if it has one."""
  return _PREDICTIONS.get(_BY_DATA_SOURCE.get(data_source))


def check_rule_rows(dataset, where: str) -> None:
  """Raises naming the file and row when a row's data_source has no rule reward, or its
  ground truth cannot be judged by that rule: before training, not at the step that
  samples the row."""
  for i, row in enumerate(dataset):
    source = row["data_source"]
    if source not in _BY_DATA_SOURCE:
      raise ValueError(f"{where} ({dataset.source}): row {i}: no rule reward for data_source "
                       f"{source!r}; known: {', '.join(reward_data_sources())} (or set "
                       "custom_fn)")
    check = _GROUND_TRUTH_CHECKS.get(_BY_DATA_SOURCE[source])
    if check is not None:
      try:
        check(row["reward_model"]["ground_truth"])
      except ValueError as e:
        raise ValueError(f"{where} ({dataset.source}): row {i}: {e}") from None


def reward_data_sources() -> list[str]:
  return sorted(_BY_DATA_SOURCE)


def register_reward_fn(data_source: str, fn: RewardFn, override: bool = False) -> None:
  """Makes `fn` the default reward for rows of `data_source`."""
  if not callable(fn):
    raise TypeError(f"reward for {data_source!r} must be callable, got {type(fn).__name__}")
  if data_source in _BY_DATA_SOURCE and not override:
    raise ValueError(f"data_source {data_source!r} already has a reward; pass override=True")
  _BY_DATA_SOURCE[data_source] = fn


def default_reward_fn(data_source: str) -> RewardFn:
  if data_source not in _BY_DATA_SOURCE:
    raise ValueError(f"no rule reward for data_source {data_source!r}; known: "
                     f"{', '.join(reward_data_sources())} (register one with "
                     "register_reward_fn, or pass a custom reward function)")
  return _BY_DATA_SOURCE[data_source]


def load_reward_function(path: str | os.PathLike, name: str) -> RewardFn:
  """Imports the Python file at `path` and returns its function `name`."""
  path = os.path.abspath(os.path.expanduser(os.fspath(path)))
  if not os.path.isfile(path):
    raise FileNotFoundError(f"reward function file {path!r} does not exist")
  # A name unique per path: two users' reward.py files must not replace each other.
  digest = hashlib.sha1(path.encode()).hexdigest()[:12]
  module_name = f"hflax_user_reward_{digest}"
  spec = importlib.util.spec_from_file_location(module_name, path)
  if spec is None or spec.loader is None:
    raise ValueError(f"cannot import {path!r} as a Python module (is it a .py file?)")
  module = importlib.util.module_from_spec(spec)
  # Registered before running so the file's own dataclasses and pickling can find it.
  sys.modules[module_name] = module
  try:
    spec.loader.exec_module(module)
  except BaseException:
    del sys.modules[module_name]
    raise
  if not hasattr(module, name):
    functions = sorted(k for k, v in vars(module).items()
                       if callable(v) and not k.startswith("_"))
    raise ValueError(f"{path} defines no {name!r}; callables it defines: "
                     f"{', '.join(functions) or 'none'}")
  fn = getattr(module, name)
  if not callable(fn):
    raise TypeError(f"{path}: {name!r} is not callable (its type is {type(fn).__name__})")
  return fn
