"""Validation metrics over N samples per prompt, against enumeration of every k-subset."""
import itertools
from collections import Counter

import numpy as np
import pytest

from hflax.rewards import validation_metrics
from hflax.rewards.validation import best_of_k, majority_score, subset_sizes


def enumerated(scores, k, reduce):
  values = [reduce(c) for c in itertools.combinations(scores, k)]
  return np.mean(values), np.std(values)


@pytest.mark.parametrize("n", [1, 3, 5, 8])
def test_best_and_worst_of_k_equal_the_mean_over_every_subset(n):
  rng = np.random.default_rng(n)
  scores = rng.normal(size=(4, n)).round(1)  # rounded: ties must count right too
  for k in range(1, n + 1):
    best, best_std = best_of_k(scores, k)
    for p in range(4):
      np.testing.assert_allclose((best[p], best_std[p]), enumerated(scores[p], k, max),
                                 atol=1e-12)


def test_pass_at_k_for_zero_one_scores():
  # 3 correct of 8: pass@2 = 1 - C(5,2)/C(8,2) = 1 - 10/28 (Chen et al.'s estimator).
  best, _ = best_of_k(np.array([[1, 0, 0, 1, 0, 0, 1, 0]], float), 2)
  np.testing.assert_allclose(best, [1 - 10 / 28])


def test_majority_votes():
  assert majority_score([0, 1, 1, 0], ["7", "8", "8", "7"]) == 0.0  # a tie: the first answer
  assert majority_score([0, 1, 1, 0], [None, "8", "8", "7"]) == 1.0
  assert majority_score([0, 0, 0, 1], [None, None, None, "5"]) == 0.0  # no answer wins (verl)
  assert majority_score([0, 1, 1], [[1], [2], [2]]) == 1.0  # unhashable answers vote too
  assert subset_sizes(1) == [1] and subset_sizes(8) == [2, 4, 8] and subset_sizes(6) == [2, 4, 6]


def test_metrics_per_data_source_named_like_verl():
  # Two prompts of source a (N=4 samples each), one of source b.
  scores = [1, 0, 0, 0,   1, 1, 1, 0,   0, 0, 0, 0]
  preds = ["5", "6", "6", None,   "9", "9", "9", "2",   None, None, None, None]
  sources = ["a"] * 8 + ["b"] * 4
  m = validation_metrics(scores, sources, 4, preds)
  # A reward without "acc": verl names the variable "reward" (issue 25 point 4).
  assert m["val-core/a/reward/mean@4"] == 0.5
  assert m["val-core/a/reward/best@4/mean"] == 1.0 and m["val-core/b/reward/best@4/mean"] == 0.0
  assert m["val-aux/a/reward/worst@4/mean"] == 0.0
  # best@2: prompt 1 has 1 right of 4 -> 1 - C(3,2)/C(4,2) = 0.5; prompt 2 (3 of 4) -> 1.
  assert m["val-aux/a/reward/best@2/mean"] == pytest.approx(0.75)
  assert m["val-aux/a/reward/std@4"] == pytest.approx(np.mean([np.std([1, 0, 0, 0])] * 2))
  assert m["val-core/a/reward/maj@4/mean"] == 0.5  # prompt 1 votes "6" (wrong), prompt 2 "9"
  assert "val-core/b/reward/maj@4/mean" not in m  # nobody in b said what they answered
  assert not any("/acc/" in k for k in m)
  sections = Counter(k.split("/")[0] for k in m)
  assert set(sections) == {"val-core", "val-aux"}
  assert validation_metrics([1, 0], ["a", "b"]) == {"val-core/a/reward/mean@1": 1.0,
                                                    "val-core/b/reward/mean@1": 0.0}


