"""Packed sequences, per-row decode slots, and attention implementations against the reference."""
import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hflax.models import ModelConfig, attention, create, init_cache
from hflax.models.transformer import forward, positions_from_segments
from hlo_dots import dot_operand_types

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2, attention="reference")


def _tokens(n, seed):
  return np.random.RandomState(seed).randint(1, CFG.vocab_size, size=(1, n)).astype(np.int32)


def test_positions_restart_at_each_packed_sequence():
  seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [0, 1, 1, 1, 1, 2, 2, 0]])
  np.testing.assert_array_equal(positions_from_segments(seg),
                                [[0, 1, 2, 0, 1, 0, 0, 0], [0, 0, 1, 2, 3, 0, 1, 0]])


@pytest.mark.parametrize("remat", [False, True])
def test_packed_row_matches_each_sequence_alone(remat):
  cfg = CFG.replace(remat=remat)
  graphdef, state = create(cfg)
  a, b = _tokens(5, 1), _tokens(7, 2)
  packed = np.concatenate([a, b, np.zeros((1, 2), np.int32)], axis=1)
  seg = np.asarray([[1] * 5 + [2] * 7 + [0] * 2], np.int32)
  hidden_of = jax.jit(lambda state, *a, **kw: forward(graphdef, state, *a, **kw)[1])
  hidden = hidden_of(state, jnp.asarray(packed), None, segment_ids_BxT=jnp.asarray(seg))
  assert np.isfinite(np.asarray(hidden)).all()  # pad queries see no key, yet stay finite
  for tokens, cols in ((a, slice(0, 5)), (b, slice(5, 12))):
    alone = hidden_of(state, jnp.asarray(tokens), jnp.ones_like(tokens))
    np.testing.assert_allclose(hidden[:, cols], alone, atol=2e-5, rtol=2e-5)


def test_segment_ids_with_a_cache_are_refused():
  model = nnx.merge(*create(CFG))
  tokens = jnp.ones((1, 4), jnp.int32)
  with pytest.raises(ValueError, match="segment_ids_BxT"):
    model(tokens, jnp.zeros((1, 4), jnp.int32), jnp.ones((1, 4), bool),
          cache=init_cache(CFG, 1, 4), segment_ids_BxT=jnp.ones((1, 4), jnp.int32))


@functools.cache
def _cached_call(graphdef):
  """The model's call with a cache, compiled once per shape (not op by op): (logits,
  cache). slot0 is traced: an int is a shared slot (a scalar), an int32 [B] each row's."""
  @jax.jit
  def call(state, tokens, positions, kv_valid, cache, slot0):
    model = nnx.merge(graphdef, state)
    hidden, cache = model(tokens, positions, kv_valid, cache=cache, slot0=slot0)
    return model.logits(hidden), cache
  return call


def _prefill(graphdef, state, prompt, S):
  """The cache and kv_valid of one row prefilled with `prompt` at slots 0..len-1."""
  L = prompt.shape[1]
  kv_valid = jnp.zeros((1, S), bool).at[:, :L].set(True)
  tokens = jnp.pad(jnp.asarray(prompt), ((0, 0), (0, S - L)))
  _, cache = _cached_call(graphdef)(state, tokens[:, :L], jnp.arange(L)[None], kv_valid,
                                    init_cache(CFG, 1, S), 0)
  return cache, kv_valid


@pytest.mark.parametrize("T", [1, 3])
def test_rows_decoding_at_their_own_slots_match_each_row_alone(T):
  graphdef, state = create(CFG)
  call = _cached_call(graphdef)
  S, lengths = 16, (4, 9)
  rows = [_prefill(graphdef, state, _tokens(L, 10 + L), S) for L in lengths]
  new = [_tokens(T, 20 + L) for L in lengths]
  alone = []
  for (cache, kv_valid), L, tok in zip(rows, lengths, new):
    kv_valid = kv_valid.at[:, L:L + T].set(True)
    alone.append(call(state, jnp.asarray(tok), L + jnp.arange(T)[None], kv_valid, cache, L)[0])
  cache = jax.tree.map(lambda *r: jnp.concatenate(r), *[c for c, _ in rows])
  kv_valid = jnp.concatenate([v.at[:, L:L + T].set(True) for (_, v), L in zip(rows, lengths)])
  slot0 = jnp.asarray(lengths, jnp.int32)
  logits, cache = call(state, jnp.asarray(np.concatenate(new)), slot0[:, None] + jnp.arange(T),
                       kv_valid, cache, slot0)
  np.testing.assert_allclose(logits, np.concatenate(alone), atol=2e-5, rtol=2e-5)
  # Each row's new K/V sit at its own columns, the other columns untouched.
  for b, ((row_cache, _), L) in enumerate(zip(rows, lengths)):
    np.testing.assert_array_equal(cache[0]["v"][b, :, :L], row_cache[0]["v"][0, :, :L])
    assert np.abs(np.asarray(cache[0]["v"][b, :, L:L + T])).min() > 0
    assert not np.asarray(cache[0]["k"][b, :, :, L + T:]).any()


