"""The decoding copy of a model: kernels stored [out, in] in their compute dtype."""
import importlib.util
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hflax.platforms.cpu import attention as cpu_attention
from hflax.platforms.cpu import matmul as cpu_matmul
from hflax.models import ModelConfig, create, hf
from hflax.platforms.cpu.copy_modules import CopyDense
from hflax.platforms.cpu.decoding_copy import (available_memory, build_leaves, decoding_plan,
                                         for_decoding)
from hflax.models.lora import lora_config
from hflax.models.matmul import LOW_LEFT_MIN_ROWS
from hflax.models.tokenizer import load_tokenizer
from hflax.models.transformer import Dense, create_abstract
from hflax.rollout import SamplingParams, generate, left_pad
from hflax.rollout.sampler import _generate, generate_over_rows, placed, replicate
from hflax.sharding.hybrid_engine import HybridEngine
from hflax.sharding.layouts import (GENERATE_AXES, GENERATE_RULES, TRAIN_RULES, state_shardings,
                                    train_mesh)

# Non-square kernels, so that a kernel laid back out [in, out] shows in the program.
CFG = dict(vocab_size=64, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=4,
           num_kv_heads=2)


@pytest.fixture
def xla_matmuls(monkeypatch):
  """The [out, in] copy XLA's library multiplies, where a bfloat16 copy would otherwise
  be packed for cpu_matmul (tests/test_platforms_cpu_matmul.py)."""
  monkeypatch.setenv(cpu_matmul.ENV, "0")


def _model(dtype="float32", **changes):
  return create(ModelConfig(**CFG, dtype=dtype, param_dtype="float32", **changes), seed=3)


def _dense(graphdef, state):
  return [m for _, m in nnx.iter_modules(nnx.merge(graphdef, state)) if isinstance(m, Dense)]


def _fused(layer_old, dtype):
  """What a layer's stacked gate/up and grouped q/k/v kernels must hold, from the
  training layout: [mlp, 2, embed] and [kv_heads, (G + 2) * head_dim, embed]."""
  t = lambda dense: np.asarray(dense.kernel[...].astype(dtype)).T  # noqa: E731
  mlp, attn = layer_old.mlp, layer_old.attn
  pair = np.stack([t(mlp.gate), t(mlp.up)], axis=1)
  KV = CFG["num_kv_heads"]
  qkv = np.concatenate([t(d).reshape(KV, -1, CFG["hidden_size"])
                        for d in (attn.q, attn.k, attn.v)], axis=1)
  return pair, qkv


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_kernels_are_stored_out_in_in_the_compute_dtype(dtype, xla_matmuls):
  graphdef, state = _model(dtype)
  copy = for_decoding(graphdef, state)
  old, new = nnx.merge(graphdef, state), nnx.merge(*copy)
  # o and down a layer and the untied LM head stay Dense, stored [out, in].
  pairs = [(a, b) for layer_old, layer_new in zip(old.layers, new.layers)
           for a, b in ((layer_old.attn.o, layer_new.attn.o),
                        (layer_old.mlp.down, layer_new.mlp.down))] + [(old.lm_head, new.lm_head)]
  assert len(_dense(*copy)) == len(pairs) == 2 * 2 + 1
  for before, after in pairs:
    assert isinstance(after, CopyDense) and not isinstance(before, CopyDense)
    assert after.kernel[...].dtype == jnp.dtype(dtype)
    assert after.kernel.axes == before.kernel.axes[::-1]
    np.testing.assert_array_equal(np.asarray(after.kernel[...]),
                                  np.asarray(before.kernel[...].T.astype(dtype)))
  # gate and up stacked, q, k and v grouped: one kernel each, made once in the copy.
  for layer_old, layer_new in zip(old.layers, new.layers):
    assert layer_new.mlp.gate is None and layer_new.attn.q is None
    pair, qkv = _fused(layer_old, dtype)
    assert layer_new.mlp.pair[...].dtype == layer_new.attn.qkv[...].dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(layer_new.mlp.pair[...]), pair)
    np.testing.assert_array_equal(np.asarray(layer_new.attn.qkv[...]), qkv)
  # Everything else is the same array, not a copy.
  assert copy[1]["embed"][...] is state["embed"][...]
  # A decoding copy is left as it is.
  again = for_decoding(*copy)
  assert again[0] is copy[0] and again[1] is copy[1]


