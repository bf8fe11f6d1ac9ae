"""Prompt rows: schema validation (errors name file, row and field) and file round trips."""
import json

import pytest

from hflax.data import PromptDataset, load_prompts, normalize_row, save_prompts



def good_row(i=0):
  return {"data_source": "openai/gsm8k",
          "prompt": [{"role": "system", "content": "Be brief."},
                     {"role": "user", "content": f"What is {i}+1? 世界"}],
          "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i + 1)},
          "extra_info": {"split": "train", "index": i}}


def write_jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
  return path


@pytest.mark.parametrize("broken, field", [
    ({"prompt": None}, "'prompt'"),
    ({"prompt": []}, "'prompt'"),
    ({"prompt": "   "}, "'prompt'"),
    ({"prompt": 7}, "'prompt'"),
    ({"prompt": [{"role": "user"}]}, "'prompt[0].content'"),
    ({"prompt": [{"content": "hi"}]}, "'prompt[0].role'"),
    ({"prompt": [{"role": "user", "content": 3}]}, "'prompt[0].content'"),
    ({"prompt": ["hi"]}, "'prompt[0]'"),
    ({"reward_model": None}, "'reward_model.ground_truth'"),
    ({"reward_model": {"style": "rule"}}, "'reward_model.ground_truth'"),
    ({"reward_model": "42"}, "'reward_model'"),
    ({"extra_info": [1]}, "'extra_info'"),
])
def test_invalid_row_names_file_row_and_field(tmp_path, broken, field):
  bad = {**good_row(2), **broken}
  path = write_jsonl(tmp_path / "bad.jsonl", [good_row(0), good_row(1), bad])
  with pytest.raises(ValueError) as error:
    load_prompts(path)
  message = str(error.value)
  assert str(path) in message and "row 2" in message and field in message, message


def test_missing_prompt_key_and_non_object_rows(tmp_path):
  row = good_row()
  del row["prompt"]
  # The blank line is skipped, so row 1 sits on line 3.
  (tmp_path / "x.jsonl").write_text(json.dumps(good_row()) + "\n\n" + json.dumps(row) + "\n")
  with pytest.raises(ValueError, match=r"x\.jsonl: row 1 \(line 3\): missing field 'prompt'"):
    load_prompts(tmp_path / "x.jsonl")
  (tmp_path / "y.jsonl").write_text(json.dumps(good_row()) + '\n"just text"\n')
  with pytest.raises(ValueError, match=r"y\.jsonl: row 1 \(line 2\): expected an object"):
    load_prompts(tmp_path / "y.jsonl")
  (tmp_path / "z.jsonl").write_text(json.dumps(good_row()) + "\n{not json\n")
  with pytest.raises(ValueError, match=r"z\.jsonl: row 1 \(line 2\): not valid JSON"):
    load_prompts(tmp_path / "z.jsonl")


def test_string_prompt_and_defaults():
  row = normalize_row({"prompt": "What is 2+2?", "reward_model": {"ground_truth": "4"}})
  assert row["prompt"] == [{"role": "user", "content": "What is 2+2?"}]
  assert row["data_source"] == "unknown" and row["ability"] == ""
  assert row["reward_model"] == {"ground_truth": "4", "style": "rule"}
  assert row["extra_info"] == {}


def test_jsonl_round_trip_keeps_rows_and_extra_columns(tmp_path):
  rows = [{**good_row(i), "note": "kept"} for i in range(5)]
  save_prompts(rows, tmp_path / "p.jsonl")
  dataset = load_prompts(tmp_path / "p.jsonl")
  assert isinstance(dataset, PromptDataset) and len(dataset) == 5
  assert list(dataset) == rows
  assert dataset.data_sources() == ["openai/gsm8k"]


def test_json_array_and_unicode_line_separator(tmp_path):
  rows = [good_row(0), {**good_row(1), "prompt": "a\u2028b"}]
  (tmp_path / "a.json").write_text(json.dumps(rows), encoding="utf-8")
  assert load_prompts(tmp_path / "a.json")[1]["prompt"][0]["content"] == "a\u2028b"
  save_prompts(PromptDataset(rows), tmp_path / "b.json")  # raw U+2028 inside a line
  assert load_prompts(tmp_path / "b.json")[1]["prompt"][0]["content"] == "a\u2028b"


def test_unsupported_suffix_and_missing_file(tmp_path):
  with pytest.raises(ValueError, match="unsupported prompt file type '.csv'"):
    load_prompts(tmp_path / "p.csv")
  with pytest.raises(FileNotFoundError, match="does not exist"):
    load_prompts(tmp_path / "nope.jsonl")


def test_parquet_round_trip(tmp_path):
  rows = [good_row(i) for i in range(4)]
  save_prompts(rows, tmp_path / "p.parquet")
  assert list(load_prompts(tmp_path / "p.parquet")) == rows
  # Rows loaded from a file without extra_info carry {}: parquet cannot store an empty
  # struct, so it is written as null and reads back as {}.
  (tmp_path / "bare.jsonl").write_text(
      '{"prompt": "1+1=", "reward_model": {"ground_truth": "2"}}\n')
  bare = load_prompts(tmp_path / "bare.jsonl")
  save_prompts(bare, tmp_path / "bare.parquet")
  assert list(load_prompts(tmp_path / "bare.parquet")) == list(bare)


