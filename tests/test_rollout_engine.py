"""The rollout engine, driven as the host drives it: admission while others decode, abort,
weight versions, and the batch sampler's tokens and log-probs for the same keys."""
import jax
import numpy as np
import pytest

from hflax.models import ModelConfig, create
from hflax.rollout import SamplingParams, generate
from hflax.rollout.engine import Request, RolloutEngine

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, qk_norm=True)
N = 20


@pytest.fixture(scope="module")
def model():
  return create(CFG, seed=3)


@pytest.fixture(scope="module")
def prompts():
  rs = np.random.RandomState(0)  # mixed lengths, from 1 to 13 tokens
  return [rs.randint(3, 96, size=n).tolist() for n in (5, 13, 1, 8, 3, 11, 7)]


GREEDY = SamplingParams(max_new_tokens=N, temperature=0, eos_ids=(5,))
SAMPLED = SamplingParams(max_new_tokens=N, temperature=0.8, top_k=12, top_p=0.9, eos_ids=(5, 7))


def reference(model, prompts, params, key):
  """Row i of the batch sampler, as (tokens, log-probs) lists."""
  out = generate(*model, prompts, params, rng=key)
  lengths = np.asarray(out["response_length"])
  return [(np.asarray(out["responses"][i, :n]).tolist(),
           np.asarray(out["rollout_log_probs"][i, :n])) for i, n in enumerate(lengths)]


def assert_matches(completions, want):
  for c, (tokens, log_probs) in zip(completions, want, strict=True):
    assert c.token_ids == tokens, c.id
    np.testing.assert_allclose(c.log_probs, log_probs, atol=1e-5, err_msg=str(c.id))
    assert len(c.versions) == len(tokens)


# The token pick (greedy or filtered sampling) does not depend on the devices, nor the rows'
# split on the pick: greedy on one device, sampled on one and on four.
@pytest.mark.parametrize("devices,params", [(1, GREEDY), (1, SAMPLED), (4, SAMPLED)],
                         ids=["1-greedy", "1-sampled", "4-sampled"])
def test_requests_sample_what_the_batch_sampler_does(model, prompts, params, devices):
  key = jax.random.key(11)
  want = reference(model, prompts, params, key)
  engine = RolloutEngine(*model, params, slots=4, max_prompt_len=16, steps_per_call=4,
                         key=key, devices=jax.devices()[:devices])
  got = engine.run([Request(p, id=f"r{i}") for i, p in enumerate(prompts)])
  assert [c.id for c in got] == [f"r{i}" for i in range(len(prompts))]
  assert_matches(got, want)
  lengths = [len(c.token_ids) for c in got]
  assert min(lengths) < N and max(lengths) == N, lengths  # rows end far apart
  assert {c.finish_reason for c in got} == {"stop", "length"}
  for c in got:
    assert c.finish_reason == ("length" if len(c.token_ids) == N else "stop")
  if devices > 1:
    assert engine._carry["tok"].sharding.device_set == set(jax.devices()[:devices])
  assert engine.busy == 0


def test_requests_admitted_while_others_decode(model, prompts):
  """Half the requests first; the rest arrive after a step, into slots freed by rows that
  ended, while the first ones are still decoding. Every row samples what it would in one
  batch call (its row index is its submission order)."""
  key = jax.random.key(4)
  want = reference(model, prompts, SAMPLED, key)
  engine = RolloutEngine(*model, SAMPLED, slots=4, steps_per_call=3, max_prompt_len=16,
                         key=key)
  done = {}
  for p in prompts[:3]:
    engine.submit(Request(p))
  done.update({c.id: c for c in engine.step()})
  early = {live.request.id for live in engine._live if live is not None}
  assert early, "some of the first requests are still decoding"
  for p in prompts[3:]:
    engine.submit(Request(p))
  overlapped = False
  while engine.busy:
    finished = engine.step()
    live = {x.request.id for x in engine._live if x is not None}
    overlapped |= bool(live & early) and bool(live - early)
    done.update({c.id: c for c in finished})
  assert overlapped, "late requests never decoded beside early ones"
  assert_matches([done[i] for i in range(len(prompts))], want)


