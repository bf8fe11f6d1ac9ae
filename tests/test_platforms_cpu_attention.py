"""cpu_attention: the AVX-512 kernel for one decode step's attention, against
attention.one_query (and float64 sums), and where the decoding copy uses it. The tokens
SmolLM2 decodes through it: test_platforms_cpu_decoding_copy.py."""
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hflax.models import ModelConfig, create
from hflax.platforms.cpu import attention as cpu_attention
from hflax.platforms.cpu import matmul as cpu_matmul
from hflax.models.attention import one_query, visible
from hflax.platforms.cpu.decoding_copy import decoding_plan, for_decoding
from hflax.rollout import SamplingParams, generate, left_pad
from hflax.rollout.decoding import decode_segments, kernel_attends
from hflax.rollout.sampler import _generate, replicate
from hflax.sharding.hybrid_engine import HybridEngine
from hflax.sharding.layouts import TRAIN_RULES, state_shardings, train_mesh

REASON = cpu_attention.problem(jnp.float32)
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"cpu_attention: {REASON}")
DTYPES = pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
CFG = dict(vocab_size=64, hidden_size=64, intermediate_size=80, num_layers=2, num_heads=4,
           num_kv_heads=2)  # head_dim 16: the kernel's least


@pytest.fixture(autouse=True)
def one_core(monkeypatch):
  """As on a host with one core per device, where the copy uses the kernels
  (cpu_matmul.serves): the tests' 8 simulated devices share this machine's cores."""
  monkeypatch.setattr(cpu_matmul, "cores", lambda: 1)


def _operands(B, KV, G, Dh, S, dtype, seed=0):
  kq, kk, kv, km = jax.random.split(jax.random.key(seed), 4)
  q = (2 * jax.random.normal(kq, (B, 1, KV * G, Dh))).astype(dtype)
  k = (2 * jax.random.normal(kk, (B, KV, Dh, S))).astype(dtype)
  v = jax.random.normal(kv, (B, KV, S, Dh)).astype(dtype)
  valid = jax.random.uniform(km, (B, S)) < 0.8
  valid = valid.at[0].set(False)  # a row that sees nothing: uniform over every slot
  slot = (S - 1 - jnp.arange(B)[:, None]) % S  # late slots: every slot block is seen
  return q, k, v, valid, slot


@needs_kernel
@DTYPES
@pytest.mark.parametrize("KV,G,Dh,S", [(1, 1, 16, 1), (2, 3, 64, 17), (3, 5, 80, 33),
                                       (1, 4, 128, 80), (2, 9, 32, 130), (1, 2, 48, 64)])
def test_the_kernel_attends_as_one_query(KV, G, Dh, S, dtype):
  """Every remainder: head groups of 4 and less, head_dim in 64-wide blocks and less,
  slots in 32-wide blocks and less. float32: one_query's result to float32 rounding (the
  scores are its own sums; exp and the values' sum round differently); bfloat16: within
  one rounding of the output (the probabilities are rounded to bfloat16 as one_query
  rounds them) and both within bfloat16 error of the float64 attention."""
  B = 5
  q, k, v, valid, slot = _operands(B, KV, G, Dh, S, dtype)
  want = one_query(q, k, v, valid, slot)
  got = jax.jit(cpu_attention.decode)(q[:, 0], k, v, visible(valid, slot)[:, 0])[:, None]
  assert got.dtype == want.dtype and got.shape == want.shape
  got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
  # float64 reference of the same attention.
  q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
  scores = np.einsum("bkgd,bkds->bkgs", q64[:, 0].reshape(B, KV, G, Dh), k64) / np.sqrt(Dh)
  seen = np.asarray(visible(valid, slot))[:, 0][:, None, None]
  scores = np.where(seen, scores, -1e30)
  p = np.exp(scores - scores.max(-1, keepdims=True))
  p /= p.sum(-1, keepdims=True)
  exact = np.einsum("bkgs,bksd->bkgd", p, v64).reshape(B, 1, KV * G, Dh)
  if dtype == "float32":
    np.testing.assert_allclose(got, want, atol=2e-6, rtol=1e-5)
    np.testing.assert_allclose(got, exact, atol=1e-5, rtol=1e-5)
  else:
    scale = np.abs(exact).max()
    assert np.abs(got - want).max() <= 2 ** -7 * scale, np.abs(got - want).max()
    assert np.abs(got - exact).max() <= 2 ** -6 * scale
  # Row 0 sees no slot: the mean of every value.
  np.testing.assert_allclose(got[0, 0], np.asarray(v, np.float32)[0].mean(1).repeat(G, 0),
                             atol=1e-5 if dtype == "float32" else 2e-2)