def test_a_shared_slot_writes_the_cache_with_dynamic_update_slice():
  model = nnx.merge(*create(CFG))

  def step(slot0):
    return model(jnp.ones((2, 1), jnp.int32), jnp.ones((2, 1), jnp.int32),
                 jnp.ones((2, 8), bool), cache=init_cache(CFG, 2, 8), slot0=slot0)[0]

  shared = str(jax.make_jaxpr(step)(jnp.int32(3)))
  per_row = str(jax.make_jaxpr(step)(jnp.asarray([3, 5], jnp.int32)))
  assert "dynamic_update_slice" in shared and "scatter" not in shared
  assert "scatter" in per_row


# --- Attention implementations against the dense reference ---

def _qkv(B, T, S, H, KV, Dh, seed=0):
  r = np.random.RandomState(seed)
  return (jnp.asarray(r.randn(B, T, H, Dh), jnp.float32),
          jnp.asarray(r.randn(B, KV, Dh, S), jnp.float32),
          jnp.asarray(r.randn(B, KV, S, Dh), jnp.float32))


def _jit_value_and_grad(fn, has_aux=True):
  """value_and_grad over (q, k, v) as one compiled program: run eagerly, every op and
  every loop body of the backward pass compiles on its own, which costs these tests more
  than computing."""
  return jax.jit(jax.value_and_grad(fn, (0, 1, 2), has_aux=has_aux))


def _masks(case, B, T, S):
  """kv_valid, q_slot, segment ids and which queries see a key, for each masking case."""
  valid = np.ones((B, S), bool)
  slot = np.arange(T)[None] + np.zeros((B, 1), int)
  seg = None
  if case == "left_padding":
    valid[1, :7] = False
    valid[2, :T - 2] = False  # a row with one real token
  elif case == "segments":
    seg = np.zeros((B, T), np.int32)
    seg[0, :13], seg[0, 13:T - 3] = 1, 2
    seg[1, 2:] = 1
    seg[2, :5], seg[2, 5:11], seg[2, 11:] = 1, 2, 3
    valid = seg > 0
  elif case == "per_row_slots":  # T new tokens at each row's own slot of a longer cache
    slot = np.asarray([[0], [S - T - 9], [S - T]]) + np.arange(T)
    valid[1, :4] = False
    valid[1, S - 9:] = False
  seen = (valid[:, None, :] & (np.arange(S) <= slot[:, :, None]))
  if seg is not None:
    seen &= (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
  seg = None if seg is None else jnp.asarray(seg)
  return jnp.asarray(valid), jnp.asarray(slot, jnp.int32), seg, seen.any(-1)


@pytest.mark.parametrize("case,T,S", [("left_padding", 37, 37), ("segments", 37, 37),
                                      ("per_row_slots", 21, 53)])
@pytest.mark.parametrize("q_block,k_block", [(8, 8), (5, 7), (16, 32), (64, 64)])
def test_blockwise_matches_reference_in_values_and_gradients(case, T, S, q_block, k_block):
  B, H, KV, Dh = 3, 6, 2, 8  # GQA: 3 query heads per KV head
  q, k, v = _qkv(B, T, S, H, KV, Dh)
  valid, slot, seg, seen = _masks(case, B, T, S)
  rows = jnp.asarray(seen)[:, :, None, None]
  w = jnp.asarray(np.random.RandomState(1).randn(B, T, H, Dh), jnp.float32)

  def loss(impl, q, k, v):
    out = impl(q, k, v, valid, slot, seg, seg)
    return jnp.sum(jnp.where(rows, out, 0) * w), out

  blk = functools.partial(attention.blockwise, q_block=q_block, k_block=k_block)
  (_, want), grads_want = _jit_value_and_grad(functools.partial(loss, attention.reference))(
      q, k, v)
  (_, got), grads_got = _jit_value_and_grad(functools.partial(loss, blk))(q, k, v)
  assert np.isfinite(np.asarray(got)).all()
  np.testing.assert_allclose(np.where(seen[:, :, None, None], got, 0),
                             np.where(seen[:, :, None, None], want, 0), atol=2e-6)
  for g, want_g in zip(grads_got, grads_want):
    np.testing.assert_allclose(g, want_g, atol=1e-5)


def _dense_autodiff(q, k, v, valid, slot, q_seg, k_seg):
  """Dense attention written plainly and differentiated by JAX (the reference's backward
  pass is hand-written)."""
  B, T, H, Dh = q.shape
  KV = k.shape[1]
  scores = jnp.einsum("btkgd,bkds->bkgts", q.reshape(B, T, KV, H // KV, Dh), k) * Dh ** -0.5
  mask = attention.visible(valid, slot, q_seg, k_seg)[:, None, None]
  probs = jax.nn.softmax(jnp.where(mask, scores, attention.MASKED), axis=-1)
  return jnp.einsum("bkgts,bksd->btkgd", probs, v).reshape(B, T, H, Dh)


@pytest.mark.parametrize("case,T,S", [("left_padding", 37, 37), ("segments", 37, 37),
                                      ("per_row_slots", 21, 53)])
def test_reference_gradient_matches_autodiff(case, T, S):
  """Every query weighted, pads with no visible key included: theirs spread evenly over
  masked keys, a value gradient and no score gradient."""
  B, H, KV, Dh = 3, 6, 2, 8
  q, k, v = _qkv(B, T, S, H, KV, Dh)
  valid, slot, seg, seen = _masks(case, B, T, S)
  w = jnp.asarray(np.random.RandomState(1).randn(B, T, H, Dh), jnp.float32)

  def loss(impl, q, k, v):
    return jnp.sum(impl(q, k, v, valid, slot, seg, seg) * w)

  assert seen.all() == (case == "per_row_slots")  # else some query sees nothing
  got = jax.jit(jax.grad(functools.partial(loss, attention.reference), (0, 1, 2)))(q, k, v)
  want = jax.jit(jax.grad(functools.partial(loss, _dense_autodiff), (0, 1, 2)))(q, k, v)
  for g, want_g in zip(got, want):
    np.testing.assert_allclose(g, want_g, atol=1e-5)


def test_bfloat16_reference_gradients_stay_near_float32_and_reduce_over_head_dim():
  """The softmax's correction term is rowsum(dO * O) over head_dim: autodiff's sum over
  the keys, [.., T, S], XLA:CPU sent to its matmul library, 6.6 ms a layer of a 448-token
  row. In the gradient program only the forward's max and sum reduce over the keys."""
  B, T, H, KV, Dh = 3, 37, 6, 2, 16
  q, k, v = _qkv(B, T, T, H, KV, Dh)
  valid, slot, seg, seen = _masks("segments", B, T, T)
  w = jnp.asarray(np.random.RandomState(1).randn(B, T, H, Dh), jnp.float32)

  def loss(impl, q, k, v):
    return jnp.sum(impl(q, k, v, valid, slot, seg, seg) * w)

  ref = functools.partial(loss, attention.reference)
  low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  compiled = {name: jax.jit(jax.grad(fn, (0, 1, 2))).lower(*low).compile()
              for name, fn in (("ref", ref), ("dense", functools.partial(loss, _dense_autodiff)))}
  grads = compiled["ref"](*low)  # the program whose reductions are counted below
  want = jax.jit(jax.grad(ref, (0, 1, 2)))(*[x.astype(jnp.float32) for x in low])
  for g, r in zip(grads, want):
    assert g.dtype == jnp.bfloat16
    err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - r)))
    assert err <= 3e-2 * float(jnp.max(jnp.abs(r))), err

  def over_keys(name):
    text = compiled[name].as_text()
    return len(re.findall(rf"= \w+\[{B},{KV},{H // KV},{T}\]\S* reduce\(", text))
  assert over_keys("ref") == 2
  assert over_keys("dense") == 3  # what the test tells apart


