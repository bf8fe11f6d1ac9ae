r"""The MATH-style rule: the answer is the last \boxed{...} of the response.

Competition-math data (MATH, MATH-500, and the sets prepared the same way) keep the final
answer as a LaTeX string, and solutions end with it boxed. Two answers match when they
are equal after normalisation, or when both are plain numbers (integers, decimals,
fractions, \frac{a}{b}) of equal value: "\dfrac{1}{2}", "\frac12", "1/2" and "0.5" are
one answer; "0.33" and "\frac{1}{3}" are not.

Normalisation drops what does not change an answer: spaces, \left and \right, spacing
commands, dollar signs, a degree sign, a percent sign, a trailing period, a unit in
\text{...} after the value, a leading "x =" and thousands separators; \dfrac and \tfrac
become \frac, and \frac12 or \sqrt2 get their braces. It does not decide mathematical
equivalence beyond that ("2\sqrt{2}" and "\sqrt{8}" differ).
"""
from __future__ import annotations

import re
from fractions import Fraction

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def _braced(text: str, open_at: int) -> str | None:
  """The contents of the brace group opening at text[open_at], or None if unclosed."""
  depth = 0
  for i in range(open_at, len(text)):
    depth += {"{": 1, "}": -1}.get(text[i], 0)
    if depth == 0:
      return text[open_at + 1:i]
  return None


def last_boxed(text: str) -> str | None:
  r"""The contents of the last \boxed{...} (or \fbox{...}, or "\boxed 5"), or None."""
  start = max(text.rfind(command) for command in _BOX_COMMANDS)
  if start < 0:
    return None
  rest = start + len(next(c for c in _BOX_COMMANDS if text.startswith(c, start)))
  after = text[rest:]
  if after.startswith("{"):
    return _braced(text, rest)
  if after.startswith(" "):  # "\boxed 5": up to the next space or "$"
    return re.split(r"[\s$]", after.strip())[0] or None
  return None


_SPACING = re.compile(r"\\[!,;:>]|\\ |\\quad|\\qquad")
_UNIT = re.compile(r"\\(?:text|mbox|mathrm)\{[^{}]*\}$")
_FRAC_ARGS = re.compile(r"\\frac(\{[^{}]*\}|\d)(\{[^{}]*\}|\d)")
_SQRT_ARG = re.compile(r"\\sqrt(\d)")
_THOUSANDS = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_ASSIGNMENT = re.compile(r"^[a-zA-Z]\w*=")
_NUMBER = re.compile(r"^-?(?:\d+\.?\d*|\.\d+)$")
_FRACTION = re.compile(r"^(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}$|^(-?\d+)/(\d+)$")


def _braces(arg: str) -> str:
  return arg if arg.startswith("{") else "{" + arg + "}"


def normalize_answer(answer: str) -> str:
  """A canonical string for a final answer (see the module docstring)."""
  s = str(answer).strip()
  s = s.replace("\\left", "").replace("\\right", "").replace("\\$", "").replace("$", "")
  s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")
  s = s.replace("^{\\circ}", "").replace("^\\circ", "").replace("\\%", "").replace("%", "")
  s = _SPACING.sub("", s).strip()
  s = _UNIT.sub("", s).strip()
  s = s.replace(" ", "").rstrip(".")
  if _ASSIGNMENT.match(s) and s.count("=") == 1:  # "x=3" -> "3"
    s = s.split("=", 1)[1]
  s = _FRAC_ARGS.sub(lambda m: f"\\frac{_braces(m[1])}{_braces(m[2])}", s)
  s = _SQRT_ARG.sub(lambda m: f"\\sqrt{{{m[1]}}}", s)
  if _THOUSANDS.match(s):
    s = s.replace(",", "")
  return s


def numeric_value(normalized: str) -> Fraction | None:
  """The exact value of a plain number or simple fraction, or None."""
  if _NUMBER.match(normalized):
    return Fraction(normalized)
  match = _FRACTION.match(normalized)
  if not match:
    return None
  sign, num, den, slash_num, slash_den = match.groups()
  num, den = (num, den) if num is not None else (slash_num, slash_den)
  if int(den) == 0:
    return None
  value = Fraction(int(num), int(den))
  return -value if sign else value


def same_answer(a: str, b: str) -> bool:
  a, b = normalize_answer(a), normalize_answer(b)
  if a == b:
    return True
  value_a, value_b = numeric_value(a), numeric_value(b)
  return value_a is not None and value_a == value_b


def boxed_answer(response_text: str) -> str | None:
  """The last boxed answer of a response in canonical form, so that answers the rule
  judges alike vote alike: a number as its exact value ("0.5", "\\frac12" -> "1/2")."""
  boxed = last_boxed(response_text)
  if boxed is None:
    return None
  normalized = normalize_answer(boxed)
  value = numeric_value(normalized)
  return normalized if value is None else str(value)


def math_ground_truth(ground_truth) -> str:
  if not str(ground_truth).strip():
    raise ValueError(f"math ground truth must be a non-empty answer, got {ground_truth!r}")
  return str(ground_truth)


def math_boxed(response_text: str, ground_truth: str, extra_info: dict | None = None) -> float:
  r"""1.0 if the response's last \boxed{} answer matches the ground truth, else 0.0. A
  ground truth that is itself a boxed solution is read the same way."""
  answer = last_boxed(response_text)
  if answer is None:
    return 0.0
  boxed_truth = last_boxed(str(ground_truth))
  truth = str(ground_truth) if boxed_truth is None else boxed_truth
  return 1.0 if same_answer(answer, truth) else 0.0