def test_lists_of_files_and_directories(tmp_path):
  """Issue 25 point 2: verl's data.train_files takes lists of files and directories."""
  shards = tmp_path / "shards"
  shards.mkdir()
  save_prompts([good_row(i) for i in range(2, 4)], shards / "b.parquet")
  write_jsonl(shards / "a.jsonl", [good_row(i) for i in range(0, 2)])
  (shards / "README.txt").write_text("not a prompt file")  # other files are ignored
  (shards / "nested").mkdir()  # so are subdirectories
  save_prompts([good_row(9)], shards / "nested" / "c.parquet")
  single = write_jsonl(tmp_path / "single.jsonl", [good_row(7)])
  dataset = load_prompts([single, shards])  # os.PathLike entries, in the order given
  assert [row["reward_model"]["ground_truth"] for row in dataset] == ["8", "1", "2", "3", "4"]
  assert dataset.source == f"{single} + {shards / 'a.jsonl'} + {shards / 'b.parquet'}"
  assert dataset.where(0) == f"{single}: row 0" and dataset.where(4) == f"{shards}/b.parquet: row 1"
  assert len(load_prompts(str(shards))) == 4 and len(load_prompts([str(single)])) == 1
  # An error names the file the bad row is in and the row's index there.
  write_jsonl(shards / "c.jsonl", [good_row(5), {**good_row(6), "prompt": []}])
  with pytest.raises(ValueError, match=r"shards/c\.jsonl: row 1 \(line 2\): field 'prompt'"):
    load_prompts([single, shards])
  (tmp_path / "empty").mkdir()
  with pytest.raises(ValueError, match=r"prompt directory '.*empty' holds no \.jsonl, \.json, "
                                       r"\.parquet files"):
    load_prompts([single, tmp_path / "empty"])
  with pytest.raises(FileNotFoundError, match="'.*missing.parquet' does not exist"):
    load_prompts([single, tmp_path / "missing.parquet"])
  with pytest.raises(ValueError, match="no prompt files given"):
    load_prompts([])


def test_rows_of_joined_files_are_named_by_file_in_later_checks(tmp_path):
  from hflax.models.tokenizer import load_tokenizer
  from hflax.data import PromptLoader
  from hflax.rewards.registry import check_rule_rows
  first = write_jsonl(tmp_path / "first.jsonl", [good_row(0), good_row(1)])
  long_row = {**good_row(2), "prompt": "x" * 200}
  second = write_jsonl(tmp_path / "second.jsonl", [good_row(3), long_row])
  dataset = load_prompts([first, second])
  with pytest.raises(ValueError, match=r"second\.jsonl: row 1: field 'prompt' is \d+ tokens"):
    PromptLoader(dataset, load_tokenizer("byte"), 2, max_prompt_length=64)
  bad_truth = write_jsonl(tmp_path / "third.jsonl", [{**good_row(4), "data_source": "arithmetic",
                                                      "reward_model": {"ground_truth": "x"}}])
  with pytest.raises(ValueError, match=r"^train \(.*third\.jsonl\): row 0: arithmetic ground "
                                       r"truth must be an integer"):
    check_rule_rows(load_prompts([first, bad_truth]), "train")


def test_prompt_key_names_the_messages_column(tmp_path):
  rows = [{"question": [{"role": "user", "content": f"q{i}"}], "prompt": "ignored",
           "reward_model": {"ground_truth": str(i)}} for i in range(2)]
  save_prompts(rows, tmp_path / "q.parquet")
  write_jsonl(tmp_path / "q.jsonl", rows)
  for path in (tmp_path / "q.parquet", tmp_path / "q.jsonl", [tmp_path / "q.jsonl"] * 2):
    dataset = load_prompts(path, prompt_key="question")
    assert dataset[1]["prompt"] == [{"role": "user", "content": "q1"}]
    assert dataset[1]["question"] == rows[1]["question"]  # the column itself is kept
  write_jsonl(tmp_path / "bad.jsonl", [{**rows[0], "question": []}, {"prompt": "only this"}])
  with pytest.raises(ValueError, match=r"bad\.jsonl: row 0 \(line 1\): field 'question' is an "
                                       "empty list"):
    load_prompts(tmp_path / "bad.jsonl", prompt_key="question")
  write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "only this", "reward_model": {"ground_truth": 1}}])
  with pytest.raises(ValueError, match=r"row 0 \(line 1\): missing field 'question'"):
    load_prompts(tmp_path / "bad.jsonl", prompt_key="question")


def test_ground_truth_optional_for_a_learned_reward_model(tmp_path):
  """Rows scored by a reward model need no reward_model.ground_truth when the caller says so."""
  from hflax.rewards.registry import check_rule_rows
  rows = [{"data_source": "hh", "prompt": "Be nice."},
          {"data_source": "hh", "prompt": "Be kind.", "reward_model": {"style": "model"}},
          {"data_source": "hh", "prompt": "Be fair.", "reward_model": {"ground_truth": "ok"}}]
  write_jsonl(tmp_path / "rm.jsonl", rows)
  save_prompts(rows, tmp_path / "rm.parquet")
  with pytest.raises(ValueError, match=r"row 0 \(line 1\): missing field 'reward_model\.ground_truth'"):
    load_prompts(tmp_path / "rm.jsonl")  # still required by default
  for path in (tmp_path / "rm.jsonl", tmp_path / "rm.parquet"):
    dataset = load_prompts(path, require_ground_truth=False)
    assert [row["reward_model"] for row in dataset] == [
        {"style": "model", "ground_truth": None}, {"style": "model", "ground_truth": None},
        {"style": "rule", "ground_truth": "ok"}]
  # A rule reward cannot judge a row without one: refused by name before training.
  with pytest.raises(ValueError, match=r"\(.*rm\.jsonl\): row 0: no reward_model\.ground_truth, "
                                       r"which the rule reward for data_source 'arithmetic'"):
    check_rule_rows(PromptDataset([{**r, "data_source": "arithmetic"} for r in rows],
                                  str(tmp_path / "rm.jsonl"), require_ground_truth=False),
                    "train")
