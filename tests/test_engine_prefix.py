"""The rollout engine prefills a prompt that several requests of one admission share once
(RolloutEngine(prefix_sharing=True), the default): the others copy its cache rows and pick
their first tokens with their own keys, and every request's tokens and log-probs are the
ones it gets with sharing off, bit for bit."""
import dataclasses

import jax
import numpy as np
import pytest

from hflax.models import ModelConfig, create
from hflax.rollout import Request, RolloutEngine, SamplingParams

CFG = ModelConfig(vocab_size=264, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2)
GREEDY = SamplingParams(max_new_tokens=8, temperature=0.0, eos_ids=(7,), pad_id=0)
SAMPLED = SamplingParams(max_new_tokens=8, temperature=0.9, top_k=40, top_p=0.95, eos_ids=(7,),
                         pad_id=0)


@pytest.fixture(scope="module")
def model():
  return create(CFG, seed=5)


def prompts() -> list[list[int]]:
  """Three groups (of 4, 3 and 2 samples, interleaved) and a prompt of its own."""
  rng = np.random.RandomState(0)
  base = [rng.randint(8, 260, size=n).tolist() for n in (5, 19, 30, 11)]
  return [base[g] for g in (0, 1, 2, 0, 1, 0, 2, 1, 0, 3)]


def bits(x) -> np.ndarray:
  return np.asarray(x, np.float32).view(np.int32)


def engine(model, params, sharing: bool, **kw) -> RolloutEngine:
  return RolloutEngine(*model, params, slots=kw.pop("slots", 12), max_prompt_len=32,
                       steps_per_call=4, key=jax.random.key(1), prefix_sharing=sharing, **kw)


def outputs(completions) -> dict:
  return {c.id: (c.token_ids, bits(c.log_probs), c.finish_reason) for c in completions}


def assert_same(got: dict, want: dict):
  assert got.keys() == want.keys()
  for k, (tokens, log_probs, reason) in want.items():
    assert got[k][0] == tokens and got[k][2] == reason, k
    np.testing.assert_array_equal(got[k][1], log_probs, err_msg=str(k))


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("devices", [1, 2])
def test_shared_prefills_sample_what_separate_ones_do(model, params, devices):
  """Ten requests, four distinct prompts, admitted together; two rows a compiled call, so
  the group of four copies in two calls. On a 2-device mesh the slots split over the
  devices and copies cross them."""
  kw = {"rows_per_prefill": 2, "devices": jax.devices()[:devices]}
  requests = lambda: [Request(p, id=i) for i, p in enumerate(prompts())]  # noqa: E731
  on, off = engine(model, params, True, **kw), engine(model, params, False, **kw)
  got, want = outputs(on.run(requests())), outputs(off.run(requests()))
  assert_same(got, want)
  # Greedy, a group's samples are one sequence; sampled, each row draws its own.
  assert len({tuple(t) for t, _, _ in want.values()}) == (4 if params.greedy else 10)
  assert on.stats["prefill_rows"] == 4 and on.stats["shared_rows"] == 6
  assert on.stats["prefill_calls"] == 4 and off.stats["prefill_calls"] == 6
  assert off.stats["prefill_rows"] == 10 and off.stats["shared_rows"] == 0
  assert on.stats["prefill_tokens"] + on.stats["shared_tokens"] == \
      off.stats["prefill_tokens"] == sum(map(len, prompts()))


def test_a_group_is_prefilled_once_and_its_slots_hold_the_same_cache(model):
  """A group of 8 samples of one prompt: one prefill call of one real row, seven copies;
  after the admission every slot's cache, counters and first token are those of the
  engine that prefilled each on its own."""
  prompt = list(range(20, 43))
  carries, firsts = {}, {}
  for sharing in (True, False):
    e = engine(model, SAMPLED, sharing, slots=8)
    for i in range(8):
      e.submit(Request(prompt, id=i))
    e._admit()
    carries[sharing] = jax.tree.map(np.asarray, e._carry)
    firsts[sharing] = [(live.tokens, bits(live.log_probs)) for live in e._live]
    if sharing:
      assert e.stats == {"prefill_calls": 1, "prefill_rows": 1, "prefill_tokens": 23,
                         "shared_rows": 7, "shared_tokens": 7 * 23}
    else:
      assert e.stats["prefill_calls"] == 1 and e.stats["prefill_rows"] == 8
  for path, a in jax.tree_util.tree_leaves_with_path(carries[True]):
    b = dict(jax.tree_util.tree_leaves_with_path(carries[False]))[path]
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8), err_msg=str(path))
  assert len({t[0] for t, _ in firsts[True]}) > 1  # each picked with its own row
  for (ta, la), (tb, lb) in zip(firsts[True], firsts[False]):
    assert ta == tb
    np.testing.assert_array_equal(la, lb)


def test_abort_keep_and_later_admissions_are_unchanged(model):
  """A group of four kept samples: one aborted while decoding, one waiting one aborted
  before admission; the rest continue their kept contexts. A request with the group's
  prompt submitted at a later step is prefilled again (sharing is within one admission),
  and the continuations are never shared. Every result is the unshared engine's."""
  prompt = list(range(30, 47))
  results, stats = {}, {}
  for sharing in (True, False):
    e = engine(model, dataclasses.replace(SAMPLED, max_new_tokens=12), sharing, slots=8,
               max_turn_len=8, max_context_len=64)
    for i in range(4):
      e.submit(Request(prompt, id=("a", i), keep=True))
    e.submit(Request(prompt, id="dropped"))
    out = [e.abort("dropped")]
    out += e.step()
    out.append(e.abort(("a", 1)))
    while e.busy:
      out += e.step()
    out += e.run([Request(prompt, id="late")])
    out += e.run([Request([9, 10, 11], id=("b", i), continues=("a", i)) for i in (0, 2, 3)])
    results[sharing], stats[sharing] = outputs(out), dict(e.stats)
  assert_same(results[True], results[False])
  assert results[True]["dropped"][0] == [] and results[True]["dropped"][2] == "abort"
  assert results[True][("a", 1)][2] == "abort" and 0 < len(results[True][("a", 1)][0]) < 12
  assert stats[True] == {"prefill_calls": 2, "prefill_rows": 2, "prefill_tokens": 34,
                         "shared_rows": 3, "shared_tokens": 51}
  assert stats[False]["prefill_rows"] == 5 and stats[False]["shared_rows"] == 0


def test_bad_switch_is_refused(model):
  with pytest.raises(ValueError, match="prefix_sharing must be True or False"):
    RolloutEngine(*model, GREEDY, prefix_sharing="yes")