@pytest.mark.parametrize("dtype, tol", [("float32", 1e-6), ("bfloat16", 2e-2)])
def test_the_copy_computes_what_the_model_does(dtype, tol):
  graphdef, state = _model(dtype)
  tokens = jax.random.randint(jax.random.key(0), (3, 9), 0, 64)
  positions = jnp.broadcast_to(jnp.arange(9), (3, 9))
  valid = jnp.ones((3, 9), bool)

  def logits(graphdef, state):
    model = nnx.merge(graphdef, state)
    return model.logits(model(tokens, positions, valid)[0])

  want, got = logits(graphdef, state), logits(*for_decoding(graphdef, state))
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=tol, atol=tol)


def test_the_last_copy_is_reused_while_its_weights_live(monkeypatch):
  import gc
  import weakref

  import hflax.platforms.cpu.decoding_copy as decode_layout
  graphdef, state = _model()
  copies = []
  monkeypatch.setattr(decode_layout, "_build_leaves",
                      lambda *a: copies.append(1) or decode_layout.build_leaves(*a))
  first = for_decoding(graphdef, state)
  again = for_decoding(graphdef, jax.tree.map(lambda x: x, state))  # the same arrays
  assert again[0] is first[0] and again[1] is first[1] and len(copies) == 1

  # New weights (even of the same shapes) get a copy of their own values.
  changed = jax.tree.map(lambda x: x + 1, state)
  fresh = for_decoding(graphdef, changed)
  assert len(copies) == 2
  o_kernel = nnx.merge(graphdef, changed).layers[0].attn.o.kernel[...]
  np.testing.assert_array_equal(np.asarray(_dense(*fresh)[0].kernel[...]), np.asarray(o_kernel.T))
  assert for_decoding(graphdef, state)[1] is not first[1]  # only the last copy is kept

  # The kept copy goes when the weights it was made from do.
  down = lambda state: state["layers"][0]["mlp"]["down"]["kernel"][...]  # noqa: E731
  kept = weakref.ref(down(for_decoding(graphdef, changed)[1]))
  assert kept() is not None
  del fresh, changed
  gc.collect()
  assert kept() is None

  # A deleted (e.g. donated) source is not read through its old copy.
  for_decoding(graphdef, state)
  down(state).delete()
  with pytest.raises(RuntimeError, match="deleted"):
    for_decoding(graphdef, state)


def test_a_copy_is_kept_for_each_set_of_devices():
  """generate(devices=...) places the weights and bench/generate.py alternates one device
  with two: neither placement may replace the other's copy, nor look like new weights."""
  graphdef, state = _model()
  devices = jax.devices()[:2]
  two = replicate(state, devices)
  leaves = jax.tree.leaves
  same = lambda a, b: all(x is y for x, y in zip(leaves(a), leaves(b)))  # noqa: E731
  assert same(replicate(two, devices), two)
  assert same(placed(state, jax.sharding.SingleDeviceSharding(jax.devices()[0])), state)
  one_copy, two_copy = for_decoding(graphdef, state)[1], for_decoding(graphdef, two)[1]
  assert for_decoding(graphdef, state)[1] is one_copy
  assert for_decoding(graphdef, two)[1] is two_copy
  prompts = [[5, 6, 7], [9] * 5]
  params = SamplingParams(max_new_tokens=4, temperature=0)
  want = generate(graphdef, state, prompts, params)
  got = generate(graphdef, two, prompts, params, devices=devices)
  np.testing.assert_array_equal(np.asarray(got["responses"]), np.asarray(want["responses"]))


def test_adapted_kernels_stay_as_they_are():
  cfg = lora_config(ModelConfig(**CFG), 4, 8.0, "q_proj,down_proj")
  graphdef, state = create(cfg, seed=3)
  copy = for_decoding(graphdef, state)
  kept = [m.lora_a is not None for m in _dense(*copy)]
  assert sum(kept) == 4 and not all(kept)
  for m in _dense(*copy):
    assert isinstance(m, CopyDense) == (m.lora_a is None)
  tokens = jnp.arange(12).reshape(2, 6)
  run = lambda g, s: nnx.merge(g, s)(tokens, jnp.broadcast_to(jnp.arange(6), (2, 6)),  # noqa: E731
                                     jnp.ones((2, 6), bool))[0]
  np.testing.assert_allclose(np.asarray(run(*copy)), np.asarray(run(graphdef, state)),
                             rtol=1e-6, atol=1e-6)


