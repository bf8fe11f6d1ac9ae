"""cpu_matmul: the AVX512-BF16 kernel for a decoding copy's packed bfloat16 kernels, its
layout, when the copy uses it, and what it computes against float32 references."""
import logging
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hflax.platforms.cpu import matmul as cpu_matmul
from hflax.models import ModelConfig, create
from hflax.platforms.cpu.copy_modules import CopyDense
from hflax.platforms.cpu.decoding_copy import decoding_plan, for_decoding
from hflax.rollout import SamplingParams, left_pad
from hflax.rollout.sampler import _generate

BF16 = jnp.dtype(jnp.bfloat16)
REASON = cpu_matmul.problem(BF16)  # AVX512-BF16 covers the float32 kernel's AVX-512 too
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"cpu_matmul: {REASON}")
DTYPES = pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
CFG = dict(vocab_size=64, hidden_size=48, intermediate_size=80, num_layers=2, num_heads=4,
           num_kv_heads=2)


@pytest.fixture(autouse=True)
def one_core(monkeypatch):
  """As on a host with one core per device, where the copy is packed (cpu_matmul.serves):
  the tests' 8 simulated devices share this machine's cores."""
  monkeypatch.setattr(cpu_matmul, "cores", lambda: 1)


def _model(dtype="bfloat16", **changes):
  return create(ModelConfig(**CFG, dtype=dtype, param_dtype="float32", **changes), seed=3)


def _operands(M, N, K, seed=0, dtype=BF16):
  kx, kw = jax.random.split(jax.random.key(seed))
  x = jax.random.normal(kx, (M, K)).astype(dtype)
  w = jax.random.normal(kw, (N, K)).astype(dtype)
  want = np.asarray(x, np.float64) @ np.asarray(w, np.float64).T
  return x, w, want


def test_pack_is_a_permutation_within_16_row_blocks():
  w = jnp.arange(2 * 32 * 6, dtype=jnp.float32).astype(BF16).reshape(2, 32, 6)
  packed = cpu_matmul.pack(w)
  assert packed.shape == w.shape and packed.dtype == BF16
  np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack(packed)), np.asarray(w))
  # Block 0 of the flattened [64, 6] rows: pairs along K, then the 16 rows of the block.
  flat = np.asarray(w, np.float32).reshape(64, 6)
  block = np.asarray(packed, np.float32).reshape(64 * 6)[:16 * 6].reshape(3, 16, 2)
  np.testing.assert_array_equal(block, flat[:16].reshape(16, 3, 2).transpose(1, 0, 2))
  # Slicing 16-row blocks commutes with packing: the second [32, 6] half is its own pack.
  np.testing.assert_array_equal(np.asarray(packed[1]), np.asarray(cpu_matmul.pack(w[1])))
  assert cpu_matmul.packable((96, 48)) and cpu_matmul.packable((2, 48, 48))
  assert not cpu_matmul.packable((40, 48)) and not cpu_matmul.packable((48, 7))


@needs_kernel
@DTYPES
@pytest.mark.parametrize("M,N,K", [(0, 48, 8), (1, 16, 2), (3, 64, 6), (4, 112, 10),
                                   (6, 80, 576), (7, 32, 64), (8, 48, 48), (13, 80, 576),
                                   (33, 960, 576), (130, 176, 1536)])
def test_the_kernel_computes_the_float32_sums(M, N, K, dtype):
  """Every row-block remainder (M mod 8, no rows at all) and output-group remainder (16,
  32 or 48 outputs last, after full groups of 48 too); float32 sums against float64 ones
  (bfloat16 products are exact in float32)."""
  x, w, want = _operands(M, N, K, dtype=dtype)
  got = np.asarray(jax.jit(cpu_matmul.matmul)(x, cpu_matmul.pack(w)))
  assert got.dtype == np.float32 and got.shape == (M, N)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(initial=1))
  if dtype == "float32":
    return
  rounded = jax.jit(lambda x, w: cpu_matmul.matmul(x, w, BF16))(x, cpu_matmul.pack(w))
  assert rounded.dtype == BF16
  # Rounded once in the kernel, to nearest even, exactly as XLA's convert rounds.
  np.testing.assert_array_equal(np.asarray(rounded, np.float32),
                                np.asarray(jnp.asarray(got).astype(BF16), np.float32))


