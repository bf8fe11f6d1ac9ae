"""Rule rewards against hand-written cases, and the data_source registry."""
import pytest

from hflax.rewards import (arithmetic_exact_match, default_reward_fn, extract_gsm8k_answer, gsm8k,
                           register_reward_fn, reward_data_sources)


@pytest.mark.parametrize("response, truth, expected", [
    ("68", "68", 1.0),
    ("  68\n", "68", 1.0),
    ("68 and more", "68", 1.0),
    ("68, I think", "68", 1.0),
    ("68.", "68", 1.0),
    ("068", "68", 1.0),
    ("-22", "-22", 1.0),
    ("+7", "7", 1.0),
    ("1,234", "1234", 1.0),
    ("67", "68", 0.0),
    ("680", "68", 0.0),
    ("68.5", "68", 0.0),
    ("1,23", "1", 0.0),
    ("The answer is 68", "68", 0.0),
    ("", "68", 0.0),
    ("22", "-22", 0.0),
])
def test_arithmetic_exact_match(response, truth, expected):
  assert arithmetic_exact_match(response, truth, None) == expected


def test_arithmetic_rejects_non_integer_ground_truth():
  with pytest.raises(ValueError, match="integer"):
    arithmetic_exact_match("1", "one")


@pytest.mark.parametrize("response, truth, expected", [
    ("She has 3 + 4 = 7 apples.\n#### 7", "7", 1.0),
    ("Total is 1,234 dollars.\n#### 1,234", "1234", 1.0),
    ("#### 1,234", "1,234", 1.0),
    ("first guess #### 5\nwait, recount\n#### 6", "6", 1.0),
    ("first guess #### 6\nwait, recount\n#### 5", "6", 0.0),
    ("#### 72.", "72", 1.0),
    ("#### -3", "-3", 1.0),
    ("the answer is 7", "7", 0.0),
    ("#### seven", "7", 0.0),
    ("#### 7.5", "7", 0.0),
])
def test_gsm8k_strict(response, truth, expected):
  assert gsm8k(response, truth, None) == expected


def test_gsm8k_format_score_and_flexible():
  assert gsm8k("#### 8", "7", None, format_score=0.1) == 0.1
  assert gsm8k("no marker", "7", None, format_score=0.1) == 0.0
  assert gsm8k("so 3, then 1,000 ...", "1000", None, method="flexible") == 1.0
  assert extract_gsm8k_answer("nothing here") is None
  assert extract_gsm8k_answer("a #### 1 b #### 2,500") == "2500"
  with pytest.raises(ValueError, match="method"):
    gsm8k("#### 1", "1", None, method="loose")


def test_registry_by_data_source():
  assert default_reward_fn("arithmetic") is arithmetic_exact_match
  assert default_reward_fn("openai/gsm8k") is gsm8k and default_reward_fn("gsm8k") is gsm8k
  with pytest.raises(ValueError, match="'mystery'.*HuggingFaceH4/MATH-500, aime\\*, arithmetic, "
                                      "arithmetic_chat, arithmetic_tools, gsm8k, "):
    default_reward_fn("mystery")
  with pytest.raises(ValueError, match="already has a reward"):
    register_reward_fn("gsm8k", len)


def test_register_reward_fn():
  register_reward_fn("test/always_half", lambda text, truth, info: 0.5)
  try:
    assert default_reward_fn("test/always_half")("x", "y", None) == 0.5
    assert "test/always_half" in reward_data_sources()
  finally:
    register_reward_fn("test/always_half", lambda *a: 0.0, override=True)


@pytest.mark.parametrize("response, truth, expected", [
    ("23 + 45 = 68.", "68", 1.0),  # SmolLM2-Instruct's usual form: the result comes last
    ("66+68 is 134.", "134", 1.0),
    ("The answer is 68", "68", 1.0),
    ("68", "68", 1.0),
    ("97-59 is 38", "38", 1.0),  # the operator's minus is not a sign
    ("5 - 12 = -7", "-7", 1.0),
    ("It is 1,234.", "1234", 1.0),
    ("23 + 45 = 68. Not 69", "68", 0.0),  # the last integer counts, not the first
    ("23 + 45 = 68.5", "68", 0.0),  # a decimal is not the integer
    ("sixty-eight", "68", 0.0),
    ("", "68", 0.0),
])
def test_arithmetic_last_integer(response, truth, expected):
  from hflax.rewards.rules import arithmetic_last_integer
  assert arithmetic_last_integer(response, truth) == expected
  assert default_reward_fn("arithmetic_chat")(response, truth, None) == expected


def test_arithmetic_tool_answer_partial_score_for_a_well_formed_call():
  from hflax.rewards.rules import arithmetic_tool_answer

  def info(calls, errors, final, stop="done"):
    return {"agent": {"tool_calls": calls, "tool_errors": errors, "final_turn": final,
                      "stop": stop}}
  right, wrong = info(1, 0, "408"), info(1, 0, "407")
  bad_call, bad_then_good = info(2, 2, "408"), info(2, 1, "407")
  no_call, cut = info(0, 0, "408"), info(1, 0, "", stop="max_turns")
  # The default is the exact-answer reward: a right final answer after a call (any call,
  # as the rule has always counted them) scores 1, anything else 0.
  assert [arithmetic_tool_answer("", "408", i) for i in
          (right, wrong, bad_call, bad_then_good, no_call, cut)] == [1, 0, 1, 0, 0, 0]
  # With call_score, a trajectory that is not right but made a call that parsed and ran
  # scores it; with only malformed calls or none it still scores 0.
  assert [arithmetic_tool_answer("", "408", i, call_score=0.2) for i in
          (right, wrong, bad_call, bad_then_good, no_call, cut)] == [1, 0.2, 1, 0.2, 0, 0.2]