def _kernel_reads(graphdef, state):
  """(shape, contracting dimension) of both operands of every dot in the program that
  generates 8 greedy tokens for four prompts (a kernel is either operand: a decode step
  puts some on the left, matmul.rows_by_kernel). Four prompts of an 8-wide bucket make 32
  prefill rows and 4 decode rows, so no activation has a test kernel's shape."""
  tokens, mask = (jnp.asarray(x) for x in left_pad([[5, 6, 7], [9] * 5, [4], [8, 2]], 0))
  return _dot_reads(_generate.lower(graphdef, state, tokens, mask, jax.random.key(0),
                                    params=SamplingParams(max_new_tokens=8, temperature=0)))


def _dot_reads(lowered):
  """(shape, contracting dimension, side) of both operands of every dot of a program, and
  (shape, "1", target) of the kernel each cpu_matmul custom call reads."""
  text = lowered.compile().as_text()
  shapes = dict(re.findall(r"%([\w.\-]+) = \w+\[([\d,]*)\]", text))
  reads = []
  for lhs, rhs, lhs_dims, rhs_dims in re.findall(
      r" dot\(%([\w.\-]+), %([\w.\-]+)\),.*?lhs_contracting_dims=\{(\d+)\}"
      r".*?rhs_contracting_dims=\{(\d+)\}", text):
    reads += [(shapes[lhs], lhs_dims, "left"), (shapes[rhs], rhs_dims, "right")]
  for kernel, target in re.findall(r'custom-call\(%[\w.\-]+, %([\w.\-]+)\).*?'
                                   r'custom_call_target="(hflax_cpu_matmul\w*)"', text):
    reads.append((shapes[kernel], "1", target))
  return reads


@pytest.mark.parametrize("dtype,tied", [("float32", False), ("bfloat16", False),
                                        ("float32", True)])
def test_the_decode_program_reads_the_kernels_as_stored(dtype, tied, xla_matmuls):
  """XLA must not lay the kernels back out [in, out]: it did, in a copy hoisted out of the
  decode loop, for matmuls of [B, 1, D] activations, and the layout's gain was lost. The
  head is the copy's untied kernel or, tied, the embedding table (both [vocab, embed])."""
  graphdef, state = for_decoding(*_model(dtype, tie_word_embeddings=tied))
  # Kernels [out, in]: o, gate and up stacked, down, head, and q, k and v concatenated per
  # KV group (2 groups x (2 + 2) x 12), read as 2-D.
  kernels = {"48,48", "160,48", "48,80", "64,48", "96,48"}
  reads = [read for read in _kernel_reads(graphdef, state) if read[0] in kernels]
  assert {shape for shape, _, _ in reads} == kernels
  # Contracting dimension 0 would be a kernel laid back out [in, out].
  assert all(dims == "1" for _, dims, _ in reads), reads
  # A few float32 rows (32 in the prefill, 4 a decode step): o, down and the gate/up pair
  # are the left operands (matmul.rows_by_kernel, CopyMLP._columns), and so is the head (its
  # 4 rows a step, matmul.step_logits); q/k/v stay on the right. bfloat16 puts o, down and
  # the pair on the left from LOW_LEFT_MIN_ROWS rows (the prefill's 32), not for the decode
  # steps' 4 rows; its head stays on the right for them.
  assert LOW_LEFT_MIN_ROWS <= 32
  sides = {}
  for shape, _, side in reads:
    sides.setdefault(shape, set()).add(side)
  o_down_pair = {"48,48", "48,80", "160,48"}
  if dtype == "float32":
    want = {shape: {"left"} for shape in o_down_pair | {"64,48"}}
  else:
    want = {shape: {"left", "right"} for shape in o_down_pair} | {"64,48": {"right"}}
  assert sides == want | {"96,48": {"right"}}, reads


@pytest.mark.parametrize("dtype,packed", [("float32", False), ("bfloat16", False),
                                          ("bfloat16", True), ("float32", True)])
