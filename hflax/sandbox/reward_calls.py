"""Loading a user's reward function from its file and calling it in its convention
(verl's by keyword, or hflax's by position: see hflax.rewards.registry), and scoring a
batch of rows with it inside a worker of hflax.sandbox's pool.

Imports nothing heavy (no JAX, no rule rewards): a pool worker starts in a moment.
"""
from __future__ import annotations

import hashlib
import importlib.util
import inspect
import os
import sys
from typing import Any, Callable

RewardFn = Callable[[str, object, "dict | None"], float]


def load_reward_function(path: str | os.PathLike, name: str) -> RewardFn:
  """Imports the Python file at `path` and returns its function `name`."""
  path = os.path.abspath(os.path.expanduser(os.fspath(path)))
  fn = pick_function(import_file(path), path, name)
  reward_caller(fn)  # a signature no convention can call is refused now, not mid-run
  return fn


def import_file(path: str):
  """The module the Python file at `path` defines (the file runs: its own exceptions
  propagate)."""
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
  return module


def pick_function(module, path: str, name: str):
  """module's callable `name`; ValueError or TypeError naming what the file has instead."""
  if not hasattr(module, name):
    functions = sorted(k for k, v in vars(module).items()
                       if callable(v) and not k.startswith("_"))
    raise ValueError(f"{path} defines no {name!r}; callables it defines: "
                     f"{', '.join(functions) or 'none'}")
  fn = getattr(module, name)
  if not callable(fn):
    raise TypeError(f"{path}: {name!r} is not callable (its type is {type(fn).__name__})")
  return fn


# verl's reward managers pass these, by keyword, to every compute_score.
VERL_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
_NAMED = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD,
               inspect.Parameter.VAR_POSITIONAL)


def describe_reward_fn(fn) -> str:
  """'compute_score (my_reward.py)': how errors name a reward function."""
  if isinstance(fn, PooledRewardFn):
    return fn.description
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


# -- in a pool worker -----------------------------------------------------------------------
_loaded: dict[tuple[str, str], Callable] = {}  # a worker imports each file once


def _function(path: str, name: str):
  if (path, name) not in _loaded:
    _loaded[path, name] = pick_function(import_file(path), path, name)
  return _loaded[path, name]


def check_in_worker(path: str, name: str) -> tuple[str, str]:
  """("ok", its description) or ("refused", why): the file imports (its own exceptions
  propagate, as the pool reports them) and defines a function a convention can call."""
  module = import_file(path)
  try:
    fn = pick_function(module, path, name)
    reward_caller(fn)
  except (ValueError, TypeError) as e:
    return "refused", str(e)
  _loaded[path, name] = fn
  return "ok", describe_reward_fn(fn)


def score_rows_in_worker(path: str, name: str, texts, truths, infos, sources) -> list:
  """Each row's raw result; the row being scored goes to the pool as progress, so a
  death or hang names it."""
  from hflax.sandbox.pool import report_progress
  call = reward_caller(_function(path, name))
  results = []
  for row, args in enumerate(zip(texts, truths, infos, sources)):
    report_progress(row)
    results.append(call(*args))
  return results


# -- in the trainer -------------------------------------------------------------------------
_USER_EXITS = ("SystemExit", "KeyboardInterrupt", "GeneratorExit")


class PooledRewardFn:
  """A user's reward function that runs in a worker process of its own pool: its
  os._exit, segfault, hang or signal ends the worker and comes back as one ValueError
  naming the function, its file and the row. Loaded (imported) in the worker at once, so
  a file that fails to import is refused before any step."""

  def __init__(self, path: str | os.PathLike, name: str, timeout_s: float | None = None,
               memory_limit_gb: float | None = None, field: str = "reward"):
    from hflax.sandbox.pool import checked_pool
    self.path = os.path.abspath(os.path.expanduser(os.fspath(path)))
    self.name, self.timeout_s = name, timeout_s or None
    self.memory_limit_gb, self.field = memory_limit_gb or None, field
    if not os.path.isfile(self.path):
      raise FileNotFoundError(f"reward function file {self.path!r} does not exist")
    self.description = f"{name} ({os.path.basename(self.path)})"
    limit = int(self.memory_limit_gb * 2**30) if self.memory_limit_gb else None
    self.pool, self.description = checked_pool(
        check_in_worker, self.path, name, memory_limit_bytes=limit, timeout_s=self.timeout_s,
        failed=lambda out: f"importing it {self._what(out)}")

  def _what(self, out) -> str:
    """What went wrong, as 'raised KeyboardInterrupt()' or Outcome.describe() says."""
    if out.kind == "raised" and out.error_type in _USER_EXITS:
      at = f" ({out.where})" if out.where else ""
      return f"raised {out.error_type}({out.message}){at}"
    if out.kind == "raised" and out.error_type == "MemoryError" and self.memory_limit_gb:
      return (f"{out.describe()}: over its worker's memory limit, {self.field}."
              f"memory_limit_gb={self.memory_limit_gb:g}")
    return out.describe()

  def score_rows(self, texts, truths, infos, sources) -> list:
    out = self.pool.call(score_rows_in_worker, self.path, self.name, list(texts),
                         list(truths), list(infos), list(sources), timeout_s=self.timeout_s)
    if out.ok:
      return out.value
    row = f" on row {out.progress}" if out.progress is not None else ""
    if out.kind == "timed_out":
      raise ValueError(f"reward function {self.description} took longer than timeout_s="
                       f"{self.timeout_s:g} s on a batch of {len(texts)} responses (at "
                       f"row {out.progress}; its worker process was killed)")
    raise ValueError(f"reward function {self.description} {self._what(out)}{row}")

  def close(self):
    self.pool.close()