def test_bfloat16_blockwise_gradients_read_bfloat16_and_stay_near_float32():
  """On CPU, XLA widens a bf16 matmul to float32 unless its operands are laid out for the
  fast library (hflax.models.matmul); dK and dV contract over (group, query) pairs, which
  XLA lays out itself (it transposes dots with several contracted axes)."""
  B, T, H, KV, Dh = 3, 37, 6, 2, 16
  q, k, v = _qkv(B, T, T, H, KV, Dh)
  valid, slot, seg, seen = _masks("segments", B, T, T)
  rows = jnp.asarray(seen)[:, :, None, None]
  w = jnp.asarray(np.random.RandomState(1).randn(B, T, H, Dh), jnp.float32)

  def loss(impl, q, k, v):
    return jnp.sum(jnp.where(rows, impl(q, k, v, valid, slot, seg, seg), 0) * w)

  blk = functools.partial(attention.blockwise, q_block=16, k_block=16)
  low = [x.astype(jnp.bfloat16) for x in (q, k, v)]
  compiled = jax.jit(jax.grad(functools.partial(loss, blk), (0, 1, 2))).lower(*low).compile()
  grads = compiled(*low)  # the program whose dots are read below
  want = jax.jit(jax.grad(functools.partial(loss, attention.reference), (0, 1, 2)))(
      *[x.astype(jnp.float32) for x in low])
  for g, ref in zip(grads, want):
    assert g.dtype == jnp.bfloat16
    err = float(jnp.max(jnp.abs(g.astype(jnp.float32) - ref)))
    assert err <= 3e-2 * float(jnp.max(jnp.abs(ref))), err
  reads = dot_operand_types(compiled.as_text())
  assert reads and all(r == ("bf16", "bf16") for r in reads), reads