def test_the_generation_benchs_matmul_floor_reads_the_kernels_as_the_sampler_does(
    dtype, packed, monkeypatch):
  """bench/generate.py times the sampler's weight matmuls alone (make_weight_matmuls) as
  the least a call could take: its program must read every kernel with the shape,
  contracting dimension and side the sampler's does, or through the same cpu_matmul call
  (packed), at a prefill's rows (4 x 8) and a decode step's (4 x 1), or it would time
  other matmuls."""
  if packed and cpu_matmul.problem(jnp.bfloat16):
    pytest.skip(f"cpu_matmul: {cpu_matmul.problem(jnp.bfloat16)}")
  if not packed:
    monkeypatch.setenv(cpu_matmul.ENV, "0")
  monkeypatch.setattr(cpu_matmul, "cores", lambda: 1)  # packed wherever it applies
  path = os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench", "generate.py")
  spec = importlib.util.spec_from_file_location("bench_generate", path)
  bench = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(bench)
  graphdef, state = for_decoding(*_model(dtype))
  kernels = {"48,48", "160,48", "48,80", "64,48", "96,48"}
  sampler = {read for read in _kernel_reads(graphdef, state) if read[0] in kernels}
  run = bench.make_weight_matmuls(graphdef)
  floor = set()
  for shape in ((4, 8, 48), (4, 1, 48)):
    floor |= {read for read in _dot_reads(run.lower(state, jnp.zeros(shape, dtype), 1))
              if read[0] in kernels}
  assert floor == sampler
  assert {shape for shape, _, side in sampler if side.startswith("hflax_cpu")} == (
      kernels if packed else set())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_copys_mlp_with_kernels_on_the_left_computes_the_plain_products(dtype, xla_matmuls):
  """A decoding copy's MLP for LOW_LEFT_MIN_ROWS rows or more on CPU (both kernels on the
  left, CopyMLP._columns) computes down(swiglu(gate, up)) with the plain order's roundings:
  gate, up and the output rounded to the compute dtype once, from float32 sums."""
  from hflax.models.transformer import swiglu
  graphdef, state = for_decoding(*_model(dtype))
  mlp = nnx.merge(graphdef, state).layers[0].mlp
  rows = max(LOW_LEFT_MIN_ROWS, 8)
  x = jax.random.normal(jax.random.key(5), (rows, 1, CFG["hidden_size"])).astype(dtype)
  got = jax.jit(lambda x: mlp(x))(x)
  assert got.dtype == jnp.dtype(dtype) and got.shape == x.shape
  wide = lambda a, b: jnp.einsum("...i,oi->...o", a.astype(jnp.float32),  # noqa: E731
                                 b.astype(jnp.float32), precision="highest")
  F = CFG["intermediate_size"]
  pair = wide(x, mlp.pair[...].reshape(2 * F, -1)).astype(dtype).reshape(rows, 1, F, 2)
  want = wide(swiglu(pair[..., 0], pair[..., 1]), mlp.down.kernel[...]).astype(dtype)
  # float32 sums in another order: one unit of the last place at most.
  tol = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=2 ** -7, atol=1e-3)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), **tol)
  if dtype == "bfloat16":  # most entries bit-equal: no transposed or misplaced operand
    assert np.mean(np.asarray(got, np.float32) == np.asarray(want, np.float32)) > 0.9


@pytest.mark.parametrize("changes", [{}, {"qkv_bias": True, "qk_norm": True}])
def test_the_copy_projects_q_k_v_in_one_matmul(changes):
  """The copy's prefill and decode steps compute q, k and v as one product per layer
  (biases grouped alike), and generate what the model's three products do."""
  graphdef, state = _model(**changes)
  copy = for_decoding(graphdef, state)
  prompts = [[5, 6, 7], [9] * 5, [4]]
  params = SamplingParams(max_new_tokens=8, temperature=0)
  want = generate(graphdef, jax.tree.map(np.asarray, state), prompts, params)  # no copy
  got = generate(*copy, prompts, params)
  np.testing.assert_array_equal(np.asarray(got["responses"]), np.asarray(want["responses"]))
  np.testing.assert_allclose(np.asarray(got["rollout_log_probs"]),
                             np.asarray(want["rollout_log_probs"]), rtol=1e-5, atol=1e-5)
  projections = sorted(shape for shape, _, _ in _kernel_reads(*copy)
                       if shape in ("24,48", "48,48", "96,48"))
  # Prefill and each decode step: qkv and o (2 layers); no lone q, k or v.
  assert projections == ["48,48"] * 4 + ["96,48"] * 4


