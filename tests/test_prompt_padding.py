"""Prompts padded far past their longest row (a config's max_prompt_length) generate on
the bucket of the longest: the same samples as the untrimmed computation, returned at
the caller's width."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hf_models import tiny_hf_model
from hflax.models import hf
from hflax.platforms.decoding import for_decoding
from hflax.rollout import SamplingParams, generate, left_pad, replicate
from hflax.rollout.decoding import decode_segments
from hflax.rollout.sampler import (_generate, _rows_mesh, compiled_variants,
                                   generate_over_rows, without_shared_padding)

WIDE = 40  # the loader's max_prompt_length; the longest prompt below is 11 tokens (bucket 12)
PARAMS = SamplingParams(max_new_tokens=12, temperature=1.0, n=2, eos_ids=(7, 8, 9))


@pytest.fixture(scope="module")
def model(tmp_path_factory):
  path = tmp_path_factory.mktemp("llama")
  tiny_hf_model("llama", seed=1).save_pretrained(path)
  _, graphdef, state = hf.load_checkpoint(str(path))
  return graphdef, state


def prompts(seed=0, pad_id=1):
  rs = np.random.RandomState(seed)
  rows = [rs.randint(3, 128, size=n).tolist() for n in (5, 11, 2, 8)]
  return left_pad(rows, pad_id, WIDE), left_pad(rows, pad_id)


def test_trims_to_the_longest_rows_bucket_and_only_shared_padding():
  (tokens, mask), _ = prompts()
  short, short_mask, cut = without_shared_padding(tokens, mask)
  assert short.shape == (4, 12) and cut.shape == (4, WIDE - 12)
  assert not mask[:, :WIDE - 12].any() and (short_mask.sum(1) == mask.sum(1)).all()
  full = np.ones((2, WIDE), bool)  # a row that fills the width: nothing to cut
  assert without_shared_padding(np.zeros((2, WIDE), np.int32), full)[2] is None


def test_wide_prompts_sample_what_the_untrimmed_program_samples(model):
  graphdef, state = model
  (tokens, mask), _ = prompts()
  key = jax.random.key(5)
  got = generate(graphdef, state, (tokens, mask), PARAMS, rng=key)
  dec = for_decoding(graphdef, state)  # the sampler before trimming: all 40 columns
  want = _generate(*dec, jnp.asarray(tokens), jnp.asarray(mask), key, params=PARAMS,
                   segments=decode_segments(PARAMS.max_new_tokens))
  assert set(got) == set(want)
  for k in want:
    assert got[k].shape == want[k].shape, k
    if k == "rollout_log_probs":
      np.testing.assert_allclose(got[k], want[k], atol=2e-6)
    else:
      np.testing.assert_array_equal(got[k], want[k], err_msg=k)
  assert np.asarray(got["response_mask"]).any(axis=1).all()


def test_over_rows_in_waves_and_slots_equals_the_bucket_padded_batch(model):
  """Split over 2 devices in waves of 2 prompts, 3 decode slots each: the 40-column batch
  runs the program of the 12-column one (no new compile) and draws the same samples."""
  graphdef, state = model
  (tokens, mask), (narrow, narrow_mask) = prompts(seed=1, pad_id=0)
  devices = jax.devices()[:2]
  placed, mesh, key = replicate(state, devices), _rows_mesh(devices), jax.random.key(2)
  run = lambda t, m: generate_over_rows(graphdef, placed, t, m, key, PARAMS, mesh,  # noqa: E731
                                        wave_rows=2, slots=3)
  want = run(narrow, narrow_mask)
  before = compiled_variants()
  got = run(tokens, mask)
  assert compiled_variants() == before
  extra = WIDE - narrow.shape[1]
  for k in ("prompts", "prompt_mask", "input_ids", "attention_mask", "position_ids"):
    assert got[k].shape[1] == want[k].shape[1] + extra, k
    np.testing.assert_array_equal(np.asarray(got[k])[:, extra:], want[k], err_msg=k)
    assert not np.asarray(got[k])[:, :extra].any(), k
  for k in ("responses", "response_mask", "rollout_log_probs", "response_length"):
    np.testing.assert_array_equal(got[k], want[k], err_msg=k)