def test_acc_is_the_core_variable_only_when_the_reward_returns_it():
  """verl's _val_metrics_update: core_var = "acc" if the reward's dicts have an acc, else
  "reward"; every other variable is reported under val-aux."""
  scores = [1, -1, -1, 1,   0.5, 0.5]  # source a: math_dapo-style 1/-1; b: plain numbers
  extra = {"acc": [1, 0, 0, 1, None, None], "score": [1, -1, -1, 1, None, None]}
  m = validation_metrics(scores, ["a"] * 4 + ["b"] * 2, 2, ["7", "8", "8", "7", None, None],
                         extra)
  assert m["val-core/a/acc/mean@2"] == 0.5 and m["val-core/a/acc/best@2/mean"] == 1.0
  assert m["val-core/a/acc/maj@2/mean"] == 0.5  # the first answer wins each tie
  assert m["val-aux/a/reward/mean@2"] == 0.0 and m["val-aux/a/reward/best@2/mean"] == 1.0
  assert m["val-aux/a/score/mean@2"] == 0.0 and m["val-aux/a/reward/maj@2/mean"] == 0.0
  assert not any(k.startswith("val-core/a/reward") for k in m)
  # b's rows carry no acc: b reports its reward as the core variable.
  assert m["val-core/b/reward/mean@2"] == 0.5 and not any("/b/acc" in k for k in m)
  assert sorted(k for k in m if k.startswith("val-core/")) == [
      "val-core/a/acc/best@2/mean", "val-core/a/acc/maj@2/mean", "val-core/a/acc/mean@2",
      "val-core/b/reward/best@2/mean", "val-core/b/reward/mean@2"]
  with pytest.raises(ValueError, match="reward_extra_info 'acc' has 1 values for 6 scores"):
    validation_metrics(scores, ["a"] * 6, 2, None, {"acc": [1]})


def test_scorer_output_feeds_validation(tmp_path):
  from hflax.rewards import RuleRewardScorer
  from hflax.rewards.validation import concat_extra_info
  scorer = RuleRewardScorer()
  first = scorer(["Answer: 3", "Answer: 4"], ["3", "3"], data_source=["aime24"] * 2)
  second = scorer(["#### 5", "#### 6"], ["5", "5"], data_source=["openai/gsm8k"] * 2)
  extra = concat_extra_info([first["reward_extra_info"], second["reward_extra_info"]], [2, 2])
  assert extra == {"score": [1.0, -1.0, None, None], "acc": [1.0, 0.0, None, None]}
  m = validation_metrics(np.concatenate([first["scores"], second["scores"]]),
                         ["aime24"] * 2 + ["openai/gsm8k"] * 2, 2,
                         first["pred"] + second["pred"], extra)
  assert m["val-core/aime24/acc/mean@2"] == 0.5 and m["val-aux/aime24/reward/mean@2"] == 0.0
  assert m["val-core/openai/gsm8k/reward/mean@2"] == 0.5


def test_bad_groupings_are_refused():
  with pytest.raises(ValueError, match="groups of samples_per_prompt=2"):
    validation_metrics([1, 0, 1], ["a"] * 3, 2)
  with pytest.raises(ValueError, match=r"rows 0\.\.1 are one prompt's samples"):
    validation_metrics([1, 0], ["a", "b"], 2)
  with pytest.raises(ValueError, match="2 scores for 1 data sources"):
    validation_metrics([1, 0], ["a"])


def test_tool_use_rates_per_data_source_from_the_agent_records():
  from hflax.launch.trainer import _fmt
  from hflax.launch.validation import tool_use_metrics
  agents = [{"tool_calls": 1, "tool_errors": 0},  # a call that ran
            {"tool_calls": 2, "tool_errors": 2},  # two malformed calls
            {"tool_calls": 0, "tool_errors": 0},  # answered without the tool
            {"tool_calls": 2, "tool_errors": 1},  # one bad call, then one that ran
            None]  # a single-turn sample: no agent record, not counted
  sources = ["tools"] * 4 + ["plain"]
  metrics = tool_use_metrics(agents, sources)
  assert metrics == {"val-aux/tools/tool_call_rate": 0.75,
                     "val-aux/tools/well_formed_call_rate": 0.5}
  # The run's before/after line shows them beside the accuracy; other val-aux ones stay out.
  line = _fmt({**metrics, "val-core/tools/reward/mean@1": 0.25, "val-aux/tools/x": 1.0})
  assert line == ("val-core/tools/reward/mean@1 = 0.250, val-aux/tools/tool_call_rate = "
                  "0.750, val-aux/tools/well_formed_call_rate = 0.500")