@needs_kernel
def test_only_weights_on_one_device_per_core_are_packed(monkeypatch):
  """The kernel runs on one thread: a lone device of a several-core process keeps XLA's
  library, which spreads its matmuls over the cores."""
  graphdef, state = _model()
  monkeypatch.setattr(cpu_matmul, "cores", lambda: 2)
  assert not nnx.merge(*for_decoding(graphdef, state)).layers[0].attn.packed
  mesh = Mesh(np.array(jax.devices()[:2]), ("data",))
  two = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))  # a replica on each
  assert nnx.merge(*for_decoding(graphdef, two)).layers[0].attn.packed


@needs_kernel
@DTYPES
@pytest.mark.parametrize("tied", [True, False])
def test_the_copy_holds_packed_kernels(tied, dtype):
  graphdef, state = _model(dtype, tie_word_embeddings=tied)
  copy = for_decoding(graphdef, state)
  old, new = nnx.merge(graphdef, state), nnx.merge(*copy)
  # A decoding copy is left as it is (its packed table not packed again).
  again = for_decoding(*copy)
  assert again[0] is copy[0] and again[1] is copy[1]
  with pytest.raises(ValueError, match="pack needs fuse=True"):
    decoding_plan(graphdef, state, fuse=False, pack=(dtype,))
  for layer_old, layer_new in zip(old.layers, new.layers):
    assert layer_new.attn.packed and layer_new.mlp.packed
    for before, after in ((layer_old.attn.o, layer_new.attn.o),
                          (layer_old.mlp.down, layer_new.mlp.down)):
      assert after.packed and isinstance(after, CopyDense)
      np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack(after.kernel[...])),
                                    np.asarray(before.kernel[...].T.astype(dtype)))
    pair = np.stack([np.asarray(d.kernel[...].astype(dtype)).T
                     for d in (layer_old.mlp.gate, layer_old.mlp.up)], axis=1)
    np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack(layer_new.mlp.pair[...])),
                                  pair)
  if tied:
    # The lookups keep the table as it is; step_logits reads a packed copy of it.
    assert new.embed[...] is state["embed"][...]
    np.testing.assert_array_equal(np.asarray(cpu_matmul.unpack(new.packed_head[...])),
                                  np.asarray(old.embed[...].astype(dtype)))
  else:
    assert new.packed_head is None and new.lm_head.packed


@needs_kernel
@DTYPES
def test_the_decode_program_calls_the_kernel_for_every_weight_matmul(dtype):
  """No dot of the generate program reads a kernel: each is an operand of the kernel's
  custom call (prefill and decode steps), the head included."""
  graphdef, state = for_decoding(*_model(dtype))
  tokens, mask = (jnp.asarray(x) for x in left_pad([[5, 6, 7], [9] * 5, [4], [8, 2]], 0))
  text = _generate.lower(graphdef, state, tokens, mask, jax.random.key(0),
                         params=SamplingParams(max_new_tokens=8, temperature=0)
                         ).compile().as_text()
  shapes = dict(re.findall(r"%([\w.\-]+) = \w+\[([\d,]*)\]", text))
  calls = re.findall(r'custom-call\(%[\w.\-]+, %([\w.\-]+)\).*?custom_call_target="'
                     r'(hflax_cpu_matmul_\w+)"', text)
  kernels = {"48,48", "160,48", "48,80", "64,48", "96,48"}  # o, pair, down, head, qkv
  assert {shapes[w] for w, _ in calls} == kernels, calls
  dots = re.findall(r" dot\(%([\w.\-]+), %([\w.\-]+)\)", text)
  assert not {shapes[a] for d in dots for a in d} & kernels, dots


