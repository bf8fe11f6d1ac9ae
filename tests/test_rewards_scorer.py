"""RuleRewardScorer token placement, answers for votes, custom reward files."""
import numpy as np
import pytest

from hflax.models.tokenizer import load_tokenizer
from hflax.rewards import RuleRewardScorer, load_reward_function

TOKENIZER = load_tokenizer("byte")
EOS = TOKENIZER.eos_ids[0]


def right_padded(texts, width):
  ids = np.full((len(texts), width), TOKENIZER.pad_id, np.int32)
  mask = np.zeros((len(texts), width), bool)
  for i, text in enumerate(texts):
    tokens = TOKENIZER.encode(text) + ([EOS] if text else [])
    ids[i, :len(tokens)], mask[i, :len(tokens)] = tokens, True
  return ids, mask


def test_scores_land_on_the_last_valid_token():
  ids, mask = right_padded(["68", "12 and more", "9", ""], width=16)
  out = RuleRewardScorer(TOKENIZER)(ids, ["68", "12", "8", "0"],
                                    data_source=["arithmetic"] * 4, response_mask=mask)
  assert out["response_text"] == ["68", "12 and more", "9", ""]  # end token skipped
  np.testing.assert_array_equal(out["scores"], np.array([1, 1, 0, 0], np.float32))
  levels = out["token_level_scores"]
  assert levels.shape == (4, 16) and levels.dtype == np.float32
  assert levels[0, 2] == 1.0 and levels[1, 11] == 1.0  # the end token's position
  np.testing.assert_array_equal(levels.sum(axis=1), out["scores"])
  assert np.count_nonzero(levels) == 2


def test_empty_response_scores_at_position_zero_and_gaps_in_mask():
  mask = np.array([[0, 0, 0, 0], [1, 0, 1, 0]], bool)
  ids = np.array([[1, 2, 3, 4], [ord("5"), ord("x"), EOS, 0]], np.int32)
  always_two = lambda text, truth, info: 2.0  # noqa: E731
  out = RuleRewardScorer(TOKENIZER, always_two)(ids, ["", ""], response_mask=mask)
  np.testing.assert_array_equal(out["token_level_scores"], [[2, 0, 0, 0], [0, 0, 2, 0]])
  assert out["response_text"] == ["", "5"]


def test_strings_mixed_sources_and_extra_info():
  seen = []

  def custom(text, truth, info):
    seen.append(info)
    return {"score": float(text == truth), "note": "dicts like verl's are accepted"}

  out = RuleRewardScorer(reward_fn=custom)(["a", "b"], ["a", "c"], extra_info=[{"i": 0}, None])
  np.testing.assert_array_equal(out["scores"], [1.0, 0.0])
  assert "token_level_scores" not in out and seen == [{"i": 0}, None]
  out = RuleRewardScorer()(["#### 1,000", "7"], ["1000", "7"],
                           data_source=["openai/gsm8k", "arithmetic"])
  np.testing.assert_array_equal(out["scores"], [1.0, 1.0])
  with pytest.raises(ValueError, match="'nope'"):
    RuleRewardScorer()(["1"], ["1"], data_source=["nope"])
  with pytest.raises(ValueError, match="1 ground_truth entries for 2 responses"):
    RuleRewardScorer()(["1", "2"], ["1"], data_source=["arithmetic"] * 2)


def test_predictions_for_majority_votes():
  out = RuleRewardScorer()(["68 and more", "x", "#### 1,000", "no marker 5"],
                           ["68", "1", "1000", "5"],
                           data_source=["arithmetic", "arithmetic", "gsm8k", "openai/gsm8k"])
  assert out["pred"] == [68, None, "1000", None]
  custom = lambda text, truth, info: {"score": 1.0, "pred": text.upper()}  # noqa: E731
  assert RuleRewardScorer(reward_fn=custom)(["a", "b"], ["", ""])["pred"] == ["A", "B"]
  plain = lambda text, truth, info: 1.0  # noqa: E731 - a float says nothing of the answer
  assert RuleRewardScorer(reward_fn=plain)(["7"], ["7"], ["arithmetic"])["pred"] == [None]


