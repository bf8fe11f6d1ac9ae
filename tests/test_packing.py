"""Packed passes (verl's use_remove_padding) and token-budget micro-batches: the plan, the
packed log-probs, and the actor's update against the padded path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hflax.controller.packing import (bucket, first_fit_decreasing, micro_batch_plans, pack,
                                      row_bucket, unpack)


def rollout_mask(prompt_lengths, response_lengths, prompt_width, response_width):
  """attention mask of left-padded prompts and right-padded responses."""
  rows = []
  for p, r in zip(prompt_lengths, response_lengths):
    rows.append([0] * (prompt_width - p) + [1] * p + [1] * r + [0] * (response_width - r))
  return np.asarray(rows, np.int32)


def random_mask(rng, rows, prompt_width=6, response_width=20):
  return rollout_mask(rng.integers(1, prompt_width + 1, rows),
                      rng.integers(0, response_width + 1, rows), prompt_width, response_width)


def check_plan_covers(mask, width, plans):
  """Every valid token exactly once, segments within one row, positions restart."""
  T = mask.shape[1]
  seen = np.zeros(mask.size, int)
  member = np.zeros(len(mask), int)
  for plan in plans:
    member += plan.member
    valid = plan.segment_ids > 0
    np.add.at(seen, plan.token_index[valid], 1)
    for r in range(plan.segment_ids.shape[0]):
      for k in set(plan.segment_ids[r][plan.segment_ids[r] > 0].tolist()):
        at = np.flatnonzero(plan.segment_ids[r] == k)
        np.testing.assert_array_equal(np.diff(at), 1)  # contiguous, one row
        rows = set((plan.token_index[r, at] // T).tolist())
        assert len(rows) == 1  # one sequence per segment
        np.testing.assert_array_equal(plan.positions[r, at], np.arange(len(at)))
  np.testing.assert_array_equal(seen, mask.reshape(-1))
  np.testing.assert_array_equal(member, mask.any(axis=1).astype(int))


def test_plans_hold_every_token_once_within_budget_and_round_trip():
  rng = np.random.default_rng(0)
  mask = random_mask(rng, 13)
  width, T = 20, mask.shape[1]
  lengths = mask.sum(1)
  for plans in (micro_batch_plans(mask, width, multiple=2),
                micro_batch_plans(mask, width, multiple=2, budget=40),
                micro_batch_plans(mask, width, multiple=4, groups=[np.arange(0, 13, 2),
                                                                   np.arange(1, 13, 2)])):
    check_plan_covers(mask, width, plans)
  for plan in micro_batch_plans(mask, width, multiple=2, budget=40):
    assert plan.segment_ids.shape[0] == 2 and plan.segment_ids.shape[1] <= 40
    assert (np.count_nonzero(plan.segment_ids, axis=1) <= 40).all()
  # Round trip: a per-token value written at packed positions comes back where it was.
  values = rng.normal(size=mask.shape)
  back = np.zeros((len(mask), width))
  for plan in micro_batch_plans(mask, width, multiple=2, budget=40):
    packed = np.where(plan.segment_ids > 0, values.reshape(-1)[plan.token_index], 0)
    back += unpack(packed, plan)
  scored = (mask[:, T - width:] & mask[:, T - width - 1:-1]).astype(bool)
  np.testing.assert_array_equal(back, np.where(scored, values[:, T - width:], 0))
  assert lengths.sum() == sum(p.tokens for p in micro_batch_plans(mask, width, multiple=2,
                                                                  budget=40))


def test_first_fit_decreasing_and_buckets():
  assert first_fit_decreasing([5, 9, 2, 4, 6], 10) == [[1], [4, 3], [0, 2]]
  assert [bucket(n) for n in (1, 16, 17, 24, 25, 33, 100)] == [16, 16, 24, 24, 32, 48, 128]
  assert bucket(100, cap=110) == 110 and bucket(100, cap=90) == 100
  assert [row_bucket(n, 2) for n in (1, 2, 3, 5, 9)] == [2, 2, 4, 8, 16]
  with pytest.raises(ValueError, match=r"^actor.ppo_max_token_len_per_gpu: 8 tokens is less than "
                     r"the longest sequence \(9 tokens\)"):
    first_fit_decreasing([5, 9], 8, field="actor.ppo_max_token_len_per_gpu")


def test_pack_refuses_rows_too_short():
  mask = rollout_mask([2, 3], [4, 1], 3, 4)
  with pytest.raises(ValueError, match="do not fit"):
    pack(mask, 4, [[0, 1]], length=8)
