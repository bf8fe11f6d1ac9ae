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