def test_load_reward_function_from_file(tmp_path):
  path = tmp_path / "my_reward.py"
  path.write_text("import math\nTHRESHOLD = 3\n\n"
                  "def length_reward(text, truth, info=None):\n"
                  "  return float(len(text) >= THRESHOLD)\n")
  fn = load_reward_function(str(path), "length_reward")
  assert fn("abcd", "", None) == 1.0 and fn("ab", "", None) == 0.0
  out = RuleRewardScorer(TOKENIZER, fn)(["abc", "a"], ["", ""])
  np.testing.assert_array_equal(out["scores"], [1.0, 0.0])
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_reward_function(str(tmp_path / "missing.py"), "length_reward")
  with pytest.raises(ValueError, match="defines no 'score'.*length_reward"):
    load_reward_function(str(path), "score")
  with pytest.raises(TypeError, match=r"'THRESHOLD' is not callable \(its type is int\)"):
    load_reward_function(str(path), "THRESHOLD")


VERL_REWARD = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
  """verl's documented custom reward signature: called by keyword."""
  bonus = 0.5 if (extra_info or {}).get("split") == "train" else 0.0
  if data_source == "my/source" and solution_str.strip() == ground_truth:
    return 1.0 + bonus
  return bonus
'''


def test_verl_signature_is_called_by_keyword(tmp_path):
  """Issue 25 point 1: verl calls compute_score(data_source=, solution_str=, ground_truth=,
  extra_info=); by position the file would score data_source as the response."""
  path = tmp_path / "verl_reward.py"
  path.write_text(VERL_REWARD)
  fn = load_reward_function(str(path), "compute_score")
  out = RuleRewardScorer(reward_fn=fn)(["42", " 42 ", "41"], ["42", "42", "42"],
                                       data_source=["my/source", "my/source", "my/source"],
                                       extra_info=[None, {"split": "train"}, {"split": "train"}])
  np.testing.assert_array_equal(out["scores"], [1.0, 1.5, 0.5])


def test_calling_convention_follows_parameter_names(tmp_path):
  from hflax.rewards.registry import reward_caller, uses_verl_signature
  seen = []

  def only_solution(solution_str, ground_truth):  # a subset of verl's names
    seen.append(("subset", solution_str, ground_truth))
    return 1.0

  def kwargs_only(**kwargs):
    seen.append(("kwargs", kwargs))
    return 1.0

  def hflax_style(text, ground_truth, extra_info=None):  # hflax's order: by position
    seen.append(("hflax", text, ground_truth, extra_info))
    return 1.0

  assert uses_verl_signature(only_solution) and uses_verl_signature(kwargs_only)
  assert not uses_verl_signature(hflax_style) and not uses_verl_signature(lambda *a: 0.0)
  for fn in (only_solution, kwargs_only, hflax_style):
    RuleRewardScorer(reward_fn=fn)(["resp"], ["truth"], data_source=["src"],
                                   extra_info=[{"i": 1}])
  assert seen == [("subset", "resp", "truth"),
                  ("kwargs", {"data_source": "src", "solution_str": "resp",
                              "ground_truth": "truth", "extra_info": {"i": 1}}),
                  ("hflax", "resp", "truth", {"i": 1})]
  # A parameter verl would never pass is refused when the function is taken in.
  path = tmp_path / "needs_more.py"
  path.write_text("def compute_score(data_source, solution_str, ground_truth, method):\n"
                  "  return 0.0\n")
  with pytest.raises(ValueError, match=r"compute_score \(needs_more\.py\) is called verl's "
                                       r"way .* also requires 'method'"):
    load_reward_function(str(path), "compute_score")
  with pytest.raises(ValueError, match="requires 'k'"):
    reward_caller(lambda solution_str, k: 0.0)


def _reward_file(tmp_path, body, name="r.py"):
  path = tmp_path / name
  path.write_text("import math, sys, time\n\n"
                  "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                  f"  {body}\n")
  return load_reward_function(str(path), "compute_score")


@pytest.mark.parametrize("body, message", [
    ("sys.exit(0) if solution_str == 'b' else 1.0",
     r"^reward function compute_score \(r\.py\) raised SystemExit\(0\) on row 1$"),
    ("raise KeyboardInterrupt",
     r"^reward function compute_score \(r\.py\) raised KeyboardInterrupt\(\) on row 0$"),
    ("return '0.5'",  # float() would read it; a string is not a reward
     r"^reward function compute_score \(r\.py\) returned '0\.5' \(str\) for row 0; a reward is"),
    ("return None if solution_str == 'b' else 1",
     r"^reward function compute_score \(r\.py\) returned None \(NoneType\) for row 1"),
    ("return {'score': [1.0]}", r"returned \[1\.0\] \(list\) for row 0"),
    ("return {'acc': 1.0}", r"returned a dict without 'score' for row 0 \(keys: acc\)"),
    ("return math.nan if solution_str == 'b' else 0.0",
     r"^reward function compute_score \(r\.py\) returned nan for row 1; rewards must be finite"),
    ("return -math.inf", r"returned -inf for row 0; rewards must be finite"),
    ("return {'score': 1e300}", r"returned 1e\+300 for row 0; rewards must be finite"),
])
@pytest.mark.parametrize("timeout_s", [None, 30.0])
def test_misbehaving_reward_code_is_one_named_error(tmp_path, body, message, timeout_s):
  """Issue 27: what user reward code does ends as one ValueError line naming the function
  and the row, with or without the time limit's worker thread."""
  scorer = RuleRewardScorer(reward_fn=_reward_file(tmp_path, body), timeout_s=timeout_s)
  with pytest.raises(ValueError, match=message) as caught:
    scorer(["a", "b"], ["a", "b"], data_source=["s", "s"])
  assert "\n" not in str(caught.value)


def test_numbers_of_every_kind_are_accepted(tmp_path):
  results = iter([True, 2, np.float32(0.25), np.int64(-3), np.bool_(False), {"score": 1}])
  out = RuleRewardScorer(reward_fn=lambda t, g, i: next(results))(list("abcdef"), [""] * 6)
  np.testing.assert_array_equal(out["scores"], [1, 2, 0.25, -3, 0, 1])


def test_reward_timeout_per_batch(tmp_path):
  import time
  slow = _reward_file(tmp_path, "time.sleep(30 if solution_str == 'slow' else 0); return 1.0",
                      "slow.py")
  scorer = RuleRewardScorer(reward_fn=slow, timeout_s=0.5)
  np.testing.assert_array_equal(scorer(["a", "b"], ["", ""])["scores"], [1.0, 1.0])
  start = time.monotonic()
  with pytest.raises(ValueError, match=r"^reward function compute_score \(slow\.py\) took "
                                       r"longer than timeout_s=0\.5 s on a batch of 3 "
                                       r"responses$"):
    scorer(["a", "slow", "b"], ["", "", ""])
  assert time.monotonic() - start < 5
  # Ordinary exceptions still reach the caller unchanged (it names them itself).
  broken = RuleRewardScorer(reward_fn=lambda t, g, i: 1 / 0, timeout_s=5)
  with pytest.raises(ZeroDivisionError):
    broken(["a"], [""])
  for bad in (-1, float("nan"), float("inf"), "5"):
    with pytest.raises(ValueError, match="timeout_s must be a finite number"):
      RuleRewardScorer(timeout_s=bad)
  assert RuleRewardScorer(timeout_s=0).timeout_s is None  # 0: no limit


def test_unhashable_callable_reward():
  class Scorer:  # defines __eq__ only: instances are not hashable
    def __eq__(self, other):
      return False

    def __call__(self, solution_str, ground_truth):
      return float(solution_str == ground_truth)

  out = RuleRewardScorer(reward_fn=Scorer())(["a", "b"], ["a", "a"])
  np.testing.assert_array_equal(out["scores"], [1.0, 0.0])
