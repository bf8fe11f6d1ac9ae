"""The built-in arithmetic task: correct answers, verl schema, disjoint splits, determinism."""
import re

import pytest

from hflax.data import arithmetic_task
from hflax.rewards import arithmetic_exact_match

QUESTION = re.compile(r"What is (\d+)([-+*])(\d+)\?")


def question(row):
  return row["prompt"][0]["content"]


def test_answers_match_eval_of_the_question():
  train, val = arithmetic_task(300, 50, seed=1, ops="+-*")
  for row in list(train) + list(val):
    a, op, b = QUESTION.fullmatch(question(row)).groups()
    assert row["reward_model"]["ground_truth"] == str(eval(f"{a}{op}{b}"))
    assert row["data_source"] == "arithmetic" and row["reward_model"]["style"] == "rule"
    assert arithmetic_exact_match(row["reward_model"]["ground_truth"],
                                  row["reward_model"]["ground_truth"]) == 1.0


def test_splits_are_disjoint_and_sized():
  train, val = arithmetic_task(2000, 500, seed=0)
  train_questions, val_questions = {question(r) for r in train}, {question(r) for r in val}
  assert len(train) == len(train_questions) == 2000 and len(val) == len(val_questions) == 500
  assert not train_questions & val_questions
  assert {r["extra_info"]["split"] for r in train} == {"train"}
  assert [r["extra_info"]["index"] for r in val] == list(range(500))


def test_default_has_no_negative_answers_and_mixes_digit_counts():
  train, _ = arithmetic_task(400, 0, seed=3)
  answers = [int(r["reward_model"]["ground_truth"]) for r in train]
  assert min(answers) >= 0
  operands = [int(x) for r in train for x in QUESTION.fullmatch(question(r)).group(1, 3)]
  one_digit = sum(x < 10 for x in operands) / len(operands)
  assert 0.3 < one_digit < 0.7  # digit counts drawn uniformly, not values
  _, val = arithmetic_task(0, 300, seed=3, digits=3, ops="-", allow_negative=True)
  assert any(int(r["reward_model"]["ground_truth"]) < 0 for r in val)
  assert all(len(x) == 3 for r in val for x in QUESTION.fullmatch(question(r)).group(1, 3))


def test_deterministic_in_seed():
  first, second, other = (arithmetic_task(50, 10, seed=s)[0] for s in (7, 7, 8))
  assert list(first) == list(second) and list(first) != list(other)


def test_rejects_impossible_requests():
  # One-digit "+" has 100 distinct questions.
  arithmetic_task(90, 10, seed=0, digits=1, ops="+")
  with pytest.raises(ValueError, match="allow only 100"):
    arithmetic_task(90, 11, seed=0, digits=1, ops="+")
  with pytest.raises(ValueError, match="ops"):
    arithmetic_task(1, 1, seed=0, ops="/")
  with pytest.raises(ValueError, match="digits"):
    arithmetic_task(1, 1, seed=0, digits=(2, 1))


def test_chat_form_for_instruct_models():
  train, val = arithmetic_task(20, 5, data_source="arithmetic_chat")
  row = train[0]
  assert row["data_source"] == "arithmetic_chat"
  assert row["prompt"][0]["content"].endswith("? Answer with just the number.")
  assert arithmetic_task(1, 1, data_source="arithmetic_chat", template="Add {a} and {b}.")[0][0][
      "prompt"][0]["content"].startswith("Add ")
  with pytest.raises(ValueError, match="data_source must be one of"):
    arithmetic_task(1, 1, data_source="arith")
