r"""Math answers checked by math-verify (HuggingFace's parser and symbolic comparison).

math-verify is an optional extra: `pip install 'hflax[math]'`. It is used the way verl's
`math_verify.compute_score` uses it: the ground truth is read as the contents of a
\boxed{}, the response's answer as a LaTeX answer or a plain expression, and the two
compared symbolically (equal expressions, sets, intervals, values to 6 decimals); 1.0
when they match, 0.0 otherwise, also when either cannot be parsed or the comparison
runs out of time.

math-verify bounds its own parsing with SIGALRM, which Python allows only in the main
thread; elsewhere (the scorer's timeout_s worker) those limits are off and the scorer's
time limit bounds the batch instead.
"""
from __future__ import annotations

import functools
import threading

EXTRA = "math"
INSTALL = f"pip install 'hflax[{EXTRA}]'"
_PARSE_SECONDS = 5


@functools.lru_cache(maxsize=None)
def _load():
  try:
    import math_verify
    from math_verify import ExprExtractionConfig, LatexExtractionConfig
  except ImportError:
    return None
  return math_verify, ExprExtractionConfig, LatexExtractionConfig


def math_verify_available() -> bool:
  return _load() is not None


def require_math_verify(what: str) -> None:
  """Raises one line naming the extra when math-verify is not installed."""
  if _load() is None:
    raise ValueError(f"{what} needs the math-verify package, which is not installed: "
                     f"{INSTALL}")


def _limit():
  return _PARSE_SECONDS if threading.current_thread() is threading.main_thread() else None


def _parse_answer(text: str):
  mv, expr_config, latex_config = _load()
  return mv.parse(text, [expr_config(), latex_config()], parsing_timeout=_limit())


def math_verified(response_text: str, ground_truth, extra_info: dict | None = None) -> float:
  """1.0 if math-verify finds the response's answer equal to the ground truth, else 0.0."""
  require_math_verify("the math-verify rule reward")
  mv, _, latex_config = _load()
  try:
    gold = mv.parse("\\boxed{" + str(ground_truth) + "}", [latex_config()],
                    parsing_timeout=_limit())
    answer = _parse_answer(response_text)
    if not gold or not answer:
      return 0.0
    return 1.0 if mv.verify(gold, answer, float_rounding=6, timeout_seconds=_limit()) else 0.0
  except Exception:  # noqa: BLE001 - math-verify's parse or timeout failures: no match
    return 0.0


def verified_answer(response_text: str) -> str | None:
  """The answer math-verify reads in a response, as text (for majority votes), or None."""
  if _load() is None:
    return None
  try:
    answer = _parse_answer(response_text)
  except Exception:  # noqa: BLE001
    return None
  return str(answer[0]) if answer else None
