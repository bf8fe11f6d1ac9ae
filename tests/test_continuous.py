"""Continuous batching (slots) samples exactly what the wave sampler does."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hflax.models import ModelConfig, create, init_cache, transformer
from hflax.rollout import SamplingParams, continuous, generate, generation_slots
from hflax.rollout.sampler import _rows_mesh, compiled_variants, generate_over_rows, left_pad

CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, qk_norm=True)
N = 48  # 2 cache-growth segments


@pytest.fixture(scope="module")
def model():
  return create(CFG, seed=3)


@pytest.fixture(scope="module")
def prompts():
  rs = np.random.RandomState(0)  # left-padded to 16, from 1 to 13 tokens
  return [rs.randint(3, 96, size=n).tolist() for n in (5, 13, 1, 8, 3, 11, 7)]


@pytest.fixture(scope="module")
def eos_ids(model, prompts):
  """End tokens that stop rows greedily at very different steps, some never."""
  free = np.asarray(generate(*model, prompts, SamplingParams(max_new_tokens=N, temperature=0))
                    ["responses"])
  ends = (int(free[0, 2]), int(free[3, 9]))
  params = SamplingParams(max_new_tokens=N, temperature=0, eos_ids=ends)
  lengths = np.asarray(generate(*model, prompts, params)["response_length"])
  assert lengths.min() <= 10 and lengths.max() == N, lengths  # the skew the tests rely on
  return ends


def assert_same(got, want):
  assert set(got) == set(want)
  for key in want:
    assert got[key].shape == want[key].shape, key
    if key == "rollout_log_probs":
      np.testing.assert_allclose(np.asarray(got[key]), np.asarray(want[key]), atol=1e-6)
    else:
      np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(want[key]), err_msg=key)


def sampling_cases(eos_ids):
  return [SamplingParams(max_new_tokens=N, temperature=0, eos_ids=eos_ids),
          SamplingParams(max_new_tokens=N, temperature=1.0, n=2, eos_ids=eos_ids),
          SamplingParams(max_new_tokens=N, temperature=0.7, top_k=10, top_p=0.8, n=3,
                         eos_ids=eos_ids)]


@pytest.mark.parametrize("case, slots", [(0, 1), (0, 3), (1, 3), (1, 13), (2, 4)])
def test_slots_sample_what_waves_do(model, prompts, eos_ids, case, slots):
  params = sampling_cases(eos_ids)[case]
  key = jax.random.key(11)
  want = generate(*model, prompts, params, rng=key)
  got = generate(*model, prompts, params, rng=key, slots=slots)
  assert_same(got, want)
  lengths = np.asarray(want["response_length"])
  assert lengths.max() == N and lengths.min() < N // 2  # rows end far apart


def test_tail_slot_sizes():
  assert continuous.tail_slots(16) == (16, 8, 4)  # on CPU, halving down to TAIL_MIN_SLOTS
  assert continuous.tail_slots(9) == (9, 4)
  assert continuous.tail_slots(7) == (7,)


def test_tail_slot_sizes_off_cpu(monkeypatch):
  monkeypatch.setattr(continuous.jax, "default_backend", lambda: "gpu")
  assert continuous.tail_slots(16) == (16,)


@pytest.mark.parametrize("case, slots", [(1, 9), (2, 8)])
def test_the_tail_decodes_in_fewer_slots_and_samples_what_waves_do(
    model, prompts, eos_ids, case, slots, monkeypatch):
  """The last rows move into fewer slots (here with rows still going) and sample exactly
  what the wave sampler does. slots 8 and 9: sizes no other test here compiles, so the
  program is traced with the recording below."""
  gathered = []
  real = continuous.gather_slots

  def recording(carry, size):  # what each move into fewer slots finds at run time
    jax.debug.callback(lambda busy: gathered.append((size, int(busy))), carry["active"].sum())
    return real(carry, size)

  monkeypatch.setattr(continuous, "gather_slots", recording)
  params = sampling_cases(eos_ids)[case]
  key = jax.random.key(12)
  want = generate(*model, prompts, params, rng=key)
  assert_same(generate(*model, prompts, params, rng=key, slots=slots), want)
  assert [size for size, _ in gathered] == list(continuous.tail_slots(slots)[1:])
  assert gathered[0][1] > 0 and all(busy <= size for size, busy in gathered), gathered


def test_rows_ending_at_their_first_token_or_step(model, prompts):
  """Rows that never need a slot (ended by their first token) and max_new_tokens=1."""
  first = np.asarray(generate(*model, prompts, SamplingParams(max_new_tokens=1, temperature=0))
                     ["responses"])[:, 0]
  every_first = tuple(set(first.tolist()))
  for params in (SamplingParams(max_new_tokens=6, temperature=0, eos_ids=(int(first[1]),)),
                 SamplingParams(max_new_tokens=6, temperature=0, eos_ids=every_first),
                 SamplingParams(max_new_tokens=1, temperature=1.0, n=2)):
    key = jax.random.key(2)
    assert_same(generate(*model, prompts, params, rng=key, slots=2),
                generate(*model, prompts, params, rng=key))


def test_slots_on_data_devices(model, prompts, eos_ids):
  # 3 devices: 7 prompts do not divide, so the rows split with padding rows (any split of
  # 7 over 2 or more devices pads; one such split proves it).
  devices = 3
  params = sampling_cases(eos_ids)[2]
  key = jax.random.key(5)
  want = generate(*model, prompts, params, rng=key)
  got = generate(*model, prompts, params, rng=key, devices=jax.devices()[:devices], slots=2)
  assert got["responses"].sharding.device_set == set(jax.devices()[:devices])
  assert_same(got, want)


def test_slots_within_waves(model, prompts, eos_ids):
  """The actor's waves (max_num_seqs) and slots together: each wave decoded in slots."""
  params = sampling_cases(eos_ids)[1]
  key = jax.random.key(9)
  want = generate(*model, prompts, params, rng=key)
  tokens, mask = left_pad(prompts, 0)
  got = generate_over_rows(*model, tokens, mask, key, params, _rows_mesh(jax.devices()[:2]),
                           wave_rows=4, slots=3)
  assert_same(got, want)


