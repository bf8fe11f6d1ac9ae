"""Rule rewards routed by data_source as verl's default_compute_score routes them."""
import sys

import numpy as np
import pytest

from hflax.data import PromptDataset
from hflax.rewards import RuleRewardScorer, default_reward_fn
from hflax.rewards import verified_math
from hflax.rewards.math_dapo import math_dapo, normalize_final_answer
from hflax.rewards.qa import qa_exact_match
from hflax.rewards.registry import (check_rule_available, check_rule_rows, math_answer,
                                    prime_math)


@pytest.fixture
def without_math_verify(monkeypatch):
  """As if the `math` extra were not installed."""
  monkeypatch.setitem(sys.modules, "math_verify", None)  # import math_verify then fails
  verified_math._load.cache_clear()
  yield
  monkeypatch.undo()
  verified_math._load.cache_clear()


@pytest.mark.parametrize("source, rule", [
    ("math_dapo", math_dapo), ("math", math_dapo), ("math_dapo_reasoning", math_dapo),
    ("aime2024", math_dapo), ("aime25", math_dapo), ("aime", math_dapo),
    ("lighteval/MATH", math_answer), ("DigitalLearningGmbH/MATH-lighteval", math_answer),
    ("HuggingFaceH4/MATH-500", math_answer),
    ("numina_olympiads", prime_math), ("numina_cn_k12", prime_math),
    ("searchR1_nq", qa_exact_match), ("searchR1_2wikimultihopqa", qa_exact_match),
])
def test_verl_source_names_route_like_verl(source, rule):
  """Issue 25 point 3: verl's math_dapo, AIME, NuminaMath and Search-R1 sources were
  refused; "math" went to the boxed rule where verl uses math_dapo."""
  assert default_reward_fn(source) is rule


@pytest.mark.parametrize("source, reason", [
    ("apps", "running the response's code"), ("codeforces", "running the response's code"),
    ("hiyouga/geometry3k", "vision-language"), ("aim", "known: "),
])
def test_sources_without_a_rule_are_refused_in_one_line(source, reason):
  with pytest.raises(ValueError, match=f"no rule reward for data_source '{source}'.*{reason}"):
    check_rule_available(source)


@pytest.mark.parametrize("response, truth, correct, pred", [
    ("The sum is 42.\nAnswer: 42", "42", True, "42"),
    ("answer : x = 7", "7", True, "7"),  # any case, spaces, the part after "="
    ("ANSWER: $\\frac12$", "\\frac{1}{2}", True, "\\frac{1}{2}"),
    ("Answer: 1,000", "1000", True, "1000"),
    ("Answer: 5 cm", "5", True, "5"),
    ("Answer: 90^\\circ", "90", True, "90"),
    ("Answer: \\text{(B)}", "(B)", True, "(B)"),
    ("Answer: \\boxed{12}", "12", True, "12"),
    ("Answer: 3\nAnswer: 4", "4", True, "4"),  # the last one counts
    ("Answer: 41", "42", False, "41"),
    ("\\boxed{42}", "42", False, "[INVALID]"),  # no "Answer:" line
    ("Answer: 42" + " filler" * 60, "42", False, "[INVALID]"),  # beyond the last 300 chars
])
def test_math_dapo(response, truth, correct, pred):
  assert math_dapo(response, truth) == {"score": 1.0 if correct else -1.0, "acc": correct,
                                        "pred": pred}


def test_math_dapo_normaliser():
  assert normalize_final_answer("a \\$5\\ dollars") == "5"
  assert normalize_final_answer("$x$ and $y$") == "x"  # the first $...$ pair
  assert normalize_final_answer("\\sqrt2 + \\frac34") == "\\sqrt{2}+\\frac{3}{4}"
  assert normalize_final_answer("1,2") == "12" and normalize_final_answer("1,2.5") == "1,2.5"


