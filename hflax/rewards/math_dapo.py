r"""The DAPO-style rule (verl's `math_dapo`): the answer is the last "Answer: ..." line.

verl routes the data sources `math_dapo`, `math`, `math_dapo_reasoning` and every source
whose name starts with `aime` to this rule (DAPO-Math-17k and the AIME sets prepared for
it ask the model to end with "Answer: $Answer"). Its semantics, reimplemented here:

- only the last 300 characters of the response are read (the longest MATH-500 answer
  has 159), and in them the last match of "Answer:" (any case, spaces allowed before
  the colon) up to the end of its line; a response without one answers "[INVALID]";
- answer and ground truth are both normalised as Minerva's evaluation does (see
  normalize_final_answer) and compared as strings;
- the score is 1.0 when they are equal and -1.0 otherwise (a wrong answer is punished,
  not just unrewarded), returned as {"score", "acc" (bool), "pred" (the normalised
  answer)}: validation then reports `acc` as the core metric, as verl does.
"""
from __future__ import annotations

import re

_TAIL_CHARS = 300
_ANSWER_LINE = re.compile(r"answer\s*:\s*([^\n]+)", re.IGNORECASE)
NO_ANSWER = "[INVALID]"

# Replacements applied in this order (before the removals below); the order matters, e.g.
# "\text{m}" becomes "\text{}", which a removal then deletes.
_REPLACEMENTS = (("an ", ""), ("a ", ""), (".$", "$"), ("\\$", ""), ("\\ ", ""), (" ", ""),
                 ("mbox", "text"), (",\\text{and}", ","), ("\\text{and}", ","),
                 ("\\text{m}", "\\text{}"))
# Units, filler words and spacing deleted wherever they occur, in this order.
_DELETIONS = ("square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units",
              "\\ldots", "sue", "points", "feet", "minutes", "digits", "cents", "degrees", "cm",
              "gm", "pounds", "meters", "meals", "edges", "students", "childrentickets",
              "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2",
              "\\text{}^3", "\\text{\n}", "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}",
              "\\;", ",\\!", "{,}", '"', "\\dots")
# A line holding two "$" keeps only what lies between the first two, as "$...$".
_FIRST_DOLLAR_PAIR = re.compile(r"[^\n$]*\$([^\n$]*)\$[^\n]*")
# \text{x}, then \textbf{x}, then \overline{x} -> x (up to the first closing brace).
_UNWRAPS = tuple(re.compile(r"\\" + command + r"\{(.*?)\}")
                 for command in ("text", "textbf", "overline"))
# \boxed{...} -> its contents, up to the line's last closing brace.
_BOXED = re.compile(r"\\boxed\{(.*)\}")
# Shorthand TeX: \frac12 -> \frac{1}{2}, \sqrt3 -> \sqrt{3}.
_FRAC_SHORT = re.compile(r"frac([^{])(.)")
_SQRT_SHORT = re.compile(r"sqrt([^{])")


def normalize_final_answer(answer: str) -> str:
  """A final answer in the canonical form Minerva's (and verl's math_dapo) comparison uses:
  the part after the last "=", units and filler words dropped, LaTeX wrappers removed,
  shorthand fractions and roots braced, thousands separators of whole numbers dropped."""
  text = str(answer).rsplit("=", 1)[-1]
  for old, new in _REPLACEMENTS:
    text = text.replace(old, new)
  for unwanted in _DELETIONS:
    text = text.replace(unwanted, "")
  text = _FIRST_DOLLAR_PAIR.sub(lambda m: f"${m[1]}$", text)
  for unwrap in _UNWRAPS:  # one command at a time: nested wrappers resolve that way
    text = unwrap.sub(lambda m: m[1], text)
  text = _BOXED.sub(lambda m: m[1], text)
  text = _FRAC_SHORT.sub(lambda m: f"frac{{{m[1]}}}{{{m[2]}}}", text)
  text = _SQRT_SHORT.sub(lambda m: f"sqrt{{{m[1]}}}", text)
  text = text.replace("$", "")
  if text.replace(",", "").isdigit():
    text = text.replace(",", "")
  return text.strip()


def final_answer(response_text: str) -> str:
  """The normalised answer of the response's last "Answer:" line in its last 300
  characters ("[INVALID]", normalised, when there is none)."""
  found = _ANSWER_LINE.findall(response_text[-_TAIL_CHARS:])
  return normalize_final_answer(found[-1] if found else NO_ANSWER)


def math_dapo(response_text: str, ground_truth, extra_info: dict | None = None) -> dict:
  """{"score": 1.0 or -1.0, "acc": whether the answer is right, "pred": the answer read}."""
  pred = final_answer(response_text)
  correct = pred == normalize_final_answer(str(ground_truth))
  return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": pred}
