"""Packed passes (verl's use_remove_padding) and token-budget micro-batches: the plan, the
packed log-probs, and the actor's update against the padded path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hflax.controller.packing import (FILL_SPLIT, balance, fine_bucket, micro_batch_plans,
                                      pack, response_layout, sequence_lengths, shape_floor,
                                      unpack)


def rollout_mask(prompt_lengths, response_lengths, prompt_width, response_width):
  """attention mask of left-padded prompts and right-padded responses."""
  rows = []
  for p, r in zip(prompt_lengths, response_lengths):
    rows.append([0] * (prompt_width - p) + [1] * p + [1] * r + [0] * (response_width - r))
  return np.asarray(rows, np.int32)


def random_mask(rng, rows, prompt_width=6, response_width=20):
  return rollout_mask(rng.integers(1, prompt_width + 1, rows),
                      rng.integers(0, response_width + 1, rows), prompt_width, response_width)


def check_plan_covers(mask, width, plans, multiple):
  """Every valid token exactly once, segments within one row, positions restart; one
  shape for all plans, `multiple` rows each; every live row in exactly one slot."""
  T = mask.shape[1]
  seen = np.zeros(mask.size, int)
  member = np.zeros(len(mask), int)
  assert len({(p.segment_ids.shape, p.seq_rows.shape) for p in plans}) == 1
  for plan in plans:
    assert plan.segment_ids.shape[0] == multiple and len(plan.seq_rows) % multiple == 0
    np.add.at(member, plan.seq_rows[plan.member], 1)
    valid = plan.segment_ids > 0
    np.add.at(seen, plan.token_index[valid], 1)
    for r in range(plan.segment_ids.shape[0]):
      for k in set(plan.segment_ids[r][plan.segment_ids[r] > 0].tolist()):
        at = np.flatnonzero(plan.segment_ids[r] == k)
        np.testing.assert_array_equal(np.diff(at), 1)  # contiguous, one row
        rows = set((plan.token_index[r, at] // T).tolist())
        assert len(rows) == 1  # one sequence per segment
        np.testing.assert_array_equal(plan.positions[r, at], np.arange(len(at)))
        slot = np.flatnonzero(plan.member & (plan.seq_rows == rows.pop()))
        assert len(slot) == 1 and plan.seq_start[slot[0]] == r * plan.segment_ids.shape[1] + at[0]
  np.testing.assert_array_equal(seen, mask.reshape(-1))
  np.testing.assert_array_equal(member, mask.any(axis=1).astype(int))


def test_plans_hold_every_token_once_within_budget_and_round_trip():
  rng = np.random.default_rng(0)
  mask = random_mask(rng, 13)
  width, T = 20, mask.shape[1]
  lengths = mask.sum(1)
  groups = [np.arange(0, 13, 2), np.arange(1, 13, 2)]
  for multiple, kw in ((2, {}), (2, {"budget": 40}), (4, {"micro_batches": 2}), (3, {"budget": 26}),
                       (2, {"groups": groups})):
    plans = micro_batch_plans(mask, multiple=multiple, **kw)
    check_plan_covers(mask, width, plans, multiple)
    if "groups" in kw:  # each micro-batch holds its group's rows
      for plan, group in zip(plans, groups):
        assert set(plan.seq_rows[plan.member].tolist()) == set(group[lengths[group] > 0].tolist())
    assert sum(p.tokens for p in plans) == lengths.sum()
    if "budget" in kw:
      assert all(p.segment_ids.shape[1] <= kw["budget"] for p in plans)
  # Round trip: a per-token value written at packed positions comes back where it was.
  values = rng.normal(size=mask.shape)
  back = np.zeros((len(mask), width))
  for plan in micro_batch_plans(mask, multiple=2, budget=40):
    packed = np.where(plan.segment_ids > 0, values.reshape(-1)[plan.token_index], 0)
    back += unpack(packed, plan, mask, width)
  scored = (mask[:, T - width:] & mask[:, T - width - 1:-1]).astype(bool)
  np.testing.assert_array_equal(back, np.where(scored, values[:, T - width:], 0))


def test_balance_and_buckets():
  # Longest first into the least-filled: 9 | 6, 5 -> 11 | 4 -> 13 | 2 (tie: the first).
  assert balance([5, 9, 2, 4, 6], range(5), 2) == [[1, 3], [4, 0, 2]]
  assert [fine_bucket(n) for n in (1, 16, 17, 100, 129, 145, 300, 513, 1000, 1025, 3000)] == [
      16, 16, 32, 112, 144, 160, 320, 576, 1024, 1152, 3072]
  assert [fine_bucket(n, quantum=8) for n in (1, 9, 17, 33, 65)] == [8, 16, 24, 40, 72]
  assert fine_bucket(100, cap=110) == 110 and fine_bucket(100, cap=90) == 100
  sizes = {fine_bucket(n) for n in range(1, 4097)}
  assert len(sizes) == 8 + 8 * 5  # 16 .. 128, then 8 per doubling up to 4096
  assert all(n <= fine_bucket(n) < n + max(16, n / 8) for n in range(1, 5000))
  with pytest.raises(ValueError, match=r"^actor.ppo_max_token_len_per_gpu: 8 tokens is less than "
                     r"the longest sequence \(9 tokens\)"):
    micro_batch_plans(rollout_mask([4, 2], [5, 1], 4, 5), multiple=1, budget=8,
                      field="actor.ppo_max_token_len_per_gpu")


def test_packed_shapes_stay_few_however_lengths_vary():
  """50 batches of random lengths: the programs they need (one per packed shape) stay few,
  and the padding they compute stays under max(16, L / 8) per row."""
  rng = np.random.default_rng(3)
  shapes = {"rows": set(), "budget": set()}
  for _ in range(50):
    mask = random_mask(rng, 16, prompt_width=16, response_width=90)
    for key, kw in (("rows", {"micro_batches": 2}), ("budget", {"budget": 256})):
      plans = micro_batch_plans(mask, multiple=2, **kw)
      R, L = plans[0].segment_ids.shape
      shapes[key].add((len(plans), R, L, len(plans[0].seq_rows)))
      fullest = max(np.count_nonzero(p.segment_ids, axis=1).max() for p in plans)
      assert L - fullest < max(16, L / 8)
  # Rows of 144 .. 288 tokens (9 fine sizes), 8 or 16 slots, 2 or 3 micro-batches.
  every = shapes["rows"] | shapes["budget"]
  assert {s[2] for s in every} <= {fine_bucket(n) for n in range(129, 289)}
  assert {s[3] for s in every} <= {8, 16} and {s[0] for s in every} <= {2, 3}
  assert len(shapes["rows"]) <= 13 and len(shapes["budget"]) <= 13, shapes
  assert {s[1] for s in every} == {2}


def test_pack_refuses_rows_too_short():
  mask = rollout_mask([2, 3], [4, 1], 3, 4)
  with pytest.raises(ValueError, match="do not fit"):
    pack(mask, [[0, 1]], length=8)


TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4,
            num_kv_heads=2)


def unequal_rollout(rows=8, prompt_width=6, response_width=24, seed=0):
  """One long response, the others 3 tokens; prompts of varied lengths, left-padded."""
  rng = np.random.default_rng(seed)
  responses = [response_width] + [3] * (rows - 1)
  prompts = rng.integers(2, prompt_width + 1, rows)
  mask = rollout_mask(prompts, responses, prompt_width, response_width)
  tokens = np.where(mask > 0, rng.integers(1, 64, mask.shape), 0).astype(np.int32)
  response_mask = mask[:, prompt_width:].astype(np.float32)
  return tokens, mask, response_mask


def test_packed_log_probs_equal_the_padded_path():
  from hflax.models import ModelConfig, create
  from hflax.models.logprobs import packed_log_probs, sequence_log_probs
  graphdef, state = create(ModelConfig(**TINY), seed=0)
  tokens, mask, _ = unequal_rollout()
  width = 24
  # Compiled passes, not op-by-op ones: each distinct packed shape is one program.
  packed_log_probs = jax.jit(packed_log_probs, static_argnums=0, static_argnames="temperature")
  sequence_log_probs = jax.jit(sequence_log_probs, static_argnums=0,
                               static_argnames=("temperature", "last"))
  want_logp, want_ent = sequence_log_probs(graphdef, state, jnp.asarray(tokens), jnp.asarray(mask),
                                           temperature=0.7, last=width)
  for plans in (micro_batch_plans(mask, multiple=1),
                micro_batch_plans(mask, multiple=2, budget=32)):
    logp, ent = np.zeros(want_logp.shape), np.zeros(want_ent.shape)
    for plan in plans:
      packed = jnp.asarray(tokens.reshape(-1)[plan.token_index] * (plan.segment_ids > 0))
      index, valid = response_layout(mask[plan.seq_rows], width, plan.seq_start, plan.member)
      lp, en = packed_log_probs(graphdef, state, packed, jnp.asarray(plan.segment_ids), index,
                                valid, temperature=0.7)
      np.add.at(logp, plan.seq_rows, np.asarray(lp))
      np.add.at(ent, plan.seq_rows, np.asarray(en))
    np.testing.assert_allclose(logp, want_logp, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(ent, want_ent, atol=2e-5, rtol=1e-5)
  # One row holds the whole batch, under half its padded size.
  (one,) = micro_batch_plans(mask, multiple=1)
  assert one.computed == fine_bucket(int(mask.sum())) < mask.size / 2


def grpo_actor(update, devices=2, remove_padding=False, dtype="float32"):
  from hflax.algorithms.objectives import actor_loss
  from hflax.controller.training import OptimConfig
  from hflax.controller.actor import ActorRolloutWorker
  from hflax.models import ModelConfig, create
  from hflax.rollout import SamplingParams
  from hflax.sharding.placement import build_placement, colocated
  placed = build_placement(colocated(["actor"], devices))
  loss = actor_loss({"loss_agg_mode": "token-mean", "clip_ratio": 0.2, "entropy_coeff": 0.01})
  return ActorRolloutWorker(placed["actor"], *create(ModelConfig(**TINY, dtype=dtype), seed=0),
                            sampling=SamplingParams(max_new_tokens=4, n=1), loss_fn=loss,
                            optim=OptimConfig(lr=1e-2), update=update,
                            remove_padding=remove_padding)


ROWS = 64
# One 100-token response, the other 63 of 2 .. 8 tokens (2 + i % 7), all after 4-token
# prompts left-padded to 6: 104 + 63 * 6 + 9 * (0 + 1 + ... + 6) = 671 real tokens, where
# the padded path computes 64 x 106 = 6784.
REAL_TOKENS = 671


def grpo_batch(longest: int = 100, others: list[int] | None = None):
  from hflax.controller.batch import Batch
  rng = np.random.default_rng(1)
  others = [2 + i % 7 for i in range(ROWS - 1)] if others is None else others
  mask = rollout_mask([4] * ROWS, [longest] + others, 6, 100)
  tokens = np.where(mask > 0, rng.integers(1, 64, mask.shape), 0).astype(np.int32)
  response_mask = mask[:, 6:].astype(np.float32)
  old = np.where(response_mask > 0, rng.normal(-4.0, 0.3, response_mask.shape), 0)
  advantages = rng.normal(size=(ROWS, 1)) * response_mask
  return Batch({"input_ids": jnp.asarray(tokens), "attention_mask": jnp.asarray(mask),
                "responses": jnp.asarray(tokens[:, 6:]), "response_mask": jnp.asarray(response_mask),
                "old_log_probs": jnp.asarray(old, jnp.float32),
                "advantages": jnp.asarray(advantages, jnp.float32)})


def assert_same_update(params, metrics, want_params, want_metrics):
  for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl",
              "actor/pg_clipfrac"):
    np.testing.assert_allclose(float(metrics[key]), float(want_metrics[key]), rtol=1e-4,
                               atol=1e-6, err_msg=key)
  for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(want_params)):
    # Adam's first step is lr * g / (|g| + eps): float noise dg in a gradient near eps moves
    # it by up to lr * dg / (4 eps), ~lr/40 for dg ~ 1e-9 (measured: 1.24e-4 at lr 1e-2 on
    # a Xeon with AVX-512, 1 of 2048 entries). The metrics above carry the exact checks.
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=2.5e-4)


@pytest.fixture(scope="module")
def padded_grpo_step():
  """The padded path's log-probs, then its update (2 devices, micro-batches of 32 rows)."""
  from hflax.controller.training import UpdateConfig
  batch = grpo_batch()
  actor = grpo_actor(UpdateConfig(mini_batch_size=ROWS, micro_batch_size=ROWS // 2))
  logp = np.asarray(actor.compute_log_prob(batch)["old_log_probs"])
  metrics = {k: float(v) for k, v in actor.update_actor(batch).meta["metrics"].items()}
  return batch, logp, actor.params, metrics


def test_unequal_grpo_update_computes_almost_no_padding(padded_grpo_step):
  from hflax.controller.training import UpdateConfig
  batch, want_logp, want_params, want = padded_grpo_step
  actor = grpo_actor(UpdateConfig(mini_batch_size=ROWS, micro_batch_size=ROWS // 2,
                                  remove_padding=True))
  # The log-prob pass: one cut, 2 rows (one per device) of 671 tokens balanced.
  np.testing.assert_allclose(np.asarray(actor.compute_log_prob(batch)["old_log_probs"]),
                             want_logp, atol=2e-5, rtol=1e-5)
  got = actor.update_actor(batch).meta["metrics"]
  assert_same_update(actor.params, got, want_params, want)
  # 2 micro-batches x 2 devices = 4 rows, 167.75 tokens on average: the 104-token
  # sequence, then the 6 .. 12-token ones longest first into the least-filled row, end
  # below 167.75 + 12, so every row fits the fine bucket 176 (sizes 160, 176 at 1/8 of
  # 128 .. 256): 4 x 176 = 704 computed, 33 of them padding (4.9%).
  assert float(got["actor/update_tokens"]) == REAL_TOKENS
  assert float(got["actor/update_micro_batches"]) == 2
  assert float(got["actor/update_padded_tokens"]) == 4 * 176 - REAL_TOKENS
  assert float(got["actor/update_padded_tokens"]) < 0.1 * REAL_TOKENS


def test_a_shorter_batch_reuses_the_longer_ones_program():
  """Packed shapes only grow within a run (shape_floor): the second update's 40-token
  shorter batch is packed at the first's length and runs the compiled program again."""
  from hflax.controller.training import UpdateConfig
  actor = grpo_actor(UpdateConfig(mini_batch_size=ROWS, micro_batch_size=ROWS // 2,
                                  remove_padding=True))
  first = actor.update_actor(grpo_batch())
  second = actor.update_actor(grpo_batch(longest=60)).meta["metrics"]
  (key,) = [k for k in actor._steps if k[0] == "packed"]
  assert actor._steps[key]._cache_size() == 1
  assert float(first.meta["metrics"]["actor/update_padded_tokens"]) == 4 * 176 - REAL_TOKENS
  shorter = REAL_TOKENS - 40  # alone it would fit 4 rows of 160 (the bucket below 176)
  assert float(second["actor/update_tokens"]) == shorter
  assert float(second["actor/update_padded_tokens"]) == 4 * 176 - shorter


# (micro-batches, packed length, of them used by the short batch) of the long batch's plan:
# the tiny model's compute is far under MIN_SPLIT_FLOPS (4 micro-batches), unless the test
# lowers it (FILL_SPLIT x 4).
_FILL_CASES = {"coarse": (None, 4, 416, 1), "split": (1.0, 8, 224, 2)}


def long_then_short(packed: bool):
  """An actor (micro-batches of 16 rows) after one update on a batch of long answers (104 +
  63 x 44 = 2876 tokens), then one on grpo_batch(): (actor, first metrics, second metrics)."""
  from hflax.controller.training import UpdateConfig
  actor = grpo_actor(UpdateConfig(mini_batch_size=ROWS, micro_batch_size=ROWS // 4,
                                  remove_padding=packed))
  first = actor.update_actor(grpo_batch(others=[40] * (ROWS - 1))).meta["metrics"]
  return actor, first, actor.update_actor(grpo_batch()).meta["metrics"]


@pytest.fixture(scope="module")
def padded_long_then_short():
  """The padded path's two updates: the reference of every packed case below (the packed
  path's settings, MIN_SPLIT_FLOPS included, do not reach it)."""
  return long_then_short(packed=False)


@pytest.mark.parametrize("case", _FILL_CASES)
def test_a_much_shorter_batch_fills_fewer_micro_batches_of_the_same_program(
    case, monkeypatch, padded_long_then_short):
  """After a batch of long answers sets the packed shape, a batch of short ones fills the
  fewest micro-batches that hold its 671 tokens instead of all of them, mostly padding;
  the program skips the empty ones, compiles once, and steps as the padded path."""
  from hflax.controller import workers
  min_flops, cuts, length, used = _FILL_CASES[case]
  if min_flops is not None:
    monkeypatch.setattr(workers, "MIN_SPLIT_FLOPS", min_flops)
  want_actor, _, want = padded_long_then_short
  actor, first, got = long_then_short(packed=True)
  assert_same_update(actor.params, got, want_actor.params, want)
  (key,) = [k for k in actor._steps if k[0] == "packed"]
  assert actor._steps[key]._cache_size() == 1
  # coarse: 4 micro-batches x 2 devices, 8 rows of 2876 / 8 = 359.5 on average; 44-token
  # sequences (and the 104) longest first into the least-filled row: the fullest is over
  # 384, bucket 416 (a step of 32 from 256 to 512). The short batch fits 2 rows of it.
  # split: 16 rows of 179.75 on average, above the longest sequence (104), so the finer
  # cut applies: the 104 row ends at 104 + 2 x 44 = 192, 14 rows at 4 x 44 = 176 and the
  # last of the 63 44-token sequences makes one row 220: bucket 224 (a step of 16 from 128
  # to 256). The short batch fits 4 rows of it.
  assert float(first["actor/update_micro_batches"]) == cuts
  assert float(first["actor/update_padded_tokens"]) == 2 * cuts * length - 2876
  assert float(got["actor/update_micro_batches"]) == used
  assert float(got["actor/update_tokens"]) == REAL_TOKENS
  assert float(got["actor/update_padded_tokens"]) == 2 * used * length - REAL_TOKENS


@pytest.mark.parametrize("dtype, cuts", [("float32", 8), ("bfloat16", 4)])
def test_low_precision_on_a_cpu_cuts_finer_only_where_rows_hold_four_times_more(dtype, cuts,
                                                                                monkeypatch):
  """The long batch's split rows would hold 179.75 tokens on average: over a 100-token
  threshold (float32), under the 400 that bfloat16 matmuls on a CPU need."""
  from hflax.controller import workers
  from hflax.controller.training import UpdateConfig
  from hflax.models import ModelConfig
  monkeypatch.setattr(workers, "MIN_SPLIT_FLOPS", 100 * 6 * ModelConfig(**TINY).num_params)
  actor = grpo_actor(UpdateConfig(mini_batch_size=ROWS, micro_batch_size=ROWS // 4,
                                  remove_padding=True), dtype=dtype)
  metrics = actor.update_actor(grpo_batch(others=[40] * (ROWS - 1))).meta["metrics"]
  assert float(metrics["actor/update_micro_batches"]) == cuts


def test_fill_fewest_plans():
  """fill_fewest: the plans keep the floor's shape and the micro-batch count, every
  micro-batch with a slot per row; the tokens fill the fewest that fit, the rest empty."""
  rng = np.random.default_rng(5)
  mask = random_mask(rng, 16, prompt_width=16, response_width=90)
  tokens = int(mask.sum())
  # No floor yet (a run's first batch): the usual plans, with a slot per row.
  plans = micro_batch_plans(mask, multiple=2, micro_batches=4, fill_fewest=True)
  assert all(p.member.any() for p in plans) and len(plans[0].seq_rows) == 16
  tight = plans[0].segment_ids.shape[1]  # 8 rows of it hold the batch; 6 cannot
  assert 6 * tight < tokens <= 8 * tight
  for length, used in ((512, -(-tokens // 1024)), (tight, 4)):
    plans = micro_batch_plans(mask, multiple=2, micro_batches=4, floor=(length, 0),
                              fill_fewest=True)
    check_plan_covers(mask, 90, plans, 2)
    assert len(plans) == 4 and plans[0].segment_ids.shape == (2, length)
    assert all(len(p.seq_rows) == 16 for p in plans)
    assert [bool(p.member.any()) for p in plans] == [True] * used + [False] * (4 - used)
  # The longest sequence is over half a mean row of 4 micro-batches: no finer cut. Where
  # the floor already holds a micro-batch count (a run's first batch chose it), it stays.
  assert max(sequence_lengths(mask)) * 8 * 2 > tokens
  plans = micro_batch_plans(mask, multiple=2, micro_batches=4, floor=(tight, 0, 8),
                            fill_fewest=True)
  check_plan_covers(mask, 90, plans, 2)
  assert len(plans) == 8 and sum(bool(p.member.any()) for p in plans) == 4


def test_fill_fewest_cuts_finer_where_the_longest_sequence_fits():
  """A batch whose longest sequence fits a mean row of FILL_SPLIT x the micro-batches (and
  split_tokens: none by default) is cut that much finer; shape_floor keeps the count for
  the run's later batches."""
  rng = np.random.default_rng(6)
  mask = random_mask(rng, 64, prompt_width=16, response_width=40)
  assert max(sequence_lengths(mask)) * 8 * 2 <= mask.sum()
  assert len(micro_batch_plans(mask, multiple=2, micro_batches=4, fill_fewest=True)) == 4
  plans = micro_batch_plans(mask, multiple=2, micro_batches=4, fill_fewest=True,
                            split_tokens=1)
  check_plan_covers(mask, 40, plans, 2)
  assert len(plans) == 4 * FILL_SPLIT and all(p.member.any() for p in plans)
  floor = shape_floor(plans)
  assert floor == (plans[0].segment_ids.shape[1], 64, 8)
  short = mask.copy()
  short[:, 30:] = 0  # every response cut to 14 tokens: fewer micro-batches, same shape
  again = micro_batch_plans(short, multiple=2, micro_batches=4, floor=floor,
                            fill_fewest=True)
  check_plan_covers(short, 40, again, 2)
  assert len(again) == 8 and again[0].segment_ids.shape == plans[0].segment_ids.shape
  assert 0 < sum(bool(p.member.any()) for p in again) < 8
  assert shape_floor(again, floor) == floor


def test_token_budget_micro_batches_do_not_change_the_step(padded_grpo_step):
  from hflax.controller.training import UpdateConfig
  batch, want_logp, want_params, want = padded_grpo_step
  # 2 devices, budget 176: ceil(671 / (2 x 176)) = 2 micro-batches, the rows above.
  # 1 device, budget 200: ceil(671 / 200) = 4 micro-batches of one row each, the same 4
  # rows. A budget of the longest sequence (104), 1 device: 7 micro-batches, rows of 104.
  for devices, budget, micro_batches, padded in ((2, 176, 2, 4 * 176 - REAL_TOKENS),
                                                 (1, 200, 4, 4 * 176 - REAL_TOKENS),
                                                 (1, 104, None, None)):
    actor = grpo_actor(UpdateConfig(mini_batch_size=ROWS, max_token_len=budget,
                                    log_prob_max_token_len=budget), devices)
    np.testing.assert_allclose(np.asarray(actor.compute_log_prob(batch)["old_log_probs"]),
                               want_logp, atol=2e-5, rtol=1e-5)
    got = actor.update_actor(batch).meta["metrics"]
    assert_same_update(actor.params, got, want_params, want)
    if micro_batches is None:  # ceil(671 / 104) = 7 rows; the balanced ones all fit 104
      assert float(got["actor/update_micro_batches"]) >= 7
      assert float(got["actor/update_padded_tokens"]) == (
          float(got["actor/update_micro_batches"]) * 104 - REAL_TOKENS)
    else:
      assert float(got["actor/update_micro_batches"]) == micro_batches
      assert float(got["actor/update_padded_tokens"]) == padded
  with pytest.raises(ValueError, match=r"^actor.ppo_max_token_len_per_gpu: 100 tokens is less "
                                       r"than the longest sequence \(104 tokens\)"):
    grpo_actor(UpdateConfig(mini_batch_size=ROWS, max_token_len=100)).update_actor(batch)
  with pytest.raises(ValueError, match=r"^actor.log_prob_max_token_len_per_gpu: 50 tokens is "
                                       r"less than the longest sequence \(104 tokens\)"):
    grpo_actor(UpdateConfig(mini_batch_size=ROWS, log_prob_max_token_len=50)).compute_log_prob(
        batch)


def test_packed_ppo_step_equals_the_padded_one():
  """Actor, reference and critic passes on packed rows, through a whole PPO step."""
  from ppo_step import build_workers, ppo_step, prompts_batch
  from hflax.controller.training import UpdateConfig
  from hflax.sharding.placement import colocated
  roles = ["actor", "ref", "critic", "reward"]
  runs = []
  for packed in (False, True):
    update = UpdateConfig(mini_batch_size=8, micro_batch_size=4, remove_padding=packed)
    workers = build_workers(colocated(roles, 2), update=update)
    for role in ("actor", "ref", "critic"):
      workers[role].remove_padding = packed
    runs.append((workers, *ppo_step(workers, prompts_batch(8))))
  (ref_workers, want, want_metrics), (workers, got, got_metrics) = runs
  mask = np.asarray(want["response_mask"]) > 0
  for key in ("old_log_probs", "ref_log_prob", "values", "advantages"):
    np.testing.assert_allclose(np.asarray(got[key])[mask], np.asarray(want[key])[mask],
                               atol=2e-5, rtol=1e-5, err_msg=key)
  for key, value in want_metrics.items():
    if key.startswith(("actor/", "critic/")) and key in got_metrics:
      np.testing.assert_allclose(float(got_metrics[key]), float(value), rtol=1e-4, atol=1e-6,
                                 err_msg=key)
  assert float(got_metrics["critic/update_tokens"]) > 0
  for role in ("actor", "critic"):
    for a, b in zip(jax.tree.leaves(workers[role].params), jax.tree.leaves(ref_workers[role].params)):
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


def test_verl_packing_settings_reach_the_update_config():
  from hflax.launch.cli import load_config
  from hflax.launch.roles import _update, check_token_budgets
  c = load_config(["--config", "grpo.py", "actor_rollout_ref.model.use_remove_padding=False",
                   "actor_rollout_ref.actor.use_dynamic_bsz=True",
                   "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
                   "actor_rollout_ref.ref.log_prob_max_token_len_per_gpu=8192"])
  update = _update(c.actor, c.rollout.n, c.model)
  assert (update.remove_padding, update.max_token_len, update.log_prob_max_token_len) == (
      False, 4096, 8192)
  assert update.packed  # a token budget packs the update
  default = load_config(["--config", "grpo.py"])
  update = _update(default.actor, default.rollout.n, default.model)
  assert (update.remove_padding, update.max_token_len, update.log_prob_max_token_len) == (
      True, 0, 0)
  c = load_config(["--config", "ppo.py", "critic.use_dynamic_bsz=True",
                   "critic.ppo_max_token_len_per_gpu=50"])
  longest = c.data.max_prompt_length + c.data.max_response_length
  with pytest.raises(ValueError, match=rf"^config.critic.ppo_max_token_len_per_gpu: 50 tokens is "
                                       rf"less than the longest sequence \({longest} tokens"):
    check_token_budgets(c, ["actor", "critic"])
  check_token_budgets(c, ["actor"])  # the critic's budget is not the actor's business
  from hflax.launch.config import validate
  with pytest.raises(ValueError, match=r"actor.ppo_max_token_len_per_gpu: must be"):
    validate(load_config(["--config", "grpo.py",
                          "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=0"]))
