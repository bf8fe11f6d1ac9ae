"""The KV-cache sampler against transformers' generate and against its own definitions."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from hf_models import loaded_pair
from hflax.models.logprobs import sequence_log_probs
from hflax.rollout import SamplingParams, filter_logits, generate, left_pad, replicate
from hflax.rollout.decoding import (argmax_rows, first_max, greedy_pick, gumbel_max,
                                    nucleus_by_bisection,
                                    nucleus_by_sort, pick_with_keys)
from hflax.rollout.sampler import compiled_variants, decode_segments, length_bucket

log_probs_jit = jax.jit(sequence_log_probs, static_argnums=0, static_argnames="temperature")
PROMPT_LENGTHS = (5, 11, 2, 8)


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def pair(request, tmp_path_factory):
  return loaded_pair(request.param, tmp_path_factory.mktemp(request.param), seed=1)


# The tests that compare the sampler with transformers or with teacher forcing run every
# family: each family's switches (Llama 3 rope scaling, Qwen2's qkv bias and tied head,
# Qwen3's q/k norms) live in the per-row model forward they check. The tests marked
# one_family check the sampler's own handling of rows (end tokens, n samples, padding
# rows, the compile cache, the token pick): code in hflax.rollout that is the same for
# every family, so one family's compiles prove it. Qwen2: its tied head decodes through
# step_logits as a decoding copy's untied head does.
one_family = pytest.mark.parametrize("pair", ["qwen2"], indirect=True)


def _prompts(seed=0):
  rs = np.random.RandomState(seed)
  return [rs.randint(3, 128, size=n).tolist() for n in PROMPT_LENGTHS]


def test_greedy_equals_transformers_generate(pair):
  """100 new tokens: the decode loop runs in 3 segments, so the cache grows twice between
  loops; the first segment is the whole loop of a shorter call (one segment)."""
  model, graphdef, state = pair
  new_tokens = 100
  assert decode_segments(new_tokens) == 3
  prompts = _prompts()
  out = generate(graphdef, state, prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0))
  for row, prompt in enumerate(prompts):  # unpadded, one at a time: the plainest reference
    with torch.no_grad():
      ref = model.generate(torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(out["responses"][row]), ref[0, len(prompt):].numpy())
  assert np.asarray(out["response_mask"]).all()


@pytest.mark.parametrize("params", [
    SamplingParams(max_new_tokens=20, temperature=0),  # greedy: log-probs at temperature 1
    SamplingParams(max_new_tokens=20, temperature=0.7, top_k=10, top_p=0.8, n=3,
                   eos_ids=(7, 8, 9, 10)),  # filtered draws, unfiltered log-probs
    # Plain sampling at temperature 1 (n=2), over 2 loop segments, rows ending at end tokens.
    SamplingParams(max_new_tokens=70, temperature=1.0, n=2, eos_ids=(7, 8, 9, 10, 11, 12)),
])
def test_rollout_log_probs_equal_teacher_forced(pair, params):
  _, graphdef, state = pair
  out = generate(graphdef, state, _prompts(1), params, rng=jax.random.key(3))
  width = out["prompts"].shape[1]
  temperature = params.temperature or 1.0
  teacher, _ = log_probs_jit(graphdef, state, out["input_ids"], out["attention_mask"],
                             temperature=temperature)
  teacher = np.asarray(teacher[:, width:])
  mask = np.asarray(out["response_mask"])
  np.testing.assert_allclose(np.asarray(out["rollout_log_probs"]), teacher * mask, atol=1e-5)


@one_family
@pytest.mark.parametrize("new_tokens", [16, 64])  # one loop segment, two
def test_eos_stops_rows_and_masks(pair, new_tokens):
  _, graphdef, state = pair
  prompts = _prompts(2)
  free = generate(graphdef, state, prompts, SamplingParams(max_new_tokens=new_tokens, temperature=0))
  free_tokens = np.asarray(free["responses"])
  eos = int(free_tokens[0, 3])
  out = generate(graphdef, state, prompts,
                 SamplingParams(max_new_tokens=new_tokens, temperature=0, eos_ids=(eos,), pad_id=0))
  tokens, mask = np.asarray(out["responses"]), np.asarray(out["response_mask"])
  for row in range(len(prompts)):
    hits = np.flatnonzero(free_tokens[row] == eos)
    length = hits[0] + 1 if hits.size else new_tokens  # the end token is part of the response
    assert out["response_length"][row] == length
    np.testing.assert_array_equal(tokens[row, :length], free_tokens[row, :length])
    assert (tokens[row, length:] == 0).all()
    np.testing.assert_array_equal(mask[row], np.arange(new_tokens) < length)
  width = out["prompts"].shape[1]
  attention = np.asarray(out["attention_mask"])
  np.testing.assert_array_equal(attention[:, width:], mask)
  np.testing.assert_array_equal(attention[:, :width], np.asarray(out["prompt_mask"]))
  positions = np.asarray(out["position_ids"])
  for row, prompt in enumerate(prompts):  # positions continue through the response
    np.testing.assert_array_equal(positions[row, width - len(prompt):width + int(out["response_length"][row])],
                                  np.arange(len(prompt) + int(out["response_length"][row])))


@one_family
def test_n_samples_are_interleaved_and_differ(pair):
  _, graphdef, state = pair
  prompts = _prompts(3)
  out = generate(graphdef, state, prompts, SamplingParams(max_new_tokens=12, n=4),
                 rng=jax.random.key(0))
  assert out["responses"].shape == (4 * len(prompts), 12)
  tokens, masked_prompts = left_pad(prompts, 0)
  np.testing.assert_array_equal(np.asarray(out["prompts"]), np.repeat(tokens, 4, axis=0))
  rows = {tuple(r) for r in np.asarray(out["responses"])[:4]}
  assert len(rows) > 1  # samples of one prompt are not copies


@one_family
def test_samples_follow_the_filtered_distribution(pair):
  """First-token frequencies over many samples match softmax(logits / T) restricted to top-k."""
  _, graphdef, state = pair
  prompt = _prompts(4)[:1]
  params = SamplingParams(max_new_tokens=1, temperature=1.5, top_k=6, n=6000)
  out = generate(graphdef, state, prompt, params, rng=jax.random.key(7))
  tokens, mask = left_pad(prompt, 0)
  from hflax.models import logits_fn
  logits = np.asarray(logits_fn(graphdef, state, jnp.asarray(tokens), jnp.asarray(mask))[0, -1])
  scaled = logits / 1.5
  top = np.argsort(-scaled)[:6]
  probs = np.exp(scaled[top] - scaled[top].max())
  probs /= probs.sum()
  sampled = np.asarray(out["responses"])[:, 0]
  assert set(np.unique(sampled)) <= set(top.tolist())
  freq = np.array([(sampled == t).mean() for t in top])
  np.testing.assert_allclose(freq, probs, atol=0.025)


def _reference_filter(logits, top_k, top_p):
  """Per row, by the definitions: top-k keeps values >= the k-th largest; top-p keeps the
  shortest most-likely prefix whose probability reaches top_p (plus ties)."""
  out = logits.copy()
  for row in out:
    if top_k:
      kth = np.sort(row)[::-1][top_k - 1]
      row[row < kth] = -np.inf
    if top_p < 1:
      order = np.argsort(-row, kind="stable")
      p = np.exp(row[order] - row[order][0])
      p /= p.sum()
      keep, mass = 0, 0.0
      while mass < top_p:
        mass += p[keep]
        keep += 1
      threshold = row[order][keep - 1]
      row[row < threshold] = -np.inf
  return out


@pytest.mark.parametrize("top_k,top_p", [(1, 1.0), (5, 1.0), (0, 0.5), (0, 0.9), (8, 0.7),
                                         (0, 1e-6), (40, 0.999)])
def test_filter_logits_matches_definition(top_k, top_p):
  rs = np.random.RandomState(top_k + int(top_p * 100))
  logits = rs.normal(size=(6, 40)).astype(np.float32) * 3
  logits[0, :4] = logits[0, 4]  # ties
  got = np.asarray(filter_logits(jnp.asarray(logits), top_k, top_p))
  np.testing.assert_array_equal(got, _reference_filter(logits, top_k, top_p))


@pytest.mark.parametrize("rows,vocab", [(13, 49152), (8, 40), (1, 261)])
def test_gumbel_max_draws_what_categorical_draws(rows, vocab):
  """The sampler's token pick is jax.random.categorical's draw, token for token, with
  filtered (-inf) entries, a row of equal logits and a NaN row (argmax: the first NaN)."""
  rs = np.random.RandomState(rows)
  logits = rs.normal(size=(rows, vocab)).astype(np.float32) * 4
  logits[0, 1:] = -np.inf
  if rows > 2:
    logits[1] = 0.5
    logits[2, 3] = logits[2, 7] = np.nan
  logits = jnp.asarray(logits)
  for seed in range(3):
    keys = jax.random.split(jax.random.key(seed), rows)
    want = jax.jit(jax.vmap(jax.random.categorical))(keys, logits)
    np.testing.assert_array_equal(jax.jit(gumbel_max)(keys, logits), want)
  assert int(want[0]) == 0 and (rows <= 2 or int(want[2]) == 3)
  np.testing.assert_array_equal(jax.jit(jax.vmap(first_max))(logits), jnp.argmax(logits, -1))
  np.testing.assert_array_equal(jax.jit(argmax_rows)(logits), jnp.argmax(logits, -1))
  _check_pick(logits)


def test_argmax_rows_past_float32_exact_indices():
  """Indices above 2^24 are not all float32 numbers: a vocabulary that long is counted in
  int32 (16777217 would round to 16777216 in float32)."""
  logits = jnp.zeros((1, 2**24 + 3), jnp.float32).at[0, 2**24 + 1].set(1.0)
  assert int(jax.jit(argmax_rows)(logits)[0]) == 2**24 + 1
  small = jnp.zeros((2, 5), jnp.float32).at[0, 3].set(jnp.nan).at[1, 1:].set(2.0)
  np.testing.assert_array_equal(jax.jit(argmax_rows)(small), [3, 1])


@pytest.mark.parametrize("case", ["plain", "near_ties", "nan", "inf", "all_minus_inf"])
def test_greedy_pick_is_argmax_and_log_softmax(case):
  """greedy_pick against jnp.argmax and log_softmax: logits of a peaked 49k vocabulary,
  maxima a few float32 steps apart at tiny magnitudes (where exp(logit - max) rounds to
  1.0) with ties, and the rows that take the argmax fallback (NaN, +inf, all -inf)."""
  rs = np.random.RandomState(3)
  logits = rs.standard_t(3, size=(5, 49152)).astype(np.float32) * 5
  if case == "near_ties":
    logits = logits * np.float32(1e-6)
    top = logits.max(axis=1)
    logits[:, 700] = np.nextafter(top, np.float32(np.inf))  # one step above the old max
    logits[:, 300] = top  # one step below the new one, earlier in the row
    logits[1, 900] = logits[1, 700]  # a tie after the first maximum
    logits[2, 40] = logits[2, 700]  # a tie before it
  elif case == "nan":
    logits[2, 7] = logits[2, 3] = np.nan
  elif case == "inf":
    logits[1, 11] = logits[1, 5] = np.inf
  elif case == "all_minus_inf":
    logits[4] = -np.inf
  logits = jnp.asarray(logits)
  tokens, log_probs = jax.jit(greedy_pick)(logits)
  want = jnp.argmax(logits, -1)
  np.testing.assert_array_equal(tokens, want)
  expected = jnp.take_along_axis(jax.nn.log_softmax(logits, -1), want[:, None], -1)[:, 0]
  np.testing.assert_allclose(log_probs, expected, rtol=1e-6, atol=1e-6)
  if case == "near_ties":
    np.testing.assert_array_equal(tokens, [700, 700, 40, 700, 700])


# As users compile: XLA:CPU's older emitters at level 0 (the suite's compile-speed options,
# conftest) miscompile the sampled pick of a 49k vocabulary beside -inf, flat and NaN rows
# (no entry equals the noisy max, so the pick is the vocabulary size), even with the noisy
# logits written out once; XLA's default emitters draw categorical's tokens exactly.
USERS = {"xla_cpu_use_fusion_emitters": True}


def _check_pick(logits):
  """pick_with_keys: greedy, jnp.argmax; sampled (temperature 0.7), categorical's draw;
  the log-prob, log_softmax's entry for the token, to float32 rounding."""
  keys = jax.random.split(jax.random.key(7), logits.shape[0])
  for params, want in ((SamplingParams(temperature=0.0), jnp.argmax(logits, -1)),
                       (SamplingParams(temperature=0.7),
                        jax.vmap(jax.random.categorical)(keys, logits / 0.7))):
    tokens, log_probs = jax.jit(pick_with_keys, static_argnums=2, compiler_options=USERS)(
        logits, None if params.greedy else keys, params)
    np.testing.assert_array_equal(tokens, want)
    scaled = logits if params.greedy else logits / 0.7
    expected = jnp.take_along_axis(jax.nn.log_softmax(scaled, -1), want[:, None], -1)[:, 0]
    np.testing.assert_allclose(log_probs, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("top_p", [0.3, 0.9, 0.99])
def test_nucleus_bisection_finds_the_sorted_threshold_at_vocab_size(top_p):
  """The CPU's nucleus (no sort) against the sorted cumulative sum on rows of a 49k
  vocabulary, peaked like a language model's and flat, with a tie at the threshold."""
  rs = np.random.RandomState(int(top_p * 100))
  logits = rs.standard_t(3, size=(6, 49152)).astype(np.float32) * np.float32([[6], [3], [1],
                                                                                [.1], [2], [4]])
  logits[4, :50] = logits[4].max()  # 50 tied maxima
  logits[5, 1:] = -np.inf  # one token left (after a top-k filter, say)
  logits = jnp.asarray(logits)
  np.testing.assert_array_equal(jax.jit(nucleus_by_bisection, static_argnums=1)(logits, top_p),
                                jax.jit(nucleus_by_sort, static_argnums=1)(logits, top_p))
  # After a top-k filter (the nucleus then found among the k, already sorted).
  top_k = jax.jit(filter_logits, static_argnums=(1, 2))(logits, 60, 1.0)
  both = jax.jit(filter_logits, static_argnums=(1, 2))(logits, 60, top_p)
  want = jnp.where(top_k < nucleus_by_sort(top_k, top_p), -jnp.inf, top_k)
  np.testing.assert_array_equal(both, want)
  assert bool(jnp.all(jnp.isfinite(both[4, :50])))  # the tied maxima all kept


def test_length_buckets_are_powers_of_two_and_three_quarters_of_one():
  widths = {n: length_bucket(n) for n in range(1, 200)}
  assert sorted(set(widths.values())) == [8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256]
  assert widths[8] == 8 and widths[9] == 12 and widths[45] == 48 and widths[49] == 64
  below = lambda w: w * 2 // 3 if w % 3 == 0 else w * 3 // 4  # noqa: E731 (the next bucket down)
  assert all(below(w) < n <= w or w == 8 for n, w in widths.items())  # the smallest that holds n
  assert length_bucket(3, minimum=1) == 3 and length_bucket(5, minimum=1) == 6


@one_family
def test_compiles_once_per_length_bucket(pair):
  _, graphdef, state = pair
  params = SamplingParams(max_new_tokens=5, temperature=0.9, eos_ids=(3,))
  generate(graphdef, state, [[5, 6, 7], [9] * 6], params, rng=jax.random.key(0))
  before = compiled_variants()
  for seed, lengths in enumerate([(2, 7), (8, 1), (4, 4)]):  # all in the 8-token bucket
    generate(graphdef, state, [[11] * n for n in lengths], params, rng=jax.random.key(seed))
  assert compiled_variants() == before
  generate(graphdef, state, [[11] * 12, [12] * 3], params, rng=jax.random.key(0))
  assert compiled_variants() == before + 1


@one_family
def test_invalid_requests_raise_clear_errors(pair):
  _, graphdef, state = pair
  with pytest.raises(ValueError, match="top_p must be in"):
    SamplingParams(top_p=0.0)
  with pytest.raises(ValueError, match="needs an rng key"):
    generate(graphdef, state, [[1, 2]], SamplingParams(temperature=1.0))
  with pytest.raises(ValueError, match="prompt 1 is empty"):
    generate(graphdef, state, [[1, 2], []], SamplingParams(temperature=0))
  tokens = np.array([[0, 5, 6], [7, 8, 0]], np.int32)
  right_padded = np.array([[0, 1, 1], [1, 1, 0]], bool)
  with pytest.raises(ValueError, match="mask row 1 is not left-padded"):
    generate(graphdef, state, (tokens, right_padded), SamplingParams(temperature=0))


# Split over the cores' devices, the CPU's decoding copy packs its kernels and attends
# through cpu_attention's kernel, per family (Qwen2's fused qkv bias and tied head, Qwen3's
# 32-wide heads): each family at 3 devices; the other splits (2 divides the 4 prompts, 8
# gives each device one row, half of them padding) are the sampler's row handling, on one
# family.
@pytest.mark.parametrize("pair,num_devices", [("llama", 3), ("qwen2", 2), ("qwen2", 3),
                                              ("qwen2", 8), ("qwen3", 3)], indirect=["pair"])
def test_data_parallel_generate_equals_one_device(pair, num_devices):
  """Rows split over devices (padded when they do not divide) give the one-device result."""
  _, graphdef, state = pair
  prompts = _prompts(5)
  devices = jax.devices()[:num_devices]
  for params, rng in [(SamplingParams(max_new_tokens=20, temperature=0, eos_ids=(7,)), None),
                      (SamplingParams(max_new_tokens=20, temperature=0.8, top_p=0.9, n=2),
                       jax.random.key(3))]:
    one = generate(graphdef, state, prompts, params, rng=rng)
    split = generate(graphdef, state, prompts, params, rng=rng, devices=devices)
    assert split["responses"].shape == one["responses"].shape
    assert split["responses"].sharding.device_set <= set(devices)
    for key in ("responses", "response_mask", "input_ids", "position_ids", "response_length"):
      np.testing.assert_array_equal(np.asarray(split[key]), np.asarray(one[key]), err_msg=key)
    np.testing.assert_allclose(np.asarray(split["rollout_log_probs"]),
                               np.asarray(one["rollout_log_probs"]), atol=1e-6)


@one_family
def test_data_parallel_decode_loops_run_without_collectives(pair):
  """Each device runs its own decode loop on its rows: the compiled program holds no
  collective, so no device waits on another at every step (the loop test included)."""
  _, graphdef, state = pair
  from hflax.rollout.sampler import _generate, _rows_mesh
  devices = jax.devices()[:2]
  mesh = _rows_mesh(devices)
  rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
  tokens, mask = jax.device_put(left_pad(_prompts(4), 0), rows)
  params = SamplingParams(max_new_tokens=40, temperature=0, eos_ids=(7,))
  text = _generate.lower(graphdef, replicate(state, devices), tokens, mask, jax.random.key(0),
                         params=params, segments=2, mesh=mesh).compile().as_text()
  assert "while" in text
  with pytest.raises(ValueError, match="3 prompt rows do not split over the mesh's 2 data"):
    _generate(graphdef, state, tokens[:3], mask[:3], jax.random.key(0), params=params, mesh=mesh)
  for op in ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
    assert f" {op}(" not in text and f" {op}-start(" not in text, op


@pytest.mark.parametrize("pair", ["llama"], indirect=True)  # every family's tables: numpy's
def test_decode_program_evaluates_no_cos_or_sin(pair):
  """RoPE's cos and sin come from tables built at trace time. Computed in the graph, XLA
  fused them into every layer's q and k rotation and evaluated them again for each head
  at every decode step."""
  _, graphdef, state = pair
  from hflax.rollout.sampler import _generate
  tokens, mask = (jnp.asarray(x) for x in left_pad(_prompts(3), 0))
  params = SamplingParams(max_new_tokens=40, temperature=0)
  text = _generate.lower(graphdef, state, tokens, mask, jax.random.key(0), params=params,
                         segments=2).compile().as_text()
  assert "while" in text
  assert not re.search(r"\b(cosine|sine)\(", text)


@one_family
def test_padding_rows_do_not_extend_the_decode_loop(pair):
  """A padding row is born finished: once the real rows end, the loop stops."""
  _, graphdef, state = pair
  from hflax.rollout.sampler import _generate
  pool = _prompts(6) + _prompts(7)
  free = np.asarray(generate(graphdef, state, pool,
                             SamplingParams(max_new_tokens=8, temperature=0))["responses"])
  eos = int(free[0, 0])  # the first prompt ends at its first token ...
  other = next(i for i in range(1, len(pool)) if eos not in free[i])  # ... this one never
  prompts = [pool[0], pool[other]]
  params = SamplingParams(max_new_tokens=8, temperature=0, eos_ids=(eos,))
  tokens, mask = (jnp.asarray(x) for x in left_pad(prompts, 0))
  run = lambda live: np.asarray(_generate(  # noqa: E731
      graphdef, state, tokens, mask, jax.random.key(0), params=params,
      live_B=live)["response_length"]).tolist()
  assert run(None) == [1, 8]
  assert run(jnp.asarray([True, False])) == [1, 1]


@one_family
def test_replicate_places_a_copy_on_each_device(pair):
  _, graphdef, state = pair
  devices = jax.devices()[:4]
  placed = jax.tree.leaves(replicate(state, devices))
  assert all(x.sharding.device_set == set(devices) and x.sharding.is_fully_replicated
             for x in placed)
  with pytest.raises(ValueError, match="devices has repeats"):
    generate(graphdef, state, [[1, 2]], SamplingParams(temperature=0),
             devices=[devices[0], devices[0]])
