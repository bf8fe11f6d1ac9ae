r"""The MATH-style boxed-answer rule, on answers judged by hand."""
import pytest

from hflax.rewards import RuleRewardScorer, boxed_answer, math_boxed
from hflax.rewards.competition_math import last_boxed, normalize_answer
from hflax.rewards.registry import check_rule_rows
from hflax.data import PromptDataset

SAME = [  # (response, ground truth): one answer written two ways
    (r"so the answer is \boxed{\frac{1}{2}}.", r"\frac12"),
    (r"\boxed{\dfrac{1}{2}}", "0.5"),
    (r"\boxed{1/2}", r"\frac{1}{2}"),
    (r"\boxed{-\frac{3}{4}}", "-0.75"),
    (r"\boxed{10\%}", "10"),
    (r"\boxed{5 \text{ cm}}", "5"),
    (r"\boxed{x = 3}", "3"),
    (r"\boxed{\left( 3, 4 \right)}", "(3,4)"),
    (r"\boxed{90^\circ}", "90"),
    (r"\boxed{1,000}", "1000"),
    (r"\boxed{\frac{\sqrt{3}}{2}}", r"\frac{\sqrt3}{2}"),
    (r"\boxed 5$ is it", "5"),
    (r"\fbox{7}", "7"),
    (r"first \boxed{1}, finally \boxed{2}", "2"),
    (r"\boxed{(3,4)}", r"The points meet at \boxed{(3, 4)}."),  # a boxed solution as truth
]
DIFFERENT = [
    (r"\boxed{3}", "4"),
    ("the answer is 1", "1"),  # not boxed
    (r"\boxed{\frac{1}{2", "1/2"),  # never closed
    (r"\boxed{0.33}", r"\frac13"),  # close is not equal
    (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),  # equal, but beyond what is normalised
    (r"\boxed{1,2}", "12"),  # a list, not a thousands separator
]


@pytest.mark.parametrize("response,truth", SAME)
def test_one_answer_written_two_ways(response, truth):
  assert math_boxed(response, truth) == 1.0


@pytest.mark.parametrize("response,truth", DIFFERENT)
def test_different_or_missing_answers(response, truth):
  assert math_boxed(response, truth) == 0.0


def test_extraction_and_votes():
  assert last_boxed(r"\boxed{\frac{a}{b^{2}}} and more") == r"\frac{a}{b^{2}}"  # nested
  assert normalize_answer(r"\tfrac{1}{2}\!") == r"\frac{1}{2}"
  # Answers the rule judges equal vote together.
  assert {boxed_answer(r"\boxed{\dfrac12}"), boxed_answer(r"\boxed{0.5}"),
          boxed_answer(r"\boxed{1/2}")} == {"1/2"}
  assert boxed_answer(r"\boxed{(1, 2)}") == "(1,2)" and boxed_answer("none") is None
  out = RuleRewardScorer()([r"\boxed{0.5}", "?"], [r"\frac{1}{2}", "1"],
                           data_source=["HuggingFaceH4/MATH-500", "lighteval/MATH"])
  assert out["scores"].tolist() == [1.0, 0.0] and out["pred"] == ["1/2", None]


def test_empty_ground_truth_refused_at_load():
  rows = PromptDataset([{"prompt": "q", "data_source": "lighteval/MATH",
                         "reward_model": {"ground_truth": " "}}], source="math.jsonl")
  with pytest.raises(ValueError, match=r"\(math.jsonl\): row 0: math ground truth must be"):
    check_rule_rows(rows, "config.data.train_files")