def test_no_copy_where_it_would_not_fit_in_memory(monkeypatch, caplog):
  import hflax.platforms.cpu.decoding_copy as decode_layout
  graphdef, state = _model("bfloat16")
  kernel_bytes = sum(m.kernel[...].size * 2 for m in _dense(graphdef, state))
  monkeypatch.setattr(decode_layout, "available_memory", lambda: 2 * kernel_bytes + 2)
  assert for_decoding(graphdef, state)[0] is not graphdef  # fits: half is enough
  decode_layout.forget_decoding_copy()  # else the copy written above is reused
  monkeypatch.setattr(decode_layout, "available_memory", lambda: 2 * kernel_bytes - 2)
  with caplog.at_level("WARNING"):
    copy = for_decoding(graphdef, state)
  assert copy[0] is graphdef and copy[1] is state
  assert "would take over half of the available memory" in caplog.text


def test_the_copy_counts_a_replica_on_each_device(monkeypatch):
  import hflax.platforms.cpu.decoding_copy as decode_layout
  graphdef, state = _model("bfloat16")
  one = sum(m.kernel[...].size * 2 for m in _dense(graphdef, state))
  replicated = jax.device_put(state, NamedSharding(Mesh(np.array(jax.devices()[:2]), ("data",)),
                                                   PartitionSpec()))
  monkeypatch.setattr(decode_layout, "available_memory", lambda: 3 * one)  # half: 1.5 copies
  assert for_decoding(graphdef, state)[0] is not graphdef
  assert for_decoding(graphdef, replicated)[0] is graphdef