def test_cudnn_arguments_match_reference(monkeypatch):
  """The rotation to right padding, run by XLA's implementation of the same call."""
  B, T, H, KV, Dh = 3, 29, 4, 2, 8
  q, k, v = _qkv(B, T, T, H, KV, Dh, seed=3)
  valid = np.ones((B, T), bool)
  valid[1, :6] = False  # left padding
  valid[2, 20:] = False  # right padding
  holes = valid.copy()
  holes[0, 10] = False  # not one contiguous run: not for cuDNN
  monkeypatch.setattr(attention, "blockwise", lambda q, *_: jnp.zeros_like(q))
  slot = jnp.arange(T)[None]
  for mask, expect_fallback in ((valid, False), (holes, True)):
    want = attention.reference(q, k, v, jnp.asarray(mask), slot)
    got = attention.cudnn(q, k, v, jnp.asarray(mask), implementation="xla")
    if expect_fallback:
      assert not np.asarray(got).any()
      continue
    rows = mask[:, :, None, None]
    np.testing.assert_allclose(np.where(rows, got, 0), np.where(rows, want, 0), atol=2e-6)

    def grad(f):
      return jax.jit(jax.grad(lambda *a: jnp.sum(jnp.where(rows, f(*a), 0) ** 2),
                              (0, 1, 2)))(q, k, v)

    for g, want_g in zip(grad(lambda *a: attention.cudnn(*a, jnp.asarray(mask),
                                                         implementation="xla")),
                         grad(lambda *a: attention.reference(*a, jnp.asarray(mask), slot))):
      np.testing.assert_allclose(g, want_g, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_splash_kernel_matches_reference(packed):
  """The TPU kernel's arguments (GQA, scaling, segment ids), run in Pallas interpret mode."""
  B, T, H, KV, Dh = 2, 128, 4, 2, 64
  q, k, v = _qkv(B, T, T, H, KV, Dh, seed=5)
  valid = np.ones((B, T), bool)
  valid[1, :7] = False
  seg = None
  if packed:
    seg = np.where(valid, 1, 0).astype(np.int32)
    seg[0, 50:], seg[1, 90:120], seg[1, 120:] = 2, 2, 0
    valid = seg > 0
    seg = jnp.asarray(seg)
  rows = valid[:, :, None, None]
  slot = jnp.arange(T)[None]

  def loss(f):
    return lambda *a: jnp.sum(jnp.where(rows, f(*a), 0) ** 2)

  splash = lambda q, k, v: attention.splash(q, k, v, jnp.asarray(valid), seg, interpret=True)  # noqa: E731
  ref = lambda q, k, v: attention.reference(q, k, v, jnp.asarray(valid), slot, seg, seg)  # noqa: E731
  out = splash(q, k, v)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(np.where(rows, out, 0), np.where(rows, ref(q, k, v), 0), atol=2e-6)
  for g, want in zip(jax.grad(loss(splash), (0, 1, 2))(q, k, v),
                     jax.grad(loss(ref), (0, 1, 2))(q, k, v)):
    np.testing.assert_allclose(g, want, atol=2e-5)


def test_unknown_attention_is_refused():
  with pytest.raises(ValueError, match="attention='flash'"):
    CFG.replace(attention="flash")


@pytest.mark.parametrize("packed", [False, True])
def test_model_loss_and_gradients_match_reference(monkeypatch, packed):
  """Logits and the gradient of a whole tiny model's log-prob loss, blockwise vs reference."""
  monkeypatch.setattr(attention, "blockwise",
                      functools.partial(attention.blockwise, q_block=8, k_block=16))
  tokens = np.random.RandomState(4).randint(1, CFG.vocab_size, size=(2, 45)).astype(np.int32)
  mask = np.ones_like(tokens)
  mask[1, :9] = 0
  seg = np.asarray([[1] * 20 + [2] * 25, [0] * 3 + [1] * 30 + [2] * 12], np.int32)
  seg_ids = jnp.asarray(seg) if packed else None
  keep = jnp.asarray(seg > 0 if packed else mask > 0)

  def loss(graphdef, state):
    model, hidden = forward(graphdef, state, jnp.asarray(tokens), jnp.asarray(mask),
                            segment_ids_BxT=seg_ids)
    logits = model.logits(hidden)
    logp = jax.nn.log_softmax(logits)[:, :-1]
    picked = jnp.take_along_axis(logp, jnp.asarray(tokens)[:, 1:, None], -1)[..., 0]
    scored = keep[:, 1:] & keep[:, :-1]  # a pad's hidden state is no context (logprobs.py)
    return -jnp.sum(jnp.where(scored, picked, 0)), jnp.where(keep[..., None], logits, 0)

  results = []
  for impl in ("reference", "blockwise"):
    graphdef, state = create(CFG.replace(attention=impl))
    results.append(jax.jit(jax.value_and_grad(functools.partial(loss, graphdef),
                                              has_aux=True))(state))
  (_, logits_ref), grads_ref = results[0]
  (_, logits_blk), grads_blk = results[1]
  np.testing.assert_allclose(logits_blk, logits_ref, atol=2e-5)
  for got, want in zip(jax.tree.leaves(grads_blk), jax.tree.leaves(grads_ref)):
    np.testing.assert_allclose(got, want, atol=2e-5, rtol=1e-4)


def _train_step_temp_bytes(impl, T):
  """XLA's temporary memory for one teacher-forced forward + backward of a small model."""
  cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, attention=impl)
  graphdef, state = create(cfg)
  tokens = jax.ShapeDtypeStruct((1, T), jnp.int32)

  def loss(state, tokens):
    _, hidden = forward(graphdef, state, tokens, jnp.ones_like(tokens))
    return jnp.sum(hidden.astype(jnp.float32) ** 2)

  compiled = jax.jit(jax.grad(loss)).lower(state, tokens).compile()
  return compiled.memory_analysis().temp_size_in_bytes


