"""Which rule reward judges which data_source. A user's reward is loaded from its file and
called by hflax.sandbox.reward_calls (re-exported here), in one of two conventions, told
apart by its parameter names:

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

from typing import Callable

from hflax.rewards.competition_math import boxed_answer, math_boxed, math_ground_truth
from hflax.rewards.math_dapo import math_dapo
from hflax.rewards.qa import qa_exact_match, qa_targets, tagged_answer
from hflax.rewards.rules import (arithmetic_exact_match, arithmetic_ground_truth,
                                 arithmetic_last_integer, arithmetic_tool_answer,
                                 extract_gsm8k_answer, gsm8k,
                                 gsm8k_ground_truth, last_integer, leading_integer)
from hflax.sandbox.reward_calls import (VERL_ARGUMENTS, describe_reward_fn,  # noqa: F401
                                         load_reward_function, reward_caller,
                                         uses_verl_signature)
from hflax.rewards.verified_math import (math_verified, math_verify_available,
                                         require_math_verify, verified_answer)

RewardFn = Callable[[str, object, "dict | None"], float]


def math_answer(response_text: str, ground_truth, extra_info: dict | None = None) -> float:
  r"""MATH-style sources: math-verify when it is installed, else hflax's \boxed{} rule.

  verl's default for these sources (lighteval/MATH, DigitalLearningGmbH/MATH-lighteval,
  HuggingFaceH4/MATH-500) is its hand-written boxed-answer normaliser, with math-verify
  the documented upgrade a user switches on by hand; hflax uses the upgrade when the
  `math` extra is installed and keeps its own normaliser (competition_math, which like
  verl's compares normalised strings, and also compares plain numbers by value) as the
  fallback. Both score 1.0 or 0.0. `math_verifier()` says which one is in use.
  """
  if math_verify_available():
    return math_verified(response_text, ground_truth, extra_info)
  return math_boxed(response_text, ground_truth, extra_info)


def math_answer_pred(response_text: str):
  return verified_answer(response_text) if math_verify_available() else boxed_answer(
      response_text)


def math_verifier() -> str:
  """Which checker judges the MATH-style sources here: "math-verify" or "hflax"."""
  return "math-verify" if math_verify_available() else "hflax"


def prime_math(response_text: str, ground_truth, extra_info: dict | None = None) -> float:
  r"""The NuminaMath sources: verl judges them with PRIME's sympy grader (an answer after
  "answer:"/"answer is"/\boxed, compared symbolically, 1 or 0); hflax asks math-verify,
  which extracts and compares answers the same way. Needs the `math` extra."""
  require_math_verify("the NuminaMath data sources' rule reward")
  return math_verified(response_text, ground_truth, extra_info)


# The data_source names verl's default_compute_score routes, to the rule it routes them to
# (verl/utils/reward_score/__init__.py), plus hflax's own tasks.
_MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
_DAPO_SOURCES = ("math_dapo", "math", "math_dapo_reasoning")  # and every "aime..." below
_NUMINA_SOURCES = ("numina_aops_forum", "numina_synthetic_math", "numina_amc_aime",
                   "numina_synthetic_amc", "numina_cn_k12", "numina_olympiads")
_SEARCH_R1_SOURCES = tuple(f"searchR1_{name}" for name in (
    "nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle"))

_BY_DATA_SOURCE: dict[str, RewardFn] = {
    "arithmetic": arithmetic_exact_match,
    "arithmetic_chat": arithmetic_last_integer,  # the task's chat form, for instruct models
    "arithmetic_tools": arithmetic_tool_answer,  # with a calculator, over several turns
    "openai/gsm8k": gsm8k,  # the data_source verl's GSM8K preprocessing writes
    "gsm8k": gsm8k,
    # The data_source names verl's MATH preprocessing and MATH-500 evaluation write.
    **dict.fromkeys(_MATH_SOURCES, math_answer),
    # DAPO-Math-17k and the AIME sets ("Answer: ..." lines, scored 1 / -1).
    **dict.fromkeys(_DAPO_SOURCES, math_dapo),
    **dict.fromkeys(_NUMINA_SOURCES, prime_math),
    **dict.fromkeys(_SEARCH_R1_SOURCES, qa_exact_match),
}
# Sources matched by how their name starts, after the exact names above.
_BY_PREFIX: dict[str, RewardFn] = {"aime": math_dapo}

# Sources verl knows but hflax has no rule for, and why.
_UNSUPPORTED = {
    **dict.fromkeys(("codecontests", "apps", "codeforces", "taco"),
                    "verl judges it by running the response's code against test cases (in a "
                    "sandbox), which hflax does not do; set a custom reward function that "
                    "does"),
    "hiyouga/geometry3k": "a vision-language task (verl judges it with mathruler); hflax "
                          "trains text-only models",
}


# Rules whose ground truth has a required form, checked when the data loads.
_GROUND_TRUTH_CHECKS: dict[RewardFn, Callable] = {
    arithmetic_exact_match: arithmetic_ground_truth, gsm8k: gsm8k_ground_truth,
    arithmetic_last_integer: arithmetic_ground_truth,
    math_boxed: math_ground_truth, math_answer: math_ground_truth,
    math_dapo: math_ground_truth, prime_math: math_ground_truth, qa_exact_match: qa_targets}

# Rules that need an optional package: (check raising one line naming the extra).
_REQUIREMENTS: dict[RewardFn, Callable[[str], None]] = {prime_math: require_math_verify}


# What each rule reads as a response's answer: majority votes in validation count these
# (math_dapo returns its answer itself, as "pred").
_PREDICTIONS: dict[RewardFn, Callable[[str], object]] = {
    arithmetic_exact_match: leading_integer, arithmetic_last_integer: last_integer,
    gsm8k: extract_gsm8k_answer, math_boxed: boxed_answer, math_answer: math_answer_pred,
    prime_math: verified_answer, qa_exact_match: tagged_answer}


def _lookup(data_source) -> RewardFn | None:
  fn = _BY_DATA_SOURCE.get(data_source)
  if fn is None and isinstance(data_source, str):
    fn = next((f for prefix, f in _BY_PREFIX.items() if data_source.startswith(prefix)), None)
  return fn


def prediction_fn(data_source: str | None) -> Callable[[str], object] | None:
  """The answer extractor of the data source's rule reward, if it has one."""
  return _PREDICTIONS.get(_lookup(data_source))


