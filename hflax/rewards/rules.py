"""Rule rewards: pure functions (response_text, ground_truth, extra_info) -> float.

arithmetic_exact_match judges the leading number of the response. The built-in task asks
for just the number then the end token, so "68" is the ideal answer; "68 and more" is
still judged by its leading 68 (text after the number is ignored rather than punished, so
a tiny model is not penalised for what it says after answering). A response that does not
start with a number scores 0: the task's format is the bare number, and a number found
later in a response is as likely an echoed operand as an answer. "68.5" is a decimal,
not the integer 68, and scores 0; "1,234" reads as 1234.

arithmetic_last_integer judges the last integer of the response instead: the chat form of
the task ("What is 23+45? Answer with just the number.") is asked of pretrained instruct
models, which answer in sentences ("23 + 45 = 68."), where the result comes last.

gsm8k follows verl's rule: the answer is the number after the last "#### " marker, with
commas removed, compared exactly with the ground truth (also stripped of commas and
whitespace). Differences: a trailing sentence period is dropped ("#### 72." is 72), and
whitespace between "####" and the number is optional.
"""
from __future__ import annotations

import re

# An optional sign, then digits with optional thousands groups, not continuing into more
# digits or a decimal part (the lookahead stops "68.5" or "1,23" from matching a prefix).
_LEADING_INTEGER = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?!\d|[.,]\d)")
# An integer not glued to a word or a decimal point on its left ("97-59" is 97 and 59, and
# " -5" is -5), nor continuing into a decimal part on its right.
_ANY_INTEGER = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+|\d+)(?!\d|[.,]\d)")
_GSM8K_MARKED = re.compile(r"####\s*(-?[0-9.,]+)")
_ANY_NUMBER = re.compile(r"-?[0-9.,]+")


def leading_integer(text: str) -> int | None:
  """The integer the stripped text starts with, or None."""
  match = _LEADING_INTEGER.match(text.strip())
  return int(match.group().replace(",", "")) if match else None


def last_integer(text: str) -> int | None:
  """The last integer in the text, or None."""
  found = _ANY_INTEGER.findall(text)
  return int(found[-1].replace(",", "")) if found else None


def arithmetic_ground_truth(ground_truth) -> int:
  try:
    return int(str(ground_truth).strip())
  except ValueError:
    raise ValueError(f"arithmetic ground truth must be an integer, got {ground_truth!r}") from None


def arithmetic_exact_match(response_text: str, ground_truth: str,
                           extra_info: dict | None = None) -> float:
  """1.0 if the response's leading integer equals the ground truth, else 0.0."""
  return 1.0 if leading_integer(response_text) == arithmetic_ground_truth(ground_truth) else 0.0


def arithmetic_last_integer(response_text: str, ground_truth: str,
                            extra_info: dict | None = None) -> float:
  """1.0 if the response's last integer equals the ground truth, else 0.0."""
  return 1.0 if last_integer(response_text) == arithmetic_ground_truth(ground_truth) else 0.0


def arithmetic_tool_answer(response_text: str, ground_truth: str,
                           extra_info: dict | None = None, *, call_score: float = 0.0) -> float:
  """The tool task's reward: 1.0 when a multi-turn trajectory called a tool at least once,
  then ended with an answer (a turn without calls) whose last integer is the ground truth.
  Reads the agent loop's record in extra_info["agent"] (hflax.rollout.agents.rollout);
  the response text, which holds the tool messages too, is not searched.

  call_score: what a trajectory that is not right but made a well-formed call (one that
  parsed and ran without error) scores instead of 0, a shaping that gives GRPO's groups a
  signal while few trajectories are right (bind it with functools.partial and
  register_reward_fn); held-out accuracy should then be read with the default 0."""
  agent = (extra_info or {}).get("agent") or {}
  calls = agent.get("tool_calls", 0)
  well_formed = calls - agent.get("tool_errors", 0) >= 1
  if calls >= 1 and agent.get("stop") == "done" \
      and last_integer(agent.get("final_turn", "")) == arithmetic_ground_truth(ground_truth):
    return 1.0
  return call_score if well_formed else 0.0


def _clean_number(text: str) -> str:
  return text.replace(",", "").rstrip(".")


def extract_gsm8k_answer(response_text: str, method: str = "strict") -> str | None:
  """strict: the number after the last "####"; flexible: the last number anywhere."""
  if method == "strict":
    found = _GSM8K_MARKED.findall(response_text)
  elif method == "flexible":
    found = _ANY_NUMBER.findall(response_text)
  else:
    raise ValueError(f"gsm8k method must be 'strict' or 'flexible', got {method!r}")
  # Runs of only "." or "," (an ellipsis, a list separator) are not numbers.
  found = [cleaned for number in found if (cleaned := _clean_number(number)).strip("-.")]
  return found[-1] if found else None


def gsm8k_ground_truth(ground_truth) -> str:
  """A GSM8K answer is a number (with thousands commas, as GSM8K writes them): anything
  else could never equal an extracted answer, so every response would silently score 0."""
  text = _clean_number(str(ground_truth).strip())
  if not re.fullmatch(r"-?\d+(\.\d+)?", text):
    raise ValueError(f"gsm8k ground truth must be a number, got {ground_truth!r}")
  return text


def gsm8k(response_text: str, ground_truth: str, extra_info: dict | None = None, *,
          method: str = "strict", format_score: float = 0.0, score: float = 1.0) -> float:
  """`score` for a correct answer, `format_score` for a parseable wrong one, 0 for none."""
  answer = extract_gsm8k_answer(response_text, method)
  if answer is None:
    return 0.0
  return score if answer == _clean_number(str(ground_truth).strip()) else format_score
