"""Prompts that start with the same tokens (a chat template's system prompt) have those
prefilled once, for one row (decoding.prefill): the samples, log-probs and cache a full
prefill gives."""
import jax
import numpy as np
import pytest
import torch
from flax import nnx

from hf_models import loaded_pair
from hflax.models import ModelConfig, create
from hflax.models.logprobs import sequence_log_probs
from hflax.rollout import SamplingParams, generate, left_pad, sampler
from hflax.rollout.decoding import prefill
from hflax.rollout.sampler import shared_prefix_length

SYSTEM = list(range(20, 39))  # 19 tokens every prompt starts with
ENDINGS = ([5], [6, 7, 8, 9, 10, 11, 12], [13, 14, 15], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49])


def chat_like(seed=0):
  rs = np.random.RandomState(seed)
  return [SYSTEM + (np.asarray(e) + rs.randint(0, 60)).tolist() for e in ENDINGS]


def test_shared_prefix_length_counts_the_first_tokens_all_rows_share():
  def length(prompts, **kw):
    return shared_prefix_length(*left_pad(prompts, 0, width=kw.pop("width", None)), **kw)

  assert length(chat_like()) == 16  # 19 shared, rounded down to SHARED_PREFIX_STEP
  assert length(chat_like(), step=1) == 19
  assert length(chat_like(), width=48) == 16  # wherever the left padding puts them
  # Every row keeps a token after the prefix (its last hidden state picks the first token).
  assert length([[1] * 9, [1] * 9 + [2]], step=1) == 8
  assert length([[1] * 9, [1] * 9]) == 8
  assert length([[3] + SYSTEM, SYSTEM + [3]]) == 0
  assert length([SYSTEM + [3]]) == 0  # one row: nothing to share
  assert length([SYSTEM[:5] + [3], SYSTEM]) == 0  # 5 in common, below one step


CFG = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, qk_norm=True)


def test_prefill_writes_the_prefix_once_and_each_rest_after_it():
  graphdef, state = create(CFG, seed=5)
  tokens, mask = left_pad(chat_like(), 0, width=32)
  C, P = 16, tokens.shape[1]

  @jax.jit
  def run(state, tokens, mask):
    model = nnx.merge(graphdef, state)
    return prefill(model, tokens, mask, 0), prefill(model, tokens, mask, C)

  (full_last, full_cache, full_valid), (last, cache, valid) = run(state, tokens, mask)
  np.testing.assert_array_equal(np.asarray(full_valid), mask)
  np.testing.assert_array_equal(np.asarray(valid)[:, :C], True)
  np.testing.assert_array_equal(np.asarray(valid)[:, C:], mask[:, :P - C])
  np.testing.assert_allclose(np.asarray(last), np.asarray(full_last), atol=1e-5)
  starts = P - mask.sum(axis=1)
  for layer, full_layer in zip(cache, full_cache):
    k, full_k = np.asarray(layer["k"]), np.asarray(full_layer["k"])  # [B, KV, Dh, S]
    v, full_v = np.asarray(layer["v"]), np.asarray(full_layer["v"])  # [B, KV, S, Dh]
    assert (k[:, ..., :C] == k[:1, ..., :C]).all()  # one prefill, copied to every row
    for row, start in enumerate(starts):
      real = slice(C + start, P)  # the rest of the prompt, right-aligned as before
      np.testing.assert_allclose(k[row, ..., :C], full_k[row, ..., start:start + C], atol=1e-5)
      np.testing.assert_allclose(k[row, ..., real], full_k[row, ..., start + C:], atol=1e-5)
      np.testing.assert_allclose(v[row, :, :C], full_v[row, :, start:start + C], atol=1e-5)
      np.testing.assert_allclose(v[row, :, real], full_v[row, :, start + C:], atol=1e-5)


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def pair(request, tmp_path_factory):
  return loaded_pair(request.param, tmp_path_factory.mktemp(request.param), seed=2)


def test_greedy_from_a_shared_prefix_equals_transformers_generate(pair, monkeypatch):
  model, graphdef, state = pair
  prompts = chat_like(1)
  seen = []
  spy = lambda model, tokens, mask, shared: seen.append(shared) or prefill(  # noqa: E731
      model, tokens, mask, shared)
  monkeypatch.setattr(sampler, "prefill", spy)
  sampler._generate.clear_cache()  # trace again, through the spy
  out = generate(graphdef, state, prompts, SamplingParams(max_new_tokens=40, temperature=0))
  assert seen == [16]
  for row, prompt in enumerate(prompts):
    with torch.no_grad():
      ref = model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False,
                           eos_token_id=None, pad_token_id=0)
    np.testing.assert_array_equal(np.asarray(out["responses"][row]), ref[0, len(prompt):].numpy())


# One jitted function for every case: each model's teacher-forced pass is traced once.
TEACHER = jax.jit(sequence_log_probs, static_argnums=0, static_argnames="temperature")


@pytest.mark.parametrize("how", [dict(), dict(slots=3), dict(devices=2), dict(devices=3)])
def test_shared_prefill_samples_what_a_full_prefill_does(pair, how, monkeypatch):
  _, graphdef, state = pair
  prompts = chat_like(2)
  how = {**how, "devices": jax.devices()[:how["devices"]]} if "devices" in how else how
  params = SamplingParams(max_new_tokens=24, temperature=0.8, top_p=0.9, n=2, eos_ids=(7, 9))
  shared = generate(graphdef, state, prompts, params, rng=jax.random.key(4), **how)
  monkeypatch.setattr(sampler, "shared_prefix_length", lambda *a, **k: 0)
  full = generate(graphdef, state, prompts, params, rng=jax.random.key(4), **how)
  for key in full:
    if key == "rollout_log_probs":
      np.testing.assert_allclose(np.asarray(shared[key]), np.asarray(full[key]), atol=1e-5)
    else:
      np.testing.assert_array_equal(np.asarray(shared[key]), np.asarray(full[key]), err_msg=key)
  # On-policy: the rollout's log-probs are the teacher-forced ones of what it sampled.
  width = shared["prompts"].shape[1]
  teacher, _ = TEACHER(graphdef, state, np.asarray(shared["input_ids"]),
                       np.asarray(shared["attention_mask"]), temperature=0.8)
  mask = np.asarray(shared["response_mask"])
  np.testing.assert_allclose(np.asarray(shared["rollout_log_probs"]),
                             np.asarray(teacher)[:, width:] * mask, atol=1e-5)