@needs_kernel
def test_bfloat16_keys_are_read_as_their_bits():
  """The cache stores bfloat16 keys as uint16 bits on CPU (transformer.KEY_BITS): the
  kernel takes either, and refuses a cache it has no kernel for."""
  q, k, v, valid, slot = _operands(3, 2, 2, 32, 20, jnp.bfloat16)
  seen = visible(valid, slot)[:, 0]
  bits = jax.lax.bitcast_convert_type(k, jnp.uint16)
  np.testing.assert_array_equal(np.asarray(cpu_attention.decode(q[:, 0], bits, v, seen)),
                                np.asarray(cpu_attention.decode(q[:, 0], k, v, seen)))
  assert not cpu_attention.takes(jnp.bfloat16, k.astype(jnp.float32), v)
  assert not cpu_attention.takes(jnp.float32, k.astype(jnp.float32), v)
  with pytest.raises(ValueError, match="no kernel for float32 queries on bfloat16 keys"):
    cpu_attention.decode(q[:, 0].astype(jnp.float32), k, v, seen)


@needs_kernel
@DTYPES
def test_rows_are_read_only_to_their_last_visible_slot(dtype):
  """A cache wider than what it holds (grown once to its full width): each row reads up to
  its last visible slot, so the result is the narrow cache's bit for bit, even with NaN in
  the empty tail (a row that sees nothing still weighs every slot)."""
  B, KV, G, Dh, S, wide = 5, 2, 3, 64, 40, 200
  q, k, v, valid, slot = _operands(B, KV, G, Dh, S, dtype)
  seen = visible(valid, slot)[:, 0]
  seen = seen.at[1, 7:].set(False)  # rows ending at different slots
  nan = lambda x, axis: jnp.concatenate(  # noqa: E731
      [x, jnp.full(x.shape[:axis] + (wide - S,) + x.shape[axis + 1:], jnp.nan, x.dtype)],
      axis)
  seen_wide = jnp.concatenate([seen, jnp.zeros((B, wide - S), bool)], axis=1)
  seen_wide = seen_wide.at[0].set(False)
  narrow = np.asarray(cpu_attention.decode(q[:, 0], k, v, seen), np.float32)
  got = np.asarray(cpu_attention.decode(q[:, 0], nan(k, 3), nan(v, 2), seen_wide), np.float32)
  np.testing.assert_array_equal(got[1:], narrow[1:])
  assert np.isnan(got[0]).all()  # row 0 sees nothing: the mean over every slot, NaN too


@needs_kernel
@DTYPES
def test_a_copy_attending_through_the_kernel_decodes_in_one_loop(monkeypatch, dtype):
  """The kernel skips the unfilled tail, so the cache grows once and the decode loop is
  not split into segments (each growth copies the whole cache); XLA's attention keeps
  them (it reads every slot)."""
  copy = for_decoding(*_model(dtype))
  tokens, mask = (jnp.asarray(x) for x in left_pad([[5, 6, 7], [9] * 5], 0))

  def calls(graphdef, state):
    text = _generate.lower(graphdef, state, tokens, mask, jax.random.key(0),
                           params=SamplingParams(max_new_tokens=64, temperature=0),
                           segments=decode_segments(64)).compile().as_text()
    return len(re.findall(r'custom_call_target="hflax_cpu_attention_', text))

  # Asked for decode_segments(64) == 2 loops, it compiles one: a call a layer, not two.
  assert decode_segments(64) == 2
  assert kernel_attends(nnx.merge(*copy)) and calls(*copy) == 2
  monkeypatch.setenv(cpu_attention.ENV, "0")
  jax.clear_caches()
  assert not kernel_attends(nnx.merge(*copy)) and calls(*copy) == 0


