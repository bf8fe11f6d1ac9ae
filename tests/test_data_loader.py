"""PromptLoader: full deterministic batches, exact resume, left padding and truncation."""
import numpy as np
import pytest

from hflax.data import PromptDataset, PromptLoader, arithmetic_task
from hflax.models.tokenizer import load_tokenizer

TOKENIZER = load_tokenizer("byte")


@pytest.fixture(scope="module")
def train():
  return arithmetic_task(23, 0, seed=0)[0]


def make_loader(dataset, **kwargs):
  return PromptLoader(dataset, TOKENIZER, **{"batch_size": 4, "max_prompt_length": 64,
                                             "seed": 5, **kwargs})


def same_batches(first, second):
  assert len(first) == len(second)
  for a, b in zip(first, second):
    assert a.keys() == b.keys()
    for key in a:
      if isinstance(a[key], np.ndarray):
        np.testing.assert_array_equal(a[key], b[key])
      else:
        assert a[key] == b[key], key


def test_batch_contents_and_left_padding(train):
  batch = make_loader(train, shuffle=False).next_batch()
  assert batch["prompts"].shape == batch["prompt_mask"].shape == (4, 64)
  assert batch["prompts"].dtype == np.int32 and batch["prompt_mask"].dtype == bool
  for i in range(4):
    ids = TOKENIZER.encode_chat(train[i]["prompt"])
    row, mask = batch["prompts"][i], batch["prompt_mask"][i]
    assert mask.sum() == len(ids) and mask[-len(ids):].all()  # real tokens on the right
    assert row[mask].tolist() == ids and (row[~mask] == TOKENIZER.pad_id).all()
    assert batch["ground_truth"][i] == train[i]["reward_model"]["ground_truth"]
    assert batch["raw_prompt"][i] == train[i]["prompt"]
  assert batch["data_source"] == ["arithmetic"] * 4 and batch["row_index"].tolist() == [0, 1, 2, 3]
  assert [e["index"] for e in batch["extra_info"]] == [0, 1, 2, 3]


def test_epochs_drop_last_and_reshuffle(train):
  loader = make_loader(train)
  assert len(loader) == 5  # 23 rows, batches of 4: 3 rows dropped each epoch
  epoch0 = [b["row_index"] for b in loader]
  epoch1 = [b["row_index"] for b in loader]
  assert len(epoch0) == len(epoch1) == 5
  for epoch in (epoch0, epoch1):
    seen = np.concatenate(epoch)
    assert len(set(seen.tolist())) == 20  # no repeats within an epoch
  assert not all((a == b).all() for a, b in zip(epoch0, epoch1))
  assert loader.state_dict()["epoch"] == 1
  again = make_loader(train)
  same_batches([again.next_batch() for _ in range(10)], [
      make_loader(train).collate(i) for i in epoch0 + epoch1])


@pytest.mark.parametrize("k", [0, 3, 5, 7])
def test_resume_yields_exactly_the_next_batches(train, k):
  loader = make_loader(train)
  for _ in range(k):
    loader.next_batch()
  state = loader.state_dict()
  expected = [loader.next_batch() for _ in range(6)]
  resumed = make_loader(train, seed=123)  # the seed comes back from the state
  resumed.load_state_dict(state)
  same_batches([resumed.next_batch() for _ in range(6)], expected)


def test_resume_mid_epoch_with_for_loop(train):
  loader = make_loader(train)
  iterator = iter(loader)
  next(iterator), next(iterator)
  resumed = make_loader(train)
  resumed.load_state_dict(loader.state_dict())
  same_batches(list(resumed), list(iterator))  # the rest of epoch 0: 3 batches each


def test_resume_against_different_data_fails(train):
  state = make_loader(train).state_dict()
  smaller = PromptDataset(list(train)[:20])
  with pytest.raises(ValueError, match="num_rows=23"):
    make_loader(smaller).load_state_dict(state)


def test_overlong_prompt_errors_or_keeps_last_tokens():
  rows = [{"prompt": "x" * n, "reward_model": {"ground_truth": "0"}} for n in (5, 80, 10)]
  dataset = PromptDataset(rows, source="mem.jsonl")
  with pytest.raises(ValueError, match=r"mem\.jsonl: row 1: field 'prompt' is \d+ tokens"):
    make_loader(dataset, batch_size=3, max_prompt_length=48)
  batch = make_loader(dataset, batch_size=3, max_prompt_length=48, truncate=True,
                      shuffle=False).next_batch()
  ids = TOKENIZER.encode_chat(dataset[1]["prompt"])
  assert batch["prompts"][1].tolist() == ids[-48:] and batch["prompt_mask"][1].all()
  assert batch["prompt_mask"][0].sum() < 48


def test_overlong_prompts_left_out(train):
  rows = [{"prompt": "x" * n, "reward_model": {"ground_truth": str(i)}}
          for i, n in enumerate((5, 80, 10, 90, 7))]
  dataset = PromptDataset(rows, source="mem.jsonl")
  loader = make_loader(dataset, batch_size=3, max_prompt_length=48, filter_overlong=True)
  assert loader.kept.tolist() == [0, 2, 4] and loader.dropped == 2 and len(loader) == 1
  for _ in range(3):  # every epoch draws from the kept rows only
    assert sorted(loader.next_batch()["row_index"].tolist()) == [0, 2, 4]
  with pytest.raises(ValueError, match=r"rows \[1\] were left out"):
    loader.collate([0, 1])
  with pytest.raises(ValueError, match=r"3 rows \(2 longer than max_prompt_length=48 left "
                     r"out\) cannot fill one batch of 4"):
    make_loader(dataset, batch_size=4, max_prompt_length=48, filter_overlong=True)
  with pytest.raises(ValueError, match="choose one"):
    make_loader(dataset, max_prompt_length=48, filter_overlong=True, truncate=True)
  # Another max_prompt_length keeps another set of rows of the same size: no resume.
  others = PromptDataset(rows[1:] + rows[:1], source="mem.jsonl")  # 80, 10, 90, 7, 5
  moved = make_loader(others, batch_size=3, max_prompt_length=48, filter_overlong=True)
  assert len(moved.kept) == len(loader.kept)
  with pytest.raises(ValueError, match="rows_digest"):
    moved.load_state_dict(loader.state_dict())
  # With nothing left out, the order (and so a resume) is the unfiltered loader's.
  plain, filtered = make_loader(train), make_loader(train, filter_overlong=True)
  same_batches([plain.next_batch() for _ in range(8)], [filtered.next_batch() for _ in range(8)])


def test_too_few_rows_for_a_batch(train):
  with pytest.raises(ValueError, match="cannot fill one batch"):
    make_loader(train, batch_size=24)