def test_repeated_calls_compile_once(model, eos_ids):
  params = SamplingParams(max_new_tokens=N, temperature=0.9, eos_ids=eos_ids)
  rs = np.random.RandomState(4)
  batch = lambda: [rs.randint(3, 96, size=rs.randint(9, 17)).tolist()  # noqa: E731
                   for _ in range(5)]
  generate(*model, batch(), params, rng=jax.random.key(0), slots=2)
  before = compiled_variants()
  for seed in range(3):  # other prompts of the same bucket, other keys
    generate(*model, batch(), params, rng=jax.random.key(seed), slots=2)
  assert compiled_variants() == before
  generate(*model, batch(), params, rng=jax.random.key(0))
  generate(*model, batch(), params, rng=jax.random.key(0), slots=5)
  generate(*model, batch(), params, rng=jax.random.key(0), slots=7)
  assert compiled_variants() == before + 1  # slots for every row: the wave program


def test_bad_slots_name_the_field(model, prompts):
  for bad in (-1, 2.5, True):
    with pytest.raises(ValueError, match="^slots must be an integer >= 0"):
      generate(*model, prompts, SamplingParams(temperature=0), slots=bad)


def test_generation_slots_by_hand():
  assert generation_slots(10, 2, 2) == 10      # no cap: all 5 prompts x 2 samples of a replica
  assert generation_slots(10, 2, 2, 4) == 4    # the cap, in sequences
  assert generation_slots(10, 2, 4, 3) == 3    # below n: a slot holds one sample
  assert generation_slots(7, 4, 1, 100) == 2   # 7 prompts over 4 replicas: 2 rows each
  with pytest.raises(ValueError, match="max_num_seqs must be >= 0"):
    generation_slots(4, 1, 1, -1)


