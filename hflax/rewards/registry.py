"""Which rule reward judges which data_source, and loading a user's reward from a file.

Two calling conventions for a reward function, told apart by its parameter names:

- verl's: `compute_score(data_source, solution_str, ground_truth, extra_info=None)`,
  called by keyword, as verl's reward managers call it. A function is called this way
  when it has a parameter named `solution_str` or `data_source`, or takes only
  `**kwargs`; it gets those of the four arguments it names (all four with `**kwargs`).
  A required parameter outside the four is refused when the function is loaded: verl
  would not pass it either.
- hflax's: `fn(response_text, ground_truth, extra_info)`, called by position: every other
  function, the built-in rules included.

Either returns a number, or a dict {"score": number, "pred": the answer it read, "acc":
..., other numbers} as verl's may: "score" is the reward, "pred" feeds majority votes,
and the other numeric entries are reported per data source in validation (verl's
`reward_extra_info`). A rule's answer for majority votes comes from its extractor in
_PREDICTIONS.
"""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable

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
  reward_caller(fn)  # a signature no convention can call is refused now, not mid-run
  return fn


# verl's reward managers pass these, by keyword, to every compute_score.
VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
               inspect.Parameter.VAR_POSITIONAL)


def describe_reward_fn(fn) -> str:
  """'compute_score (my_reward.py)': how errors name a reward function."""
  target = getattr(fn, "func", fn)  # a functools.partial names what it wraps
  name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) \
      or type(target).__name__
  code = getattr(target, "__code__", None) or getattr(getattr(target, "__call__", None),
                                                      "__code__", None)
  return f"{name} ({os.path.basename(code.co_filename)})" if code is not None else name


def uses_verl_signature(fn) -> bool:
  """Whether `fn` is called verl's way (by keyword): see the module docstring."""
  try:
    params = list(inspect.signature(fn).parameters.values())
  except (TypeError, ValueError):  # no signature to read (some builtins): hflax's way
    return False
  names = {p.name for p in params if p.kind in _NAMED}
  if names & {"solution_str", "data_source"}:
    return True
  takes_kwargs = any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params)
  return takes_kwargs and not any(p.kind in _POSITIONAL for p in params)


def reward_caller(fn) -> Callable[[str, Any, Any, Any], Any]:
  """call(response_text, ground_truth, extra_info, data_source) -> fn's result, in fn's
  convention. Raises ValueError naming fn when verl's convention cannot satisfy it."""
  if not uses_verl_signature(fn):
    return lambda text, truth, info, source: fn(text, truth, info)
  params = inspect.signature(fn).parameters.values()
  if any(p.kind == inspect.Parameter.VAR_KEYWORD for p in params):
    passed = VERL_ARGUMENTS
  else:
    passed = tuple(a for a in VERL_ARGUMENTS if a in {p.name for p in params if p.kind in _NAMED})
  missing = [p.name for p in params if p.default is inspect.Parameter.empty and (
      p.kind == inspect.Parameter.POSITIONAL_ONLY
      or (p.kind in _NAMED and p.name not in VERL_ARGUMENTS))]
  if missing:
    raise ValueError(f"reward function {describe_reward_fn(fn)} is called verl's way (by "
                     f"keyword: {', '.join(VERL_ARGUMENTS)}) but also requires "
                     f"{', '.join(map(repr, missing))}, which that call does not pass; give "
                     "it a default")

  def call(text, truth, info, source):
    given = dict(data_source=source, solution_str=text, ground_truth=truth, extra_info=info)
    return fn(**{name: given[name] for name in passed})
  return call