def check_rule_available(data_source: str) -> str:
  """Raises one line when rows of `data_source` cannot be judged by a rule here (an
  unknown source, one verl judges in a way hflax does not, or one whose rule needs an
  optional extra that is not installed, naming the pip command); returns the rule's
  name otherwise (e.g. to log which checker a run uses)."""
  fn = _lookup(data_source)
  if fn is None:
    if data_source in _UNSUPPORTED:
      raise ValueError(f"no rule reward for data_source {data_source!r}: "
                       f"{_UNSUPPORTED[data_source]}")
    raise ValueError(f"no rule reward for data_source {data_source!r}; known: "
                     f"{', '.join(reward_data_sources())} (register one with "
                     "register_reward_fn, or set a custom reward function)")
  requirement = _REQUIREMENTS.get(fn)
  if requirement is not None:
    requirement(f"data_source {data_source!r}")
  if fn is math_answer:
    return f"math_answer ({math_verifier()})"
  return getattr(fn, "__name__", repr(fn))


def check_rule_rows(dataset, where: str) -> None:
  """Raises naming the file and row when a row's data_source has no rule reward (or its
  rule needs an extra that is not installed), or it has no ground truth, or its ground
  truth cannot be judged by that rule: before training, not at the step that samples the
  row."""
  checked = set()

  def fail(i, problem):
    path, local = dataset.locate(i) if hasattr(dataset, "locate") else (dataset.source, i)
    raise ValueError(f"{where} ({path}): row {local}: {problem}") from None

  for i, row in enumerate(dataset):
    source = row["data_source"]
    if source not in checked:
      try:
        check_rule_available(source)
      except ValueError as e:
        fail(i, e)
      checked.add(source)
    truth = row["reward_model"]["ground_truth"]
    if truth is None:
      fail(i, f"no reward_model.ground_truth, which the rule reward for data_source "
              f"{source!r} judges by")
    check = _GROUND_TRUTH_CHECKS.get(_lookup(source))
    if check is not None:
      try:
        check(truth)
      except ValueError as e:
        fail(i, e)


def reward_data_sources() -> list[str]:
  """The data sources with a rule ("aime*": every source whose name starts so)."""
  return sorted([*_BY_DATA_SOURCE, *(f"{prefix}*" for prefix in _BY_PREFIX)])


def register_reward_fn(data_source: str, fn: RewardFn, override: bool = False) -> None:
  """Makes `fn` the default reward for rows of `data_source`."""
  if not callable(fn):
    raise TypeError(f"reward for {data_source!r} must be callable, got {type(fn).__name__}")
  if data_source in _BY_DATA_SOURCE and not override:
    raise ValueError(f"data_source {data_source!r} already has a reward; pass override=True")
  _BY_DATA_SOURCE[data_source] = fn


def default_reward_fn(data_source: str) -> RewardFn:
  """The rule for rows of `data_source`; ValueError (one line) when there is none usable,
  see check_rule_available."""
  check_rule_available(data_source)
  return _lookup(data_source)