def test_actor_with_continuous_batching_samples_what_its_waves_do(model, prompts, eos_ids):
  # rollout.continuous_batching through the actor: max_num_seqs=3 slots per replica on 2
  # devices against the wave actor with the same cap (which then fits 1 prompt of n=2).
  from hflax.controller.batch import Batch
  from hflax.controller.actor import ActorRolloutWorker
  from hflax.sharding.placement import build_placement, colocated
  placed = build_placement(colocated(["actor"], 2))
  params = sampling_cases(eos_ids)[1]
  tokens, mask = left_pad(prompts + prompts[:1], 0)
  batch = Batch({"prompts": jax.numpy.asarray(tokens), "prompt_mask": jax.numpy.asarray(mask)})
  out = {}
  for slotted in (False, True):
    actor = ActorRolloutWorker(placed["actor"], *model, sampling=params, max_num_seqs=3,
                               continuous_batching=slotted)
    result = actor.generate_sequences(batch)
    out[slotted] = ({k: result[k] for k in result.keys()},
                    float(result.meta["metrics"]["rollout/waves"]))
  assert out[False][1] == 4 and out[True][1] == 1  # 8 prompts, 2 replicas: 4 waves of 2
  assert_same(out[True][0], out[False][0])


def test_bfloat16_slots_sample_what_waves_do(prompts):
  """bf16 caches are written through their bits on CPU (a select, not a widened
  dynamic-update-slice), in the decode step and when a slot takes a new prompt."""
  graphdef, state = create(CFG.replace(dtype="bfloat16"), seed=3)
  params = SamplingParams(max_new_tokens=N, temperature=1.0, n=2)
  key = jax.random.key(5)
  want = generate(graphdef, state, prompts, params, rng=key)
  got = generate(graphdef, state, prompts, params, rng=key, slots=3)
  np.testing.assert_array_equal(np.asarray(got["responses"]), np.asarray(want["responses"]))
  np.testing.assert_allclose(np.asarray(got["rollout_log_probs"]),
                             np.asarray(want["rollout_log_probs"]), atol=1e-6)


def test_bfloat16_keys_held_as_bits_sample_what_bfloat16_keys_do(prompts, monkeypatch):
  """On CPU a bf16 cache holds its keys as their uint16 bits, written in place; decoding
  reads them back as the same bf16 numbers, so rows sample the tokens that keys held as
  bf16 (written through a select) give, in waves and in slots."""
  cfg = CFG.replace(dtype="bfloat16")
  on_cpu = jax.default_backend() == "cpu"
  assert init_cache(cfg, 2, 4)[0]["k"].dtype == (jnp.uint16 if on_cpu else jnp.bfloat16)
  assert init_cache(cfg, 2, 4)[0]["v"].dtype == jnp.bfloat16
  graphdef, state = create(cfg, seed=3)
  params = SamplingParams(max_new_tokens=N, temperature=1.0, n=2)
  key = jax.random.key(5)
  got = [generate(graphdef, state, prompts, params, rng=key, slots=s) for s in (0, 3)]
  monkeypatch.setattr(transformer, "key_cache_dtype", jnp.dtype)
  jax.clear_caches()  # the sampler's programs were traced with the bits
  assert init_cache(cfg, 2, 4)[0]["k"].dtype == jnp.bfloat16
  want = [generate(graphdef, state, prompts, params, rng=key, slots=s) for s in (0, 3)]
  jax.clear_caches()
  for g, w in zip(got, want):
    np.testing.assert_array_equal(np.asarray(g["responses"]), np.asarray(w["responses"]))
    np.testing.assert_allclose(np.asarray(g["rollout_log_probs"]),
                               np.asarray(w["rollout_log_probs"]), atol=1e-6)