def test_blockwise_memory_grows_linearly_and_reference_quadratically():
  blk = {T: _train_step_temp_bytes("blockwise", T) for T in (1024, 8192)}
  ref = {T: _train_step_temp_bytes("reference", T) for T in (1024, 8192)}
  assert blk[8192] <= 8 * 1.1 * blk[1024], blk
  assert ref[8192] >= 32 * ref[1024], ref  # [B, H, T, T] scores: 64x for 8x the tokens
  assert ref[8192] >= 20 * blk[8192], (ref, blk)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", ["left_padding", "per_row_slots", "shared_slot"])
def test_one_query_matches_reference(case, dtype):
  """A decode step's attention (one query per row, three query heads per KV head):
  one_query's values are the reference's, in float32 and in bfloat16."""
  B, S, H, KV, Dh = 3, 29, 6, 2, 16
  q, k, v = (x.astype(dtype) for x in _qkv(B, 1, S, H, KV, Dh, seed=3))
  valid = np.ones((B, S), bool)
  valid[1, :9] = False
  slot = np.full((1, 1), S - 1) if case == "shared_slot" else np.asarray([[S - 1], [20], [0]])
  if case == "left_padding":
    valid[2, :S - 1] = False  # a row whose only key is its own
    slot = np.full((B, 1), S - 1)
  valid, slot = jnp.asarray(valid), jnp.asarray(slot, jnp.int32)
  got = jax.jit(attention.one_query)(q, k, v, valid, slot)
  want = jax.jit(attention.reference)(q, k, v, valid, slot)
  assert got.dtype == want.dtype == jnp.dtype(dtype)
  tol = 1e-6 if dtype == "float32" else 1e-2
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                             atol=tol, rtol=tol)


def test_auto_decodes_with_one_query_on_cpu_and_its_scores_are_not_a_dot(monkeypatch):
  """"auto" sends one query per row to one_query (CPU) and longer queries elsewhere; the
  compiled one_query has a single dot (the values'), the reference two."""
  calls = []
  real = attention.one_query
  monkeypatch.setattr(attention, "one_query", lambda *a: calls.append(a[0].shape) or real(*a))
  q, k, v = _qkv(2, 1, 24, 6, 2, 16)
  valid, slot = jnp.ones((2, 24), bool), jnp.full((1, 1), 23, jnp.int32)
  attention.attention(q, k, v, valid, slot)
  q2, k2, v2 = _qkv(2, 24, 24, 6, 2, 16)
  attention.attention(q2, k2, v2, valid, jnp.arange(24)[None])
  assert calls == [(2, 1, 6, 16)]
  dots = {name: len(dot_operand_types(jax.jit(fn).lower(q, k, v, valid, slot).compile()
                                      .as_text()))
          for name, fn in (("one_query", real), ("reference", attention.reference))}
  assert dots == {"one_query": 1, "reference": 2}


def test_sampler_greedy_tokens_are_the_same_with_blockwise(monkeypatch):
  from hflax.rollout import SamplingParams, generate
  monkeypatch.setattr(attention, "blockwise",
                      functools.partial(attention.blockwise, q_block=4, k_block=8))
  rs = np.random.RandomState(6)
  prompts = [rs.randint(1, CFG.vocab_size, size=n).tolist() for n in (5, 11, 2, 8)]
  params = SamplingParams(max_new_tokens=12, temperature=0)
  out = {impl: generate(*create(CFG.replace(attention=impl)), prompts, params)
         for impl in ("reference", "blockwise")}
  np.testing.assert_array_equal(out["blockwise"]["responses"], out["reference"]["responses"])
  np.testing.assert_allclose(out["blockwise"]["rollout_log_probs"],
                             out["reference"]["rollout_log_probs"], atol=1e-5)


# --- Packed rows: blockwise skips the key blocks of earlier sequences ---