def _model(dtype="bfloat16", **changes):
  return create(ModelConfig(**CFG, dtype=dtype, param_dtype="float32", **changes), seed=3)


def _flags(graphdef, state):
  return [layer.attn.cpu_attention for layer in nnx.merge(graphdef, state).layers]


@needs_kernel
@DTYPES
def test_the_decode_program_calls_the_kernel_in_every_layer(dtype):
  """Each decode step attends through the custom call, once a layer; the prompt's
  prefill (many queries a row) keeps XLA's attention."""
  graphdef, state = for_decoding(*_model(dtype))
  assert _flags(graphdef, state) == [True, True]
  tokens, mask = (jnp.asarray(x) for x in left_pad([[5, 6, 7], [9] * 5, [4], [8, 2]], 0))
  text = _generate.lower(graphdef, state, tokens, mask, jax.random.key(0),
                         params=SamplingParams(max_new_tokens=8, temperature=0)
                         ).compile().as_text()
  calls = re.findall(r'custom_call_target="hflax_cpu_attention_(\w+)"', text)
  # One decode loop (8 tokens: one segment), its step calling the kernel once a layer.
  assert calls == [{"bfloat16": "bf16", "float32": "f32"}[dtype]] * 2, calls


@needs_kernel
def test_xla_attends_where_asked_after_the_copy_was_made_or_by_the_config(monkeypatch):
  """HFLAX_CPU_ATTENTION=0 set after a copy asked for the kernel, and a model configured
  for an attention implementation of its own: their decode programs call no kernel."""
  tokens, mask = (jnp.asarray(x) for x in left_pad([[5, 6, 7], [9] * 5], 0))

  def calls(graphdef, state):
    text = _generate.lower(graphdef, state, tokens, mask, jax.random.key(0),
                           params=SamplingParams(max_new_tokens=4, temperature=0)
                           ).compile().as_text()
    return len(re.findall(r'custom_call_target="hflax_cpu_attention_', text))

  copy = for_decoding(*_model("float32"))
  assert _flags(*copy) == [True, True] and calls(*copy) == 2
  monkeypatch.setenv(cpu_attention.ENV, "0")
  jax.clear_caches()  # a program traced before keeps what it was traced with
  assert calls(*copy) == 0
  monkeypatch.delenv(cpu_attention.ENV)
  blockwise = for_decoding(*_model("float32", attention="blockwise"))
  assert _flags(*blockwise) == [True, True] and calls(*blockwise) == 0


@needs_kernel
def test_the_hybrid_engines_copy_attends_through_it_without_a_tensor_axis():
  """An RL actor's generation copy (the hybrid engine's): the kernel where each device
  holds the whole weights (generation tensor width 1), not where they are split."""
  graphdef, state = _model()
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  mesh = train_mesh(jax.devices()[:2], fsdp=2)
  train = state_shardings(abstract, mesh, TRAIN_RULES)
  weights = jax.device_put(state, train)
  for tensor, attends in ((1, True), (2, False)):
    engine = HybridEngine(mesh, abstract, train, tensor, graphdef=graphdef)
    generation, _ = engine.to_generate(weights)
    assert _flags(engine.graphdef, generation) == [attends] * 2


