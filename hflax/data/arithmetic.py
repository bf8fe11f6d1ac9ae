"""The built-in RLVR task, so the default job needs no downloads: multi-digit arithmetic.

Prompts are short ("What is 23+45?") because a byte tokenizer spends one token per
character. The expected response is just the number followed by the end token ("68"),
which hflax.rewards.arithmetic_exact_match scores; a tiny model can learn that format.

Each operand draws its digit count uniformly from `digits`, then a value with that many
digits, so small operands are not swamped by large ones (with digits=(1, 2), uniform
values would make 90% of the operands two-digit). Train and validation never share a
question: questions are drawn without repetition, the first num_train go to train.
"""
from __future__ import annotations

import operator
import random

from hflax.data.schema import PromptDataset

OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
DATA_SOURCE = "arithmetic"
# data_source -> its default question. "arithmetic_chat" is the form a pretrained instruct
# model is asked in (judged by the last integer of its answer, see hflax.rewards.rules).
TEMPLATES = {"arithmetic": "What is {a}{op}{b}?",
             "arithmetic_chat": "What is {a}{op}{b}? Answer with just the number.",
             # multi-turn: the calculator's result, then the answer (rollout.multi_turn)
             "arithmetic_tools": "What is {a}{op}{b}? Use the calculator tool, then answer "
                                 "with just the number."}


def _digit_range(digits: int | tuple[int, int]) -> tuple[int, int]:
  low, high = (digits, digits) if isinstance(digits, int) else tuple(digits)
  if not 1 <= low <= high:
    raise ValueError(f"digits must be a count >= 1 or a (min, max) range, got {digits!r}")
  return low, high


def _question_count(low: int, high: int, ops: str, allow_negative: bool) -> int:
  values = 10 ** high - (0 if low == 1 else 10 ** (low - 1))
  ordered_pairs, unordered_pairs = values * values, values * (values + 1) // 2
  # Without negatives, a - b is asked with a >= b only, halving the distinct questions.
  return sum(unordered_pairs if op == "-" and not allow_negative else ordered_pairs
             for op in ops)


def arithmetic_task(num_train: int, num_val: int, seed: int = 0,
                    digits: int | tuple[int, int] = (1, 2), ops: str = "+-",
                    allow_negative: bool = False,
                    template: str = "", data_source: str = DATA_SOURCE,
                    ) -> tuple[PromptDataset, PromptDataset]:
  """(train, val) datasets of arithmetic questions in verl's row schema.

  data_source: "arithmetic" (bare answers, judged by their leading integer) or
  "arithmetic_chat" (sentences, judged by their last integer); template: the question
  ("" is the data source's own, TEMPLATES).

  digits: operand digit count, or an inclusive (min, max) range. ops: any of "+-*".
  allow_negative=False orders subtraction operands so answers are never negative.
  """
  if data_source not in TEMPLATES:
    raise ValueError(f"data_source must be one of {sorted(TEMPLATES)}, got {data_source!r}")
  template = template or TEMPLATES[data_source]
  low, high = _digit_range(digits)
  ops = "".join(dict.fromkeys(ops))
  if not ops or set(ops) - set(OPERATIONS):
    raise ValueError(f"ops must be a non-empty string of {''.join(OPERATIONS)!r}, got {ops!r}")
  if num_train < 0 or num_val < 0:
    raise ValueError(f"num_train and num_val must be >= 0, got {num_train}, {num_val}")
  wanted = num_train + num_val
  available = _question_count(low, high, ops, allow_negative)
  if wanted > available:
    raise ValueError(f"asked for {wanted} distinct questions but digits={digits!r}, ops={ops!r} "
                     f"allow only {available}; widen digits or ops")
  rng = random.Random(seed)

  def operand() -> int:
    count = rng.randint(low, high)
    return rng.randint(0 if count == 1 else 10 ** (count - 1), 10 ** count - 1)

  questions, seen = [], set()
  # Rejection sampling; the cap only matters when asking for nearly every question.
  for _ in range(50 * wanted + 10_000):
    if len(questions) == wanted:
      break
    a, op, b = operand(), rng.choice(ops), operand()
    if op == "-" and not allow_negative and a < b:
      a, b = b, a
    if (a, op, b) not in seen:
      seen.add((a, op, b))
      questions.append((a, op, b))
  if len(questions) < wanted:
    raise ValueError(f"found only {len(questions)} of {wanted} distinct questions by sampling; "
                     f"ask for fewer or widen digits={digits!r} / ops={ops!r}")

  def row(split: str, index: int, a: int, op: str, b: int) -> dict:
    return {"data_source": data_source,
            "prompt": [{"role": "user", "content": template.format(a=a, op=op, b=b)}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": str(OPERATIONS[op](a, b))},
            "extra_info": {"split": split, "index": index}}

  train = [row("train", i, *q) for i, q in enumerate(questions[:num_train])]
  val = [row("val", i, *q) for i, q in enumerate(questions[num_train:])]
  return (PromptDataset(train, source=f"arithmetic_task(seed={seed}, split=train)"),
          PromptDataset(val, source=f"arithmetic_task(seed={seed}, split=val)"))