@needs_kernel
@DTYPES
def test_the_packed_copy_computes_what_the_xla_copy_does(monkeypatch, dtype):
  """Greedy tokens and their log-probs from the packed copy against the [out, in] copy
  XLA's library multiplies: float32 sums of the same products, in another order."""
  graphdef, state = _model(dtype)
  tokens, mask = (jnp.asarray(x) for x in left_pad([[5, 6, 7], [9] * 5, [4], [8, 2]], 0))
  params = SamplingParams(max_new_tokens=6, temperature=0)

  def run():
    copy = for_decoding(graphdef, state)
    return (nnx.merge(*copy).layers[0].attn.packed,
            _generate(*copy, tokens, mask, jax.random.key(0), params=params))

  was_packed, packed = run()
  monkeypatch.setenv(cpu_matmul.ENV, "0")
  is_packed, plain = run()
  assert was_packed and not is_packed
  np.testing.assert_array_equal(np.asarray(packed["responses"]), np.asarray(plain["responses"]))
  np.testing.assert_allclose(np.asarray(packed["rollout_log_probs"]),
                             np.asarray(plain["rollout_log_probs"]),
                             atol=2e-2 if dtype == "bfloat16" else 1e-5)


def test_it_stays_off_where_asked_or_unusable(monkeypatch, caplog, tmp_path):
  """HFLAX_CPU_MATMUL=0, float32 computed from bfloat16 weights, a missing compiler, an
  unusable cache directory: the copy stays [out, in] for XLA's library, and the reason is
  logged."""
  monkeypatch.setenv(cpu_matmul.ENV, "0")
  assert cpu_matmul.problem(BF16) == "HFLAX_CPU_MATMUL=0"
  new = nnx.merge(*for_decoding(*_model()))
  assert not new.layers[0].attn.packed and not new.layers[0].attn.o.packed
  assert new.packed_head is None
  monkeypatch.delenv(cpu_matmul.ENV)
  assert cpu_matmul.problem(jnp.float16) == "no kernel for float16"
  # float32 computed from bfloat16 weights: XLA's dot widens x, the kernel would round it.
  wide = create(ModelConfig(**CFG, dtype="float32", param_dtype="bfloat16"), seed=3)
  assert not nnx.merge(*for_decoding(*wide)).layers[0].mlp.packed
  monkeypatch.setenv("CXX", "/nonexistent/g++")
  monkeypatch.setattr(cpu_matmul, "_cpu_flags", lambda: frozenset({"avx512f", "avx512bw",
                                                                  "avx512_bf16"}))
  cpu_matmul._library.cache_clear()
  try:
    reason = cpu_matmul.problem(BF16)
    assert reason.startswith("no C++ compiler found"), reason
    cpu_matmul.note_once.cache_clear()  # logged once a process: maybe logged already
    with caplog.at_level(logging.INFO, logger=cpu_matmul.__name__):
      assert not cpu_matmul.usable(BF16)
    assert "decoding with XLA's matmuls in bfloat16: no C++ compiler" in caplog.text
    with pytest.raises(RuntimeError, match="hflax cpu matmul: no C"):
      cpu_matmul.matmul(jnp.ones((2, 4), BF16), jnp.ones((16, 4), BF16))
    if REASON is None:  # a compiler, but a cache directory that cannot be made
      monkeypatch.delenv("CXX")
      (tmp_path / "a-file").write_text("")
      monkeypatch.setenv("HFLAX_CACHE_DIR", str(tmp_path / "a-file" / "hflax"))
      cpu_matmul._library.cache_clear()
      assert "could not be built or loaded at" in cpu_matmul.problem(BF16)
  finally:
    cpu_matmul._library.cache_clear()


@needs_kernel
def test_weights_split_over_devices_are_not_packed():
  """A tensor-parallel copy keeps XLA's dots: the custom call cannot be partitioned."""
  graphdef, state = _model()
  mesh = Mesh(np.array(jax.devices()[:2]), ("tensor",))
  split = jax.tree.map(
      lambda x: jax.device_put(x, NamedSharding(mesh, PartitionSpec(
          *([None] * (x.ndim - 1)), "tensor") if x.ndim and x.shape[-1] % 2 == 0
          else PartitionSpec())), state)
  new = nnx.merge(*for_decoding(graphdef, split))
  assert not new.layers[0].attn.packed and new.packed_head is None
  whole = jax.device_put(state, NamedSharding(mesh, PartitionSpec()))  # a replica on each
  assert nnx.merge(*for_decoding(graphdef, whole)).layers[0].attn.packed
