"""Algorithms by name: each driver module describes itself once, next to its step.

  register_algorithm(Algorithm(name="my_algo", step=step, uses_critic=True))

is all a new algorithm needs besides its step function: the launcher reads the roles to
build, the config checks to run and how to feed the step from its description.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True, kw_only=True)
class Algorithm:
  name: str
  # step(roles, prompts, cfg: StepConfig, state: StepState) -> Batch of the step's rollouts
  step: Callable
  uses_critic: bool = False  # builds a critic (and trains it)
  uses_cost: bool = False  # builds a cost role (a model or a rule, from config.cost)
  # The step draws prompt batches itself from an iterator (DAPO's dynamic sampling)
  # instead of receiving one batch.
  takes_prompt_iterator: bool = False
  # check(config, fail) before any work; fail(field, why) raises naming config.<field>.
  check: Callable[[Any, Callable[[str, str], None]], None] | None = None


_ALGORITHMS: dict[str, Algorithm] = {}


def register_algorithm(algorithm: Algorithm, override: bool = False) -> Algorithm:
  name = algorithm.name
  if name in _ALGORITHMS and _ALGORITHMS[name] != algorithm and not override:
    raise ValueError(f"algorithm {name!r} is already registered (pass override=True)")
  _ALGORITHMS[name] = algorithm
  return algorithm


def unregister_algorithm(name: str) -> None:
  _ALGORITHMS.pop(name, None)


def get_algorithm(name: str) -> Algorithm:
  if name not in _ALGORITHMS:
    raise ValueError(f"unknown algorithm {name!r}; valid: {', '.join(algorithm_names())}")
  return _ALGORITHMS[name]


def algorithm_names() -> list[str]:
  return sorted(_ALGORITHMS)


def needs_samples_per_group(estimators: tuple[str, ...]):
  """A check for algorithms whose advantage estimators compare the samples of a prompt."""

  def check(c, fail):
    if c.algorithm.adv_estimator in estimators and c.rollout.n < 2:
      fail("rollout.n", f"{c.algorithm.adv_estimator} compares samples of one prompt: use n >= 2")
  return check