@needs_kernel
@DTYPES
def test_generation_through_the_kernel_equals_xla_attention(monkeypatch, dtype):
  """Greedy tokens and their log-probs, with the kernel (one decode loop, the cache at its
  full width) and with HFLAX_CPU_ATTENTION=0 (two loop segments), on two devices (rows
  split, a replica of the copy on each)."""
  graphdef, state = _model(dtype)
  prompts = [[5, 6, 7], [9] * 5, [4], [8, 2], [1, 2, 3, 4, 5, 6, 7], [3]]
  params = SamplingParams(max_new_tokens=64, temperature=0)
  devices = jax.devices()[:2]
  assert _flags(*for_decoding(graphdef, replicate(state, devices))) == [True, True]
  via_kernel = generate(graphdef, state, prompts, params, devices=devices)
  monkeypatch.setenv(cpu_attention.ENV, "0")
  assert _flags(*for_decoding(graphdef, state)) == [False, False]
  via_xla = generate(graphdef, state, prompts, params, devices=devices)
  np.testing.assert_array_equal(np.asarray(via_kernel["responses"]),
                                np.asarray(via_xla["responses"]))
  np.testing.assert_allclose(np.asarray(via_kernel["rollout_log_probs"]),
                             np.asarray(via_xla["rollout_log_probs"]),
                             atol=2e-2 if dtype == "bfloat16" else 1e-5)


def test_it_stays_off_where_asked_or_unusable(monkeypatch, caplog):
  """HFLAX_CPU_ATTENTION=0, an unserved dtype or head_dim, a CPU without AVX-512, weights
  on a lone device of a several-core process or split over devices: XLA attends, and the
  reason is logged."""
  graphdef, state = _model()
  monkeypatch.setenv(cpu_attention.ENV, "0")
  assert cpu_attention.problem(jnp.bfloat16) == "HFLAX_CPU_ATTENTION=0"
  assert _flags(*for_decoding(graphdef, state)) == [False, False]
  monkeypatch.delenv(cpu_attention.ENV)
  assert cpu_attention.problem(jnp.float16) == "no kernel for float16"
  assert not cpu_attention.fits(24) and not cpu_attention.fits(0) and cpu_attention.fits(80)
  with pytest.raises(ValueError, match="head_dim 24 is not a positive multiple of 16"):
    cpu_attention.decode(jnp.ones((1, 2, 24)), jnp.ones((1, 1, 24, 3)), jnp.ones((1, 1, 3, 24)),
                         jnp.ones((1, 3), bool))
  monkeypatch.setattr(cpu_matmul, "_cpu_flags", lambda: frozenset({"avx2", "fma"}))
  assert cpu_attention.problem(jnp.float32) == (
      "this CPU lacks avx512bw, avx512f, avx512vl")
  cpu_matmul.note_once.cache_clear()  # logged once a process: maybe logged already
  with caplog.at_level(logging.INFO, logger=cpu_matmul.__name__):
    assert not cpu_attention.usable(jnp.float32)
  assert "decode attention through XLA in float32: this CPU lacks" in caplog.text
  with pytest.raises(RuntimeError, match="hflax cpu attention: this CPU lacks"):
    cpu_attention.decode(jnp.ones((1, 2, 16)), jnp.ones((1, 1, 16, 3)), jnp.ones((1, 1, 3, 16)),
                         jnp.ones((1, 3), bool))
  monkeypatch.undo()
  # Not where the copy is not used whole on one device per core.
  monkeypatch.setattr(cpu_matmul, "cores", lambda: 2)
  assert _flags(*for_decoding(graphdef, state)) == [False, False]
  mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
  split = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec(
      *([None] * (x.ndim - 1)), "tensor") if x.ndim and x.shape[-1] % 2 == 0
      else PartitionSpec())), state)
  assert _flags(*for_decoding(graphdef, split)) == [False, False]
  if REASON is None:
    whole = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))
    assert _flags(*for_decoding(graphdef, whole)) == [True, True]
    # The hybrid engine's unfused copy asks for it on the same terms.
    plan = decoding_plan(graphdef, state, fuse=False, attend=("bfloat16",))
    assert _flags(plan.graphdef, plan.abstract) == [True, True]
    plan = decoding_plan(graphdef, state, fuse=False)
    assert _flags(plan.graphdef, plan.abstract) == [False, False]