def _packed_segments(lengths_per_row, T):
  """[B, T] segment ids 1, 2, ... laid end to end, then tail padding (id 0)."""
  seg = np.zeros((len(lengths_per_row), T), np.int32)
  for row, lengths in zip(seg, lengths_per_row):
    row[:sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
  return seg


def test_key_block_bounds_of_a_hand_built_packed_batch():
  slot = jnp.arange(16)[None]
  a = _packed_segments([[2, 2, 6, 3, 1]], 16)  # 1 1 2 2 | 3 3 3 3 | 3 3 4 4 | 4 5 0 0
  b = _packed_segments([[6, 6, 4]], 16)  # 1 1 1 1 | 1 1 2 2 | 2 2 2 2 | 3 3 3 3
  bounds = lambda seg, bq: [np.asarray(x) for x in attention.key_block_bounds(  # noqa: E731
      jnp.broadcast_to(slot, seg.shape), jnp.asarray(seg), jnp.asarray(seg), bq, 4)]
  np.testing.assert_array_equal(bounds(a, 4), [[0, 1, 1, 2], [1, 2, 3, 4]])
  np.testing.assert_array_equal(bounds(b, 4), [[0, 0, 1, 3], [1, 2, 3, 4]])
  # The batch's rows share one bound: the earliest.
  np.testing.assert_array_equal(bounds(np.concatenate([a, b]), 4), [[0, 0, 1, 2], [1, 2, 3, 4]])
  # Smaller query blocks; the last holds only pads: no key block at all.
  np.testing.assert_array_equal(bounds(a, 2), [[0, 0, 1, 1, 1, 2, 2, 4],
                                               [1, 1, 2, 2, 3, 3, 4, 4]])
  # One segment per row (what blockwise passes without segment ids): causality alone.
  np.testing.assert_array_equal(bounds(np.ones((1, 16), np.int32), 4), [[0] * 4, [1, 2, 3, 4]])


def _count_score_blocks(monkeypatch) -> list:
  """A list that grows by one for each score block blockwise attention computes."""
  computed = []
  scores = attention._scores

  def counted(*args):
    jax.debug.callback(lambda: computed.append(1))
    return scores(*args)

  monkeypatch.setattr(attention, "_scores", counted)
  return computed


def test_blockwise_computes_only_the_score_blocks_within_the_bounds(monkeypatch):
  seg = _packed_segments([[2, 2, 6, 3, 1]], 16)  # above: lo [0, 1, 1, 2], hi [1, 2, 3, 4]
  computed = _count_score_blocks(monkeypatch)
  q, k, v = _qkv(1, 16, 16, 2, 1, 4)
  seg_ids = jnp.asarray(seg)

  def loss(q, k, v):
    out = attention.blockwise(q, k, v, jnp.asarray(seg > 0), jnp.arange(16)[None],
                              seg_ids, seg_ids, q_block=4, k_block=4)
    return jnp.sum(out ** 2)

  jax.block_until_ready(jax.jit(jax.grad(loss, (0, 1, 2)))(q, k, v))
  jax.effects_barrier()
  # 1 + 1 + 2 + 2 blocks forward and again backward; causality alone would leave 1+2+3+4.
  assert len(computed) == 2 * 6


@pytest.mark.parametrize("q_block,k_block", [(8, 16), (16, 8), (5, 7)])
def test_blockwise_matches_reference_on_packed_rows(q_block, k_block):
  """Many unequal sequences per row, shorter than a block or spanning several, starting
  mid-block, with tail padding; two rows of different layouts; GQA."""
  B, T, H, KV, Dh = 2, 100, 6, 2, 8
  seg = _packed_segments([[3, 20, 1, 37, 9, 14, 6], [50, 2, 2, 30, 11]], T)
  q, k, v = _qkv(B, T, T, H, KV, Dh, seed=7)
  real = seg > 0
  rows = jnp.asarray(real)[:, :, None, None]
  w = jnp.asarray(np.random.RandomState(8).randn(B, T, H, Dh), jnp.float32)
  seg_ids, slot = jnp.asarray(seg), jnp.arange(T)[None]

  def loss(impl, keep, q, k, v):
    out = impl(q, k, v, jnp.asarray(real), slot, seg_ids, seg_ids)
    return jnp.sum(jnp.where(keep, out, 0) * w), out

  blk = functools.partial(attention.blockwise, q_block=q_block, k_block=k_block)
  (_, want), grads_want = _jit_value_and_grad(functools.partial(loss, attention.reference,
                                                                rows))(q, k, v)
  # Blockwise pads output a constant 0, so weighting them too changes no gradient.
  (_, got), grads_got = _jit_value_and_grad(functools.partial(loss, blk, True))(q, k, v)
  assert np.isfinite(np.asarray(got)).all()
  assert not np.asarray(got)[~real].any()  # pads see nothing
  np.testing.assert_allclose(np.where(rows, got, 0), np.where(rows, want, 0), atol=2e-6)
  for g, want_g in zip(grads_got, grads_want):
    np.testing.assert_allclose(g, want_g, atol=1e-5)


# --- Shared prompts: responses also see their prompt's segment (prefix ids) ---

def _shared_rows(rows, T):
  """Packed rows of units: an int is an unshared sequence of that length; (p, [r1, ...])
  a prompt of p tokens packed once, then its responses. Returns segment ids, prefix ids
  and the [B, T, T] visibility written out unit by unit (what each token may attend to)."""
  B = len(rows)
  seg, prefix = np.zeros((B, T), np.int32), np.zeros((B, T), np.int32)
  seen = np.zeros((B, T, T), bool)
  for b, units in enumerate(rows):
    at, k = 0, 0
    for unit in units:
      prompt, responses = (unit, []) if isinstance(unit, int) else unit
      k += 1
      p0 = at
      seg[b, at:at + prompt], prefix[b, at:at + prompt] = k, k
      for t in range(at, at + prompt):
        seen[b, t, p0:t + 1] = True
      at += prompt
      for n in responses:
        k += 1
        seg[b, at:at + n], prefix[b, at:at + n] = k, seg[b, p0]
        for t in range(at, at + n):
          seen[b, t, p0:p0 + prompt] = True
          seen[b, t, at:t + 1] = True
        at += n
  return seg, prefix, seen


def _dense(q, k, v, seen_BxTxS):
  """Attention under an explicit boolean mask, fp32, a query seeing nothing outputs 0."""
  B, T, H, Dh = q.shape
  G = H // k.shape[1]
  k_BxSxHxDh = jnp.repeat(k.transpose(0, 3, 1, 2), G, axis=2)
  v_BxSxHxDh = jnp.repeat(v.transpose(0, 2, 1, 3), G, axis=2)
  s = jnp.einsum("bthd,bshd->bhts", q, k_BxSxHxDh) * Dh ** -0.5
  mask = jnp.asarray(seen_BxTxS)[:, None]
  p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
  p = jnp.where(mask.any(-1, keepdims=True), p, 0)
  return jnp.einsum("bhts,bshd->bthd", p, v_BxSxHxDh)


SHARED_ROWS = [[(9, [5, 0, 14, 3]), 6, (4, [2, 7]), 1, (3, [11])],
               [11, (13, [1, 20, 4, 6]), (5, [5]), 2]]


@pytest.mark.parametrize("impl", ["reference", "blockwise_8x16", "blockwise_16x8",
                                  "blockwise_5x7", "auto"])
def test_prefix_ids_match_a_dense_mask_in_values_and_gradients(impl):
  B, T, H, KV, Dh = 2, 100, 6, 2, 8  # GQA, tail padding, responses of 0 and 1 tokens
  seg, prefix, seen = _shared_rows(SHARED_ROWS, T)
  q, k, v = _qkv(B, T, T, H, KV, Dh, seed=3)
  real = jnp.asarray(seg > 0)[:, :, None, None]
  w = jnp.asarray(np.random.RandomState(4).randn(B, T, H, Dh), jnp.float32)
  fns = {"reference": attention.reference, "auto": attention.attention}
  for qb, kb in ((8, 16), (16, 8), (5, 7)):
    fns[f"blockwise_{qb}x{kb}"] = functools.partial(attention.blockwise, q_block=qb, k_block=kb)
  args = (jnp.asarray(seg > 0), jnp.arange(T)[None], jnp.asarray(seg), jnp.asarray(seg),
          jnp.asarray(prefix))

  def loss(out):
    return jnp.sum(jnp.where(real, out, 0) * w)

  want, grads_want = _jit_value_and_grad(lambda q, k, v: loss(_dense(q, k, v, seen)),
                                         has_aux=False)(q, k, v)
  got, grads_got = _jit_value_and_grad(lambda q, k, v: loss(fns[impl](q, k, v, *args)),
                                       has_aux=False)(q, k, v)
  out = jax.jit(fns[impl])(q, k, v, *args)
  assert np.isfinite(np.asarray(out)).all()
  np.testing.assert_allclose(np.where(real, out, 0), np.where(real, _dense(q, k, v, seen), 0),
                             atol=2e-6)
  np.testing.assert_allclose(got, want, rtol=1e-5)
  for g, want_g in zip(grads_got, grads_want):
    np.testing.assert_allclose(g, want_g, atol=1e-5)
  # Without prefix ids every response sees only itself: a different result.
  alone = jax.jit(fns[impl])(q, k, v, *args[:4])
  assert np.abs(np.where(real, alone - out, 0)).max() > 1e-2


def test_key_block_bounds_reach_back_to_the_shared_prompt():
  seg, prefix, _ = _shared_rows([[3, (5, [2, 6])]], 16)
  # seg 1 1 1 2 | 2 2 2 2 | 3 3 4 4 | 4 4 4 4 ; prefix 1 1 1 2 | 2 2 2 2 | 2 2 2 2 | 2 2 2 2
  np.testing.assert_array_equal(seg[0], [1, 1, 1, 2, 2, 2, 2, 2, 3, 3, 4, 4, 4, 4, 4, 4])
  slot = jnp.arange(16)[None]
  bounds = lambda *ids: [np.asarray(x) for x in attention.key_block_bounds(  # noqa: E731
      slot, jnp.asarray(seg), jnp.asarray(seg), 4, 4, *ids)]
  # Responses of segments 3 and 4 reach back to their prompt (segment 2, from key block 0).
  np.testing.assert_array_equal(bounds(jnp.asarray(prefix)), [[0, 0, 0, 0], [1, 2, 3, 4]])
  np.testing.assert_array_equal(bounds(), [[0, 0, 2, 2], [1, 2, 3, 4]])


def test_blockwise_skips_the_other_responses_between_a_response_and_its_prompt(monkeypatch):
  """A 4-token prompt shared by three 4-token responses, 4 x 4 blocks: the bounds leave
  query block i the key blocks 0..i; it needs only its prompt's block and its own."""
  seg, prefix, seen = _shared_rows([[(4, [4, 4, 4])]], 16)
  np.testing.assert_array_equal(seg[0], np.repeat([1, 2, 3, 4], 4))
  args = (jnp.arange(16)[None], jnp.asarray(seg), jnp.asarray(seg), 4, 4, jnp.asarray(prefix))
  lo, hi = attention.key_block_bounds(*args)
  np.testing.assert_array_equal([lo, hi], [[0, 0, 0, 0], [1, 2, 3, 4]])
  np.testing.assert_array_equal(attention.key_blocks_taken(*args),
                                [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 0, 1]])
  # Without prefix ids each response sees only itself.
  np.testing.assert_array_equal(attention.key_blocks_taken(*args[:5]), np.eye(4, dtype=bool))
  computed = _count_score_blocks(monkeypatch)
  q, k, v = _qkv(1, 16, 16, 2, 1, 4, seed=5)
  blk = functools.partial(attention.blockwise, q_block=4, k_block=4)
  ids = (jnp.asarray(seg > 0), jnp.arange(16)[None], jnp.asarray(seg), jnp.asarray(seg),
         jnp.asarray(prefix))
  loss = lambda f: lambda q, k, v: jnp.sum(f(q, k, v) ** 2)  # noqa: E731
  got = _jit_value_and_grad(loss(lambda q, k, v: blk(q, k, v, *ids)), has_aux=False)(q, k, v)
  jax.effects_barrier()
  assert len(computed) == 2 * 7  # forward and backward, against 2 * 10 within the bounds
  want = _jit_value_and_grad(loss(lambda q, k, v: _dense(q, k, v, seen)), has_aux=False)(
      q, k, v)
  np.testing.assert_allclose(got[0], want[0], rtol=1e-5)
  for g, want_g in zip(got[1], want[1]):
    np.testing.assert_allclose(g, want_g, atol=1e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_one_column_cache_writes_equal_a_dynamic_update_slice(dtype):
  """_write_slots' select over a bf16 cache's bits writes exactly what a
  dynamic-update-slice does, for one slot shared by all rows and for one slot per row."""
  from hflax.models.transformer import _write_slots
  cache = jax.random.normal(jax.random.key(0), (3, 2, 4, 9)).astype(dtype)
  new = jax.random.normal(jax.random.key(1), (3, 2, 4, 1))
  for slot0 in (jnp.int32(5), jnp.array([0, 8, 3], jnp.int32)):
    got = jax.jit(lambda c, n, s: _write_slots(c, n, s, axis=3))(cache, new, slot0)
    slots = np.broadcast_to(np.asarray(slot0), (3,))
    want = np.asarray(cache).copy()
    for b, s in enumerate(slots):
      want[b, :, :, s] = np.asarray(new.astype(dtype))[b, :, :, 0]
    assert got.dtype == cache.dtype
    np.testing.assert_array_equal(np.asarray(got), want)


def test_longest_segment_ignores_padding():
  seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [0, 1, 1, 1, 1, 2, 2, 0]])
  assert int(attention.longest_segment(seg)) == 4
  assert int(attention.longest_segment(jnp.zeros((2, 5), jnp.int32))) == 0


