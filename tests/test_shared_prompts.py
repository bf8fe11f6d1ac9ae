"""Packed passes compute a prompt that several rows repeat (GRPO's n samples) once: the
plan's layout, log-probs and a GRPO update against the padded path, the switch off."""
import jax.numpy as jnp
import numpy as np
import pytest

from hflax.controller.packing import (fine_bucket, micro_batch_plans, prompt_groups,
                                      response_before, response_layout)
from test_packing import TINY, assert_same_update, grpo_actor, rollout_mask

PROMPT_WIDTH, WIDTH = 6, 30
# 4 prompts x 4 samples; each group is its prompt + its responses = 40 tokens.
PROMPTS = [3, 5, 6, 4]
RESPONSES = [[20, 1, 9, 7], [12, 0, 15, 8], [2, 30, 1, 1], [9, 9, 9, 9]]
SHARED = 40 * 4  # tokens the shared layout computes
REAL = SHARED + 3 * sum(PROMPTS)  # 214: the padded rows' valid tokens


def grpo_rollout(seed=0, prompts=PROMPTS, responses=RESPONSES):
  """Rows 4g .. 4g + 3 repeat prompt g (as rollout.n does); responses of unequal length."""
  rng = np.random.default_rng(seed)
  n = len(responses[0])
  mask = rollout_mask(np.repeat(prompts, n), np.concatenate(responses), PROMPT_WIDTH, WIDTH)
  tokens = rng.integers(1, 64, mask.shape)
  for g in range(len(prompts)):  # the same prompt tokens in every row of a group
    tokens[g * n:(g + 1) * n, :PROMPT_WIDTH] = tokens[g * n, :PROMPT_WIDTH]
  return np.where(mask > 0, tokens, 0).astype(np.int32), mask


def plans_of(tokens, mask, **kw):
  return micro_batch_plans(mask, prompts=prompt_groups(tokens, mask, PROMPT_WIDTH),
                           prompt_width=PROMPT_WIDTH, **kw)


