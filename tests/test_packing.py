"""Packed passes (verl's use_remove_padding) and token-budget micro-batches: the plan, the
packed log-probs, and the actor's update against the padded path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hflax.controller.packing import (bucket, first_fit_decreasing, micro_batch_plans, pack,
                                      response_layout, row_bucket, unpack)


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
  for plans in (micro_batch_plans(mask, multiple=2),
                micro_batch_plans(mask, multiple=2, budget=40),
                micro_batch_plans(mask, multiple=4, groups=[np.arange(0, 13, 2),
                                                                   np.arange(1, 13, 2)])):
    check_plan_covers(mask, width, plans)
  for plan in micro_batch_plans(mask, multiple=2, budget=40):
    assert plan.segment_ids.shape[0] == 2 and plan.segment_ids.shape[1] <= 40
    assert (np.count_nonzero(plan.segment_ids, axis=1) <= 40).all()
  # Round trip: a per-token value written at packed positions comes back where it was.
  values = rng.normal(size=mask.shape)
  back = np.zeros((len(mask), width))
  for plan in micro_batch_plans(mask, multiple=2, budget=40):
    packed = np.where(plan.segment_ids > 0, values.reshape(-1)[plan.token_index], 0)
    back += unpack(packed, plan, mask, width)
  scored = (mask[:, T - width:] & mask[:, T - width - 1:-1]).astype(bool)
  np.testing.assert_array_equal(back, np.where(scored, values[:, T - width:], 0))
  assert lengths.sum() == sum(p.tokens for p in micro_batch_plans(mask, multiple=2,
                                                                  budget=40))


def test_first_fit_decreasing_and_buckets():
  assert first_fit_decreasing([5, 9, 2, 4, 6], 10) == [[1], [4, 3], [0, 2]]
  assert [bucket(n) for n in (1, 16, 17, 24, 25, 33, 100)] == [16, 16, 24, 24, 32, 48, 128]
  assert bucket(100, cap=110) == 110 and bucket(100, cap=90) == 100
  assert [row_bucket(n, 2) for n in (1, 2, 3, 5, 9)] == [2, 2, 4, 8, 16]
  with pytest.raises(ValueError, match=r"^actor.ppo_max_token_len_per_gpu: 8 tokens is less than "
                     r"the longest sequence \(9 tokens\)"):
    first_fit_decreasing([5, 9], 8, field="actor.ppo_max_token_len_per_gpu")


def test_packed_shapes_stay_few_however_lengths_vary():
  """50 batches of random lengths: the programs they need (one per packed shape) stay few."""
  rng = np.random.default_rng(3)
  shapes = {"rows": set(), "budget": set()}
  for _ in range(50):
    mask = random_mask(rng, 16, prompt_width=16, response_width=90)
    groups = [np.arange(m, 16, 2) for m in range(2)]
    shapes["rows"] |= {p.segment_ids.shape for p in micro_batch_plans(mask, multiple=2,
                                                                       groups=groups)}
    shapes["budget"] |= {p.segment_ids.shape for p in micro_batch_plans(mask, multiple=2,
                                                                         budget=256)}
  # Lengths 16, 24, 32, 48, 64, 96 and the caps (106 = the padded width, 256), rows 2 x 2^k.
  assert len(shapes["rows"]) <= 10 and len(shapes["budget"]) <= 9, shapes
  assert {r for r, _ in shapes["budget"]} == {2}


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
  want_logp, want_ent = sequence_log_probs(graphdef, state, jnp.asarray(tokens), jnp.asarray(mask),
                                           temperature=0.7, last=width)
  for plans in (micro_batch_plans(mask, multiple=1),
                micro_batch_plans(mask, multiple=2, budget=32)):
    logp, ent = 0.0, 0.0
    for plan in plans:
      packed = jnp.asarray(tokens.reshape(-1)[plan.token_index] * (plan.segment_ids > 0))
      index, valid = response_layout(mask, width, plan.seq_start, plan.member)
      lp, en = packed_log_probs(graphdef, state, packed, jnp.asarray(plan.segment_ids), index,
                                valid, temperature=0.7)
      logp, ent = logp + lp, ent + en
    np.testing.assert_allclose(logp, want_logp, atol=2e-5, rtol=1e-5)
    np.testing.assert_allclose(ent, want_ent, atol=2e-5, rtol=1e-5)
  assert sum(p.computed for p in plans) < mask.size / 2  # and the packing saved the padding


def grpo_actor(update, devices=2, remove_padding=False):
  from hflax.algorithms.objectives import actor_loss
  from hflax.controller.training import OptimConfig
  from hflax.controller.workers import ActorRolloutWorker
  from hflax.models import ModelConfig, create
  from hflax.rollout import SamplingParams
  from hflax.sharding.placement import build_placement, colocated
  placed = build_placement(colocated(["actor"], devices))
  loss = actor_loss({"loss_agg_mode": "token-mean", "clip_ratio": 0.2, "entropy_coeff": 0.01})
  return ActorRolloutWorker(placed["actor"], *create(ModelConfig(**TINY), seed=0),
                            sampling=SamplingParams(max_new_tokens=4, n=1), loss_fn=loss,
                            optim=OptimConfig(lr=1e-2), update=update,
                            remove_padding=remove_padding)


def grpo_batch(response_width=100, rows=8):
  """1 row with a 100-token response, the others 3; 4-token prompts left-padded to 6."""
  from hflax.controller.batch import Batch
  rng = np.random.default_rng(1)
  mask = rollout_mask([4] * rows, [response_width] + [3] * (rows - 1), 6, response_width)
  tokens = np.where(mask > 0, rng.integers(1, 64, mask.shape), 0).astype(np.int32)
  response_mask = mask[:, 6:].astype(np.float32)
  old = np.where(response_mask > 0, rng.normal(-4.0, 0.3, response_mask.shape), 0)
  advantages = rng.normal(size=(rows, 1)) * response_mask
  return Batch({"input_ids": jnp.asarray(tokens), "attention_mask": jnp.asarray(mask),
                "responses": jnp.asarray(tokens[:, 6:]), "response_mask": jnp.asarray(response_mask),
                "old_log_probs": jnp.asarray(old, jnp.float32),
                "advantages": jnp.asarray(advantages, jnp.float32)})


def assert_same_update(a, b, metrics_a, metrics_b):
  for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "actor/ppo_kl",
              "actor/pg_clipfrac"):
    np.testing.assert_allclose(float(metrics_a[key]), float(metrics_b[key]), rtol=1e-4,
                               atol=1e-6, err_msg=key)
  for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
    # Adam at lr 1e-2 turns float noise in near-zero gradients into ~lr/100 steps.
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-4)


def test_packed_grpo_update_equals_the_padded_one():
  from hflax.controller.training import UpdateConfig
  batch = grpo_batch()
  padded = grpo_actor(UpdateConfig(mini_batch_size=8, micro_batch_size=4))
  packed = grpo_actor(UpdateConfig(mini_batch_size=8, micro_batch_size=4, remove_padding=True),
                      remove_padding=True)
  # The log-prob passes agree (before the updates, which leave float noise in the weights).
  np.testing.assert_allclose(np.asarray(packed.compute_log_prob(batch)["old_log_probs"]),
                             np.asarray(padded.compute_log_prob(batch)["old_log_probs"]),
                             atol=2e-5, rtol=1e-5)
  want = padded.update_actor(batch).meta["metrics"]
  got = packed.update_actor(batch).meta["metrics"]
  assert_same_update(packed, padded, got, want)
  # Row groups {0, 2, 4, 6}: [104] and [7, 7, 7] in 2 rows of 106 (the padded width caps
  # the 128 bucket); {1, 3, 5, 7}: 28 tokens in 2 rows of 32 (one per device). The padded
  # path computes 8 x 106 = 848.
  assert float(got["actor/update_tokens"]) == 104 + 7 * 7
  assert float(got["actor/update_padded_tokens"]) == 2 * 106 + 2 * 32 - 153


def test_token_budget_micro_batches_do_not_change_the_step():
  from hflax.controller.training import UpdateConfig
  batch = grpo_batch()
  whole = grpo_actor(UpdateConfig(mini_batch_size=8, remove_padding=True))
  want_logp = np.asarray(whole.compute_log_prob(batch)["old_log_probs"])
  want = whole.update_actor(batch).meta["metrics"]
  # 2 devices, 112 tokens: [104, 7] and [7 x 6] in one micro-batch of 2 rows of 112.
  # 1 device, 104 tokens: [104], then [7 x 7] in a row of 64 (bucketed up from 49).
  for devices, budget, micro_batches, padded in ((2, 112, 1, 2 * 112 - 153),
                                                 (1, 104, 2, 104 + 64 - 153)):
    actor = grpo_actor(UpdateConfig(mini_batch_size=8, max_token_len=budget,
                                    log_prob_max_token_len=budget), devices)
    np.testing.assert_allclose(np.asarray(actor.compute_log_prob(batch)["old_log_probs"]),
                               want_logp, atol=2e-5, rtol=1e-5)
    got = actor.update_actor(batch).meta["metrics"]
    assert_same_update(actor, whole, got, want)
    assert float(got["actor/update_micro_batches"]) == micro_batches
    assert float(got["actor/update_padded_tokens"]) == padded
  with pytest.raises(ValueError, match=r"^actor.ppo_max_token_len_per_gpu: 100 tokens is less "
                                       r"than the longest sequence \(104 tokens\)"):
    grpo_actor(UpdateConfig(mini_batch_size=8, max_token_len=100)).update_actor(batch)


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