def test_scorer_reports_math_dapo_scores_and_acc():
  out = RuleRewardScorer()(["Answer: 7", "Answer: 8", "no answer"], ["7", "7", "7"],
                           data_source=["aime24", "math_dapo", "aime24"])
  np.testing.assert_array_equal(out["scores"], [1.0, -1.0, -1.0])
  assert out["reward_extra_info"] == {"score": [1.0, -1.0, -1.0], "acc": [1.0, 0.0, 0.0]}
  assert out["pred"] == ["7", "8", "[INVALID]"]


@pytest.mark.parametrize("response, truth, score", [
    ("<answer>Paris</answer>", {"target": ["paris", "Paris, France"]}, 1.0),
    ("I think <answer>The  Eiffel tower!</answer>", {"target": np.array(["eiffel tower"])}, 1.0),
    ("<answer>Rome</answer> no, <answer>Paris</answer>", "Paris", 1.0),  # the last pair
    ("<answer>Paris, France</answer>", {"target": ["paris"]}, 0.0),  # exact, not contained
    ("Paris", {"target": ["paris"]}, 0.0),  # no tags
    ("<answer>x</answer>" * 10 + "<answer>paris</answer>", {"target": ["paris"]}, 0.25),
])
def test_search_r1_exact_match(response, truth, score):
  assert qa_exact_match(response, truth) == score


def test_math_sources_use_math_verify_when_installed():
  pytest.importorskip("math_verify", reason="the `math` extra (in the test extra) is absent")
  assert check_rule_available("HuggingFaceH4/MATH-500") == "math_answer (math-verify)"
  # Symbolic equality the hand-written normaliser cannot see.
  assert math_answer("so \\boxed{2\\sqrt{2}}", "\\sqrt{8}") == 1.0
  assert math_answer("\\boxed{(x+1)^2}", "x^2+2x+1") == 1.0
  assert math_answer("\\boxed{3}", "4") == 0.0 and math_answer("no answer", "4") == 0.0
  assert prime_math("The answer is \\frac{1}{2}", "0.5") == 1.0
  assert check_rule_available("numina_amc_aime") == "prime_math"
  out = RuleRewardScorer(timeout_s=30)(["\\boxed{\\frac{6}{4}}"], ["1.5"],
                                       data_source=["lighteval/MATH"])
  assert out["scores"].tolist() == [1.0]  # math-verify in the time limit's worker thread


def test_without_math_verify(without_math_verify):
  with pytest.raises(ValueError, match=r"^data_source 'numina_olympiads' needs the "
                                       r"math-verify package, which is not installed: "
                                       r"pip install 'hflax\[math\]'$"):
    check_rule_available("numina_olympiads")
  rows = PromptDataset([{"prompt": "q", "data_source": "numina_olympiads",
                         "reward_model": {"ground_truth": "3"}}], source="numina.jsonl")
  with pytest.raises(ValueError, match=r"config\.data\.train_files \(numina\.jsonl\): row 0: "
                                       r".*pip install 'hflax\[math\]'"):
    check_rule_rows(rows, "config.data.train_files")
  # verl's own default for the MATH sources is a hand-written normaliser: so is the fallback.
  assert check_rule_available("HuggingFaceH4/MATH-500") == "math_answer (hflax)"
  assert math_answer("\\boxed{\\dfrac{1}{2}}", "0.5") == 1.0
  assert math_answer("so \\boxed{2\\sqrt{2}}", "\\sqrt{8}") == 0.0


def test_ground_truths_checked_at_load():
  rows = PromptDataset([{"prompt": "q", "data_source": "searchR1_nq",
                         "reward_model": {"ground_truth": {"target": []}}}], source="qa.jsonl")
  with pytest.raises(ValueError, match=r"row 0: a question-answering ground truth must be"):
    check_rule_rows(rows, "config.data.val_files")
  rows = PromptDataset([{"prompt": "q", "data_source": "aime2024",
                         "reward_model": {"ground_truth": ""}}], source="aime.jsonl")
  with pytest.raises(ValueError, match=r"row 0: math ground truth must be a non-empty answer"):
    check_rule_rows(rows, "config.data.val_files")