def test_each_group_lays_its_prompt_once_then_its_responses():
  tokens, mask = grpo_rollout()
  T = mask.shape[1]
  ids = prompt_groups(tokens, mask, PROMPT_WIDTH).reshape(4, 4)  # a group's rows one id
  assert (ids == ids[:, :1]).all() and len(set(ids[:, 0].tolist())) == 4
  plans = plans_of(tokens, mask, multiple=2, micro_batches=2)
  # One group per packed row (each 40 tokens, so no cut balances better).
  assert [p.tokens for p in plans] == [80, 80] and sum(p.shared_prompt_tokens for p in plans) == 54
  assert all(p.segment_ids.shape == (2, fine_bucket(40)) for p in plans)
  flat = tokens.reshape(-1)
  for plan in plans:
    L = plan.segment_ids.shape[1]
    for r in range(2):
      seg, prefix = plan.segment_ids[r], plan.prefix_ids[r]
      rows = sorted(plan.seq_rows[plan.member & (plan.seq_start // L == r)].tolist())
      g, p = rows[0] // 4, PROMPTS[rows[0] // 4]
      assert rows == list(range(4 * g, 4 * g + 4))
      # [prompt: segment 1][response i: segment i + 2, prefix 1], then padding
      want_seg = np.repeat(np.arange(1, 6), [p] + RESPONSES[g])
      np.testing.assert_array_equal(seg[:40], want_seg)
      assert not seg[40:].any()
      np.testing.assert_array_equal(prefix[:40], 1)  # the prompt's segment
      want_pos = np.concatenate([np.arange(p)] + [p + np.arange(n) for n in RESPONSES[g]])
      np.testing.assert_array_equal(plan.positions[r, :40], want_pos)
      packed = np.where(seg > 0, flat[plan.token_index[r]], 0)
      # The response tokens after each other, the padded rows' tokens in order.
      for i, b in enumerate(rows):
        np.testing.assert_array_equal(packed[:40][want_seg == i + 2],
                                      tokens[b, PROMPT_WIDTH:PROMPT_WIDTH + RESPONSES[g][i]])
        np.testing.assert_array_equal(packed[:p], tokens[b, PROMPT_WIDTH - p:PROMPT_WIDTH])
    # Each slot's response tokens and the tokens that predict them (the prompt's last for
    # the first), flat in the packed rows.
    index, scored = response_layout(mask[plan.seq_rows], WIDTH, plan.seq_start, plan.member)
    before = np.asarray(response_before(index, plan.prompt_last, scored))
    index, scored = np.asarray(index), np.asarray(scored)
    packed = np.where(plan.segment_ids > 0, flat[plan.token_index], 0).reshape(-1)
    for s, b in enumerate(plan.seq_rows[plan.member]):
      n = mask[b, PROMPT_WIDTH:].sum()
      assert scored[s].sum() == n
      np.testing.assert_array_equal(packed[index[s, :n]], tokens[b, PROMPT_WIDTH:PROMPT_WIDTH + n])
      want_before = np.concatenate([[PROMPT_WIDTH - 1], PROMPT_WIDTH + np.arange(n - 1)])[:n]
      np.testing.assert_array_equal(packed[before[s, :n]], tokens[b, want_before])
      if n:
        assert before[s, 0] == plan.prompt_last[s] and plan.prompt_last[s] >= 0


def test_a_group_is_cut_when_it_would_leave_rows_empty():
  # One prompt of 6 tokens, 8 samples of 10, over 4 rows: whole it fills one row of 86;
  # cut in 4 units of 6 + 2 x 10 the rows hold 26 each, the prompt computed 4 times.
  tokens, mask = grpo_rollout(prompts=[6], responses=[[10] * 8])
  (plan,) = plans_of(tokens, mask, multiple=4)
  assert plan.segment_ids.shape == (4, fine_bucket(26)) and plan.tokens == 4 * 26
  assert plan.shared_prompt_tokens == 4 * 6
  # With the budget of one row of the whole group it stays whole.
  plans = plans_of(tokens, mask, multiple=1, budget=86)
  assert len(plans) == 1 and plans[0].tokens == 86 and plans[0].shared_prompt_tokens == 7 * 6


def test_distinct_prompts_and_the_switch_off_give_the_unshared_plan():
  tokens, mask = grpo_rollout()
  tokens[:, :PROMPT_WIDTH] += np.arange(16)[:, None] * (mask[:, :PROMPT_WIDTH] > 0)  # PPO-like
  for kw in ({"multiple": 2, "micro_batches": 2}, {"multiple": 2, "budget": 48}):
    want = micro_batch_plans(mask, **kw)  # prompts=None: sharing off
    got = plans_of(tokens, mask, **kw)
    assert len(got) == len(want)
    for a, b in zip(got, want):
      assert a.shared_prompt_tokens == 0
      for key, value in b.arrays(True).items():
        np.testing.assert_array_equal(a.arrays(True)[key], value, err_msg=key)
      assert set(a.arrays()) == set(b.arrays()) and "prefix_ids" not in a.arrays()


def test_shared_prompt_log_probs_equal_the_padded_path():
  from hflax.models import ModelConfig, create
  from hflax.models.logprobs import packed_log_probs, sequence_log_probs
  graphdef, state = create(ModelConfig(**TINY), seed=0)
  tokens, mask = grpo_rollout(seed=1)
  want_logp, want_ent = sequence_log_probs(graphdef, state, jnp.asarray(tokens),
                                           jnp.asarray(mask), temperature=0.7, last=WIDTH)
  for kw in ({"multiple": 1}, {"multiple": 2, "micro_batches": 2}, {"multiple": 2, "budget": 48}):
    logp, ent = np.zeros(want_logp.shape), np.zeros(want_ent.shape)
    plans = plans_of(tokens, mask, **kw)
    assert sum(p.shared_prompt_tokens for p in plans) > 0
    for plan in plans:
      packed = jnp.asarray(tokens.reshape(-1)[plan.token_index] * (plan.segment_ids > 0))
      index, valid = response_layout(mask[plan.seq_rows], WIDTH, plan.seq_start, plan.member)
      lp, en = packed_log_probs(graphdef, state, packed, jnp.asarray(plan.segment_ids), index,
                                valid, temperature=0.7, positions_RxL=jnp.asarray(plan.positions),
                                prefix_ids_RxL=jnp.asarray(plan.prefix_ids),
                                before_index_BxW=response_before(index, plan.prompt_last, valid))
      np.add.at(logp, plan.seq_rows, np.asarray(lp))
      np.add.at(ent, plan.seq_rows, np.asarray(en))
    np.testing.assert_allclose(logp, want_logp, atol=2e-5, rtol=1e-5, err_msg=str(kw))
    np.testing.assert_allclose(ent, want_ent, atol=2e-5, rtol=1e-5, err_msg=str(kw))


def grpo_batch():
  from hflax.controller.batch import Batch
  tokens, mask = grpo_rollout(seed=2)
  rng = np.random.default_rng(3)
  response_mask = mask[:, PROMPT_WIDTH:].astype(np.float32)
  old = np.where(response_mask > 0, rng.normal(-4.0, 0.3, response_mask.shape), 0)
  advantages = rng.normal(size=(len(mask), 1)) * response_mask
  return Batch({"input_ids": jnp.asarray(tokens), "attention_mask": jnp.asarray(mask),
                "responses": jnp.asarray(tokens[:, PROMPT_WIDTH:]),
                "response_mask": jnp.asarray(response_mask),
                "old_log_probs": jnp.asarray(old, jnp.float32),
                "advantages": jnp.asarray(advantages, jnp.float32)})


@pytest.fixture(scope="module")
def padded_step():
  from hflax.controller.training import UpdateConfig
  batch = grpo_batch()
  actor = grpo_actor(UpdateConfig(mini_batch_size=16, micro_batch_size=8))
  logp = np.asarray(actor.compute_log_prob(batch)["old_log_probs"])
  metrics = {k: float(v) for k, v in actor.update_actor(batch).meta["metrics"].items()}
  return batch, logp, actor.params, metrics


@pytest.mark.parametrize("share", [True, False])
def test_grpo_update_with_shared_prompts_is_the_padded_step(padded_step, share):
  from hflax.controller.training import UpdateConfig
  batch, want_logp, want_params, want = padded_step
  actor = grpo_actor(UpdateConfig(mini_batch_size=16, micro_batch_size=8, remove_padding=True,
                                  share_prompts=share))
  np.testing.assert_allclose(np.asarray(actor.compute_log_prob(batch)["old_log_probs"]),
                             want_logp, atol=2e-5, rtol=1e-5)
  got = actor.update_actor(batch).meta["metrics"]
  assert_same_update(actor.params, got, want_params, want)
  # 2 micro-batches x 2 devices: one 40-token group per row (bucket 48) when shared; the
  # 214 tokens of the rows balanced over 4 rows otherwise.
  tokens = SHARED if share else REAL
  assert float(got["actor/update_tokens"]) == tokens
  assert float(got["actor/update_shared_prompt_tokens"]) == (REAL - SHARED if share else 0)
  if share:
    assert float(got["actor/update_padded_tokens"]) == 4 * fine_bucket(40) - SHARED


def test_share_prompts_setting_reaches_the_update_config_and_is_validated():
  from hflax.launch.cli import load_config
  from hflax.launch.config import validate
  from hflax.launch.roles import _update
  from hflax.launch.roles import make_plan
  from hflax.models.tokenizer import ByteTokenizer
  for args, want in (([], True), (["model.share_prompts=False"], False)):
    c = load_config(["--config", "grpo.py", *args])
    assert _update(c.actor, c.rollout.n, c.model).share_prompts is want
    # A separate reference worker follows the same switch.
    assert make_plan(c, {}, ByteTokenizer()).ref_share_prompts is want
  from hflax.launch.cli import UsageError
  with pytest.raises(UsageError, match="model.share_prompts"):
    load_config(["--config", "grpo.py", "model.share_prompts=yes"])
  c = load_config(["--config", "grpo.py"])
  with c.unlocked():  # as a config file that builds its model section anew
    c.model = dict(c.model.to_dict(), share_prompts="yes")
  with pytest.raises(ValueError, match=r"^config.model.share_prompts: must be True or False, "
                                       r"got 'yes'$"):
    validate(c)