def test_abort_returns_the_partial_tokens_and_frees_the_slot(model, prompts):
  key = jax.random.key(8)
  no_end = SamplingParams(max_new_tokens=N, temperature=0.8)
  want = reference(model, prompts[:3], no_end, key)
  engine = RolloutEngine(*model, no_end, slots=2, steps_per_call=4, max_prompt_len=16, key=key)
  for p in prompts[:3]:
    engine.submit(Request(p))
  assert engine.step() == []
  partial = engine.abort(0)
  assert partial.finish_reason == "abort"
  assert partial.token_ids == want[0][0][:5]  # the prefill's token and 4 decode steps
  np.testing.assert_allclose(partial.log_probs, want[0][1][:5], atol=1e-5)
  waiting = engine.abort(2) if engine._waiting else None  # not admitted yet: no tokens
  assert waiting is not None and waiting.token_ids == [] and waiting.finish_reason == "abort"
  with pytest.raises(KeyError, match="no request 0"):
    engine.abort(0)
  engine.submit(Request(prompts[2], row=2))  # the freed slot takes it
  done = {}
  while engine.busy:
    done.update({c.id: c for c in engine.step()})
  assert_matches([done[1], done[2]], [want[1], want[2]])  # id defaults to the row


def test_new_weights_change_the_version_later_tokens_carry(model, prompts):
  graphdef, state = model
  other = create(CFG, seed=9)[1]
  greedy = SamplingParams(max_new_tokens=N, temperature=0)
  engine = RolloutEngine(graphdef, state, greedy, slots=2, steps_per_call=4,
                         max_prompt_len=16, version=7)
  engine.submit(Request(prompts[1], id="old"))
  engine.step()
  engine.update_weights(other, version=8)
  engine.submit(Request(prompts[1], id="new"))
  done = {}
  while engine.busy:
    done.update({c.id: c for c in engine.step()})
  assert done["old"].versions == [7] * 5 + [8] * (N - 5)
  assert done["new"].versions == [8] * N
  # The request submitted after the update samples what the new weights do alone.
  assert_matches([done["new"]], reference((graphdef, other), [prompts[1]], greedy,
                                          jax.random.key(0)))
  # The old request's first 5 tokens are the old weights', its tail the new ones'.
  old = reference(model, [prompts[1]], greedy, jax.random.key(0))[0][0]
  assert done["old"].token_ids[:5] == old[:5] and done["old"].token_ids != old
  engine.update_weights(state)
  assert engine.version == 9


def test_per_request_stops_and_limits(model, prompts):
  free = reference(model, prompts[:1], SamplingParams(max_new_tokens=N, temperature=0),
                   jax.random.key(0))[0][0]
  stop = free[6]
  engine = RolloutEngine(*model, SamplingParams(max_new_tokens=N, temperature=0), slots=2,
                         max_prompt_len=16)
  by_stop, by_limit = engine.run([Request(prompts[0], stop_ids=(stop,)),
                                  Request(prompts[0], max_new_tokens=3)])
  assert by_stop.token_ids == free[:free.index(stop) + 1] and by_stop.finish_reason == "stop"
  assert by_limit.token_ids == free[:3] and by_limit.finish_reason == "length"


def test_batch_path_is_the_batch_sampler_with_a_version(model, prompts):
  params = SamplingParams(max_new_tokens=N, temperature=1.0, n=2)
  key = jax.random.key(3)
  want = generate(*model, prompts, params, rng=key, devices=jax.devices()[:2])
  engine = RolloutEngine(*model, params, devices=jax.devices()[:2], slots=2, version=4)
  got = engine.generate(prompts, rng=key)
  for field in want:
    np.testing.assert_array_equal(np.asarray(got[field]), np.asarray(want[field]), field)
  np.testing.assert_array_equal(np.asarray(got["rollout_version"]), 4)
  with pytest.raises(ValueError, match="sampling.n must be 1"):
    engine.submit(Request([1, 2]))
  engine.release_weights()
  with pytest.raises(RuntimeError, match="no weights"):
    engine.generate(prompts, rng=key)