def test_states_it_does_not_apply_to_pass_through():
  graphdef, state = _model()
  on_host = jax.tree.map(np.asarray, state)  # NumPy leaves: generate takes them as they are
  assert for_decoding(graphdef, on_host)[1] is on_host
  out = generate(graphdef, on_host, [[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=0))
  want = generate(graphdef, state, [[5, 6, 7]], SamplingParams(max_new_tokens=3, temperature=0))
  np.testing.assert_array_equal(np.asarray(out["responses"]), np.asarray(want["responses"]))
  assert available_memory() > 0


def test_tensor_parallel_decoding_gathers_no_kernel():
  """The copy keeps each device's share of a tensor-parallel split: stacking gate and up
  in front made XLA gather the whole pair on every device, once a layer."""
  graphdef, state = _model()
  mesh = Mesh(np.array(jax.devices()[:2]).reshape(1, 2), GENERATE_AXES)
  state = jax.device_put(state, state_shardings(state, mesh, GENERATE_RULES))
  tokens, mask = (jnp.asarray(x) for x in left_pad([[5, 6, 7], [9] * 5], 0))
  params = SamplingParams(max_new_tokens=8, temperature=0)

  def gathers(graphdef, state):
    text = _generate.lower(graphdef, state, tokens, mask, jax.random.key(0), params=params,
                           mesh=mesh).compile().as_text()
    return len(re.findall(r" all-gather(-start)?\(", text))

  copy = for_decoding(graphdef, state)
  assert copy[0] is not graphdef
  assert gathers(*copy) <= gathers(graphdef, state)
  want = _generate(graphdef, state, tokens, mask, jax.random.key(0), params=params, mesh=mesh)
  got = _generate(*copy, tokens, mask, jax.random.key(0), params=params, mesh=mesh)
  np.testing.assert_array_equal(np.asarray(got["responses"]), np.asarray(want["responses"]))


@pytest.mark.parametrize("dtype, generate_dtype",
                         [("float32", None), ("bfloat16", None), ("float32", "bfloat16")])
def test_the_hybrid_engine_writes_the_decoding_copy(dtype, generate_dtype):
  """Given the graphdef, the actor's generation copy is the decoding copy itself, written
  in the training layout with the cast and resharded as the kernels it stands for: the
  sampler then makes no second copy, and the same bytes cross devices."""
  graphdef, state = _model(dtype)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  mesh = train_mesh(jax.devices()[:4], fsdp=4)
  train = state_shardings(abstract, mesh, TRAIN_RULES)
  engine = HybridEngine(mesh, abstract, train, 2, dtype=generate_dtype, graphdef=graphdef)
  plain = HybridEngine(mesh, abstract, train, 2, dtype=generate_dtype)
  if dtype == generate_dtype or dtype == "float32":
    assert engine.moved["total"] == plain.moved["total"] > 0
  else:  # float32 weights computing in bfloat16: the copy's kernels cross as bfloat16
    assert 0 < engine.moved["total"] < plain.moved["total"]
  weights = jax.device_put(state, train)
  gen, _ = engine.to_generate(weights)

  assert for_decoding(engine.graphdef, gen)[1] is gen  # nothing left for the sampler to copy
  cast = jax.tree.map(lambda x: x.astype(generate_dtype or x.dtype), state)
  # Its kernels kept apart (the engine moves leaves one to one), each stacked in the
  # decode step instead.
  plan = decoding_plan(graphdef, cast, fuse=False)
  want_graphdef = plan.graphdef
  want = build_leaves(plan.recipes, jax.tree.leaves(cast))
  assert engine.graphdef == want_graphdef
  for got, ref in zip(jax.tree.leaves(gen), want, strict=True):
    assert got.dtype == ref.dtype
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  # Each kernel is split over the tensor axis as the plain copy's, along its own axis.
  for got, ref in zip(_dense(engine.graphdef, gen), _dense(graphdef, plain.to_generate(weights)[0]),
                      strict=True):
    spec = tuple(ref.kernel[...].sharding.spec) + (None,) * (2 - len(ref.kernel[...].sharding.spec))
    assert got.kernel[...].sharding.spec == PartitionSpec(*spec[::-1])
    assert "tensor" in spec

  tokens, mask = left_pad([[5, 6, 7], [9] * 5, [4], [8, 1]], 0)
  params = SamplingParams(max_new_tokens=8, temperature=0)
  out = generate_over_rows(engine.graphdef, gen, tokens, mask, jax.random.key(0), params,
                           engine.mesh)
  # What the sampler decoded before, writing its copy from the plain generation copy.
  ref = generate_over_rows(graphdef, plain.to_generate(weights)[0], tokens, mask,
                           jax.random.key(0), params, plain.mesh)
  np.testing.assert_array_equal(np.asarray(out["responses"]), np.asarray(ref["responses"]))
  # The two programs stack q/k/v and gate/up in different places (in the step against in
  # the copy): equal on the AVX-512 VMs, one float32 ulp apart (2.4e-7) on an AVX2 Zen 3,
  # where the two programs' dots round differently.
  np.testing.assert_allclose(np.asarray(out["rollout_log_probs"]),
                             np.asarray(ref["rollout_log_probs"]), rtol=0, atol=1e-6)


def test_each_switch_writes_the_plain_copy_where_the_decoding_one_does_not_fit(monkeypatch):
  """The engine decides at every switch, on the memory left then. Training fsdp=2, one
  generation replica on each device: each holds half of the copy's kernels written in
  the training layout, and the whole kernels, one buffer for both, are written anew."""
  import hflax.platforms.cpu.decoding_copy as decode_layout
  graphdef, state = _model("bfloat16")
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  mesh = train_mesh(jax.devices()[:2], fsdp=2)
  train = state_shardings(abstract, mesh, TRAIN_RULES)
  weights = jax.device_put(state, train)
  engine = HybridEngine(mesh, abstract, train, graphdef=graphdef)
  assert engine.graphdef != graphdef  # preferred until a switch finds too little memory
  kernel_bytes = sum(m.kernel[...].size * 2 for m in _dense(graphdef, state))
  for available, decoding in ((4 * kernel_bytes - 2, False), (4 * kernel_bytes + 2, True)):
    monkeypatch.setattr(decode_layout, "available_memory", lambda a=available: a)
    gen, metrics = engine.to_generate(weights)
    assert metrics["reshard/decoding_layout"] == float(decoding)
    assert (engine.graphdef is graphdef) != decoding
    for got, ref in zip(_dense(engine.graphdef, gen), _dense(graphdef, state), strict=True):
      assert isinstance(got, CopyDense) == decoding
      assert got.kernel[...].shape == (ref.kernel[...].T.shape if decoding else ref.kernel[...].shape)


# AVX512-BF16 covers the float32 matmul kernel's AVX-512 too.
SMOLLM2_KERNELS = cpu_matmul.problem(jnp.bfloat16) or cpu_attention.problem(jnp.float32)


@pytest.mark.skipif(SMOLLM2_KERNELS is not None, reason=f"cpu kernels: {SMOLLM2_KERNELS}")
def test_smollm2_greedy_tokens_through_each_kernel(monkeypatch):
  """SmolLM2-135M-Instruct, 24 greedy tokens for four chat prompts, in float32 and bfloat16,
  three ways: both CPU kernels (packed matmuls and decode attention), XLA's attention with
  the packed matmuls, XLA's matmuls with the attention kernel. The packed matmuls give XLA's
  tokens and log-probs (to 1e-4 in float32, 0.05 in bfloat16); float32 through the
  attention kernel gives XLA's (to 1e-4); bfloat16 through it gives the float32 tokens, its
  log-probs no farther from float32's than bfloat16 through XLA's attention. (bfloat16
  through XLA's matmuls may part from float32's tokens at a near tie: see below.)"""
  monkeypatch.setattr(cpu_matmul, "cores", lambda: 1)  # as with one core per device
  tok = load_tokenizer("smollm2-135m-instruct")
  prompts = [tok.encode_chat([{"role": "user", "content": c}]) for c in
             ("What is 23+45?", "Name three colours.", "Write a haiku about rain.", "Hi")]
  params = SamplingParams(max_new_tokens=24, temperature=0, eos_ids=tok.eos_ids,
                          pad_id=tok.pad_id)
  ways = {"kernels": ("1", "1"), "xla_attention": ("1", "0"), "xla_matmuls": ("0", "1")}
  out = {}
  # One load: float32 storage for both compute dtypes, so the weights are the same arrays;
  # only the graphdef (the compute dtype) differs between the two.
  cfg, _, state = hf.load_checkpoint("smollm2-135m-instruct", param_dtype="float32")
  for dtype in ("float32", "bfloat16"):
    graphdef = create_abstract(cfg.replace(dtype=dtype))[0]
    for way, (matmul, attention) in ways.items():
      monkeypatch.setenv(cpu_matmul.ENV, matmul)
      monkeypatch.setenv(cpu_attention.ENV, attention)
      copy = nnx.merge(*for_decoding(graphdef, state))
      assert bool(copy.layers[0].mlp.packed) == (matmul == "1")
      assert bool(copy.layers[0].attn.cpu_attention) == (attention == "1")
      out[dtype, way] = generate(graphdef, state, prompts, params)
  reference = out["float32", "xla_attention"]
  mask = np.asarray(reference["response_mask"], bool)
  assert mask.sum() > 40
  want = np.asarray(reference["responses"])
  for key, run in out.items():
    if key != ("bfloat16", "xla_matmuls"):
      np.testing.assert_array_equal(np.asarray(run["responses"]), want)
  # XLA's own bfloat16 dots round as the CPU's instructions do (AMX, AVX512-BF16 or
  # neither), so its greedy tokens may leave float32's, but only where float32 itself hardly
  # prefers its token (a near tie); the kernel's log-probs are compared with it up to there.
  same = np.cumprod(np.asarray(out["bfloat16", "xla_matmuls"]["responses"]) == want, axis=1)
  ref_logp = np.asarray(reference["rollout_log_probs"])
  for row in np.flatnonzero(~same.all(axis=1)):
    first = int(np.argmin(same[row]))
    assert mask[row, first] and ref_logp[row, first] < np.log(0.5), (row, first)
  logp = {key: np.asarray(run["rollout_log_probs"])[mask] for key, run in out.items()}
  np.testing.assert_allclose(logp["float32", "kernels"], logp["float32", "xla_matmuls"],
                             atol=1e-4)  # matmuls: kernel against XLA
  # In bfloat16 the two round differently (XLA's dots by the CPU's instructions), so the
  # kernel is held to XLA's distance from float32, not to XLA's values.
  agreed = (mask & same.astype(bool))[mask]
  assert agreed.sum() > 40
  far = {way: np.abs(logp["bfloat16", way] - logp["float32", "xla_matmuls"])[agreed]
         for way in ("kernels", "xla_matmuls")}
  assert far["kernels"].mean() <= 1.25 * far["xla_matmuls"].mean()
  assert far["kernels"].max() < 0.3
  error = {key: np.abs(values - logp["float32", "xla_attention"]) for key, values in logp.items()}
  assert error["float32", "kernels"].max() < 1e-4
  # Measured: bfloat16 through the kernel 0.019 mean (0.14 at most), through XLA 0.021 (0.19).
  assert error["bfloat16", "kernels"].mean() <= 1.25 * error["bfloat16", "xla_attention"].mean()
  assert error["bfloat16", "kernels"].max() < 0.3