def test_packed_rows_of_short_sequences_take_the_narrow_key_blocks(monkeypatch):
  # blockwise(short_k_block=...) picks the key block at run time from the longest packed
  # sequence: narrow where all are short (prompt-sharing GRPO rows), wide for long ones.
  seg = _packed_segments([[2, 2, 6, 3, 1]], 16)  # the longest sequence: 6 slots
  q, k, v = (x.astype(jnp.bfloat16) for x in _qkv(1, 16, 16, 2, 1, 4))  # 16-bit only
  seg_ids = jnp.asarray(seg)
  masks = (jnp.asarray(seg > 0), jnp.arange(16)[None], seg_ids, seg_ids)
  real = masks[0][:, :, None, None]  # pads see no key: blockwise gives 0, the reference not
  computed = _count_score_blocks(monkeypatch)

  def run(**blocks):
    def loss(q, k, v):
      return jnp.sum(real * attention.blockwise(q, k, v, *masks, **blocks) ** 2)
    before = len(computed)
    # One compiled program a run (eager dispatch compiles each op and scan body apart);
    # a fresh jit each time, since SHORT_SEGMENT_KEYS is read when it is traced.
    value, grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(q, k, v)
    jax.effects_barrier()
    return len(computed) - before, value, grads

  narrow, wide = run(q_block=4, k_block=4), run(q_block=4, k_block=8)
  assert narrow[0] != wide[0]
  for limit, want in ((6, narrow), (5, wide)):
    monkeypatch.setattr(attention, "SHORT_SEGMENT_KEYS", limit)
    got = run(q_block=4, k_block=8, short_k_block=4)
    assert got[0] == want[0]
    f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
    np.testing.assert_allclose(f32(got[1]), f32(want[1]), rtol=1e-6)
    for g, w in zip(got[2], want[2]):
      np.testing.assert_allclose(f32(g), f32(w), rtol=1e-5, atol=1e-6)
  ref = jax.jit(jax.grad(lambda q, k, v: jnp.sum(real * attention.reference(q, k, v, *masks)
                                                 ** 2), (0, 1, 2)))(q, k, v)
  for g, r in zip(narrow[2], ref):
    err = np.abs(f32(g) - f32(r)).max()
    assert err <= 0.02 * np.abs(f32(r)).max(), err
  # float32 keeps the wide blocks whatever the sequences.
  monkeypatch.setattr(attention, "SHORT_SEGMENT_KEYS", 6)
  q, k, v = _qkv(1, 16, 16, 2, 1, 4)
  assert run(q_block=4, k_block=8, short_k_block=4)[0] == wide[0]