@pytest.mark.parametrize("request_, message", [
    (Request([]), "empty prompt"),
    (Request(list(range(3, 20))), "17 prompt tokens, the engine holds at most"),
    (Request([4], max_new_tokens=0), r"max_new_tokens must be in \[1, 20\]"),
    (Request([4], stop_ids=tuple(range(10, 20))), "at most 8 stop and eos ids"),
])
def test_bad_requests_are_refused_in_one_line(model, request_, message):
  engine = RolloutEngine(*model, GREEDY, slots=2, max_prompt_len=16)
  with pytest.raises(ValueError, match=message) as error:
    engine.submit(request_)
  assert "\n" not in str(error.value)
  engine.submit(Request([4], id="x"))
  with pytest.raises(ValueError, match="already in the engine"):
    engine.submit(Request([5], id="x"))
  assert engine.busy == 1


def test_bad_engine_settings(model):
  with pytest.raises(ValueError, match="slots must be an integer >= 1"):
    RolloutEngine(*model, GREEDY, slots=0)
  with pytest.raises(ValueError, match="3 slots do not split over the mesh's 2 data devices"):
    RolloutEngine(*model, GREEDY, slots=3, devices=jax.devices()[:2])


@pytest.mark.parametrize("params", [SamplingParams(max_new_tokens=12, temperature=0),
                                    SamplingParams(max_new_tokens=12, temperature=0.9)],
                         ids=["greedy", "sampled"])
def test_a_continuation_samples_what_the_whole_context_would(model, prompts, params):
  """Turn 2 continues turn 1's kept cache with only the new tokens: it samples what a fresh
  request for the whole context (prompt, turn 1, new tokens) samples, while another
  trajectory decodes beside it."""
  key = jax.random.key(21)
  engine = RolloutEngine(*model, params, slots=2, steps_per_call=3, max_prompt_len=40,
                         max_turn_len=6, max_context_len=64, key=key)
  turn1, other = engine.run([Request(prompts[1], id="t1", keep=True, max_new_tokens=5),
                             Request(prompts[3], id="o", keep=True)])
  assert engine.kept == ("t1", "o") and engine.busy == 0
  observation = [9, 8, 7]
  engine.submit(Request(prompts[0], id="side"))
  (turn2,) = engine.run([Request(observation, id="t2", continues="t1", row=50)])
  assert turn2.prompt_ids == observation and engine.kept == ("o",)
  fresh = RolloutEngine(*model, params, slots=1, max_prompt_len=40, key=key)
  (want,) = fresh.run([Request(prompts[1] + turn1.token_ids + observation, row=50)])
  assert turn2.token_ids == want.token_ids and len(want.token_ids) > 6
  np.testing.assert_allclose(turn2.log_probs, want.log_probs, atol=1e-5)
  engine.release("o")
  assert engine.kept == ()
  while engine.busy:
    engine.step()


def test_continuation_limits(model, prompts):
  params = SamplingParams(max_new_tokens=8, temperature=0)
  engine = RolloutEngine(*model, params, slots=1, max_prompt_len=16, max_turn_len=4,
                         max_context_len=30)
  with pytest.raises(ValueError, match="continues 'nope', which is not a finished request"):
    engine.submit(Request([3], continues="nope"))
  engine.run([Request(prompts[1], id="a", keep=True)])  # columns 0..22 hold its context
  with pytest.raises(ValueError, match="brings at most max_turn_len=4"):
    engine.submit(Request([3] * 5, continues="a"))
  # 2 new tokens after a's last: columns 23..25; a reply fills the 4 columns left.
  (b,) = engine.run([Request([3, 4], id="b", continues="a", keep=True)])
  assert len(b.token_ids) == 4 and b.finish_reason == "length"
  with pytest.raises(ValueError, match="context of 'b' is full"):
    engine.submit(Request([3, 4, 5], continues="b"))
  with pytest.raises(ValueError, match="max_turn_len=0"):
    RolloutEngine(*model, params, slots=1).submit(Request([3], continues="a"))
