"""The fused log-prob kernel, run in Pallas interpret mode on CPU, against the pure-JAX path.

Interpret mode checks the kernel's arithmetic and indexing, not Triton's compilation: the
lowering test below stops at Triton IR for CUDA; PTX, speed and memory need a GPU
(bench/logprob_kernel.py).
"""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hflax.platforms.gpu import logprob_kernel
from hflax.platforms.gpu.logprobs import fused_log_probs
from hflax.models import ModelConfig, create
from hflax.models.logprobs import hidden_log_probs, sequence_log_probs
from softmax_reference import log_probs_from_logits

# 16 is Triton's smallest dot tile; N, D and V all leave a ragged last tile.
N, D, V = 37, 40, 100
TILES = dict(block_rows=16, block_vocab=16, block_d=16, interpret=True)
# bf16: identical bf16 operands and f32 accumulation leave the forward close; gradients
# come out in bf16, so they agree to about one bf16 ulp of their largest entry. A tied
# head's logits are f32, and so is their gradient on both paths: no extra rounding.
TOL = {"float32": (2e-5, 2e-5), "bfloat16": (1e-4, 1e-2), "bfloat16-tied": (1e-4, 1e-3)}


def _tols(dtype, tied=False):  # for (log-prob, entropy, grad hidden, grad W)
  out, grad = TOL[dtype + ("-tied" if tied and dtype == "bfloat16" else "")]
  return out, out, grad, grad


def _inputs(dtype, transposed, n=N, d=D, v=V):
  k = jax.random.split(jax.random.key(0), 5)
  h = jax.random.normal(k[0], (n, d)).astype(dtype)
  w = (jax.random.normal(k[1], (v, d) if transposed else (d, v)) * 0.3).astype(dtype)
  targets = jax.random.randint(k[2], (n,), 0, v).at[-1].set(v - 1)
  cot = jax.random.normal(k[3], (n,)), jax.random.normal(k[4], (n,))
  return h, w, targets, cot


def _close(a, b, tol):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  np.testing.assert_allclose(a, b, atol=tol * max(1.0, float(np.abs(b).max())), rtol=0)


# Ragged in N, D and V; aligned everywhere (the masks production shapes skip); aligned
# vocabulary with a ragged depth and the reverse (the mixed branches).
SHAPES = [(32, 48, 96), (37, 40, 96), (32, 48, 100)]


@pytest.mark.parametrize("transposed,dtype,splits,n,d,v", [
    (False, "float32", 3, N, D, V), (True, "float32", 1, N, D, V),
    (False, "bfloat16", 2, N, D, V), (True, "bfloat16", 7, N, D, V),
    *[(False, "float32", 3, *s) for s in SHAPES], *[(True, "bfloat16", 7, *s) for s in SHAPES]])
def test_kernel_matches_reference_with_gradients(transposed, dtype, splits, n, d, v):
  h, w, targets, (g_logp, g_ent) = _inputs(dtype, transposed, n, d, v)
  # What DecoderLM.logits does: tied heads give f32 logits, an untied head its own dtype.
  logits_dtype = "float32" if transposed else dtype

  def kernel(h, w):
    return fused_log_probs(h, w, targets, temperature=0.7, transposed=transposed,
                           logits_dtype=logits_dtype, vocab_splits=splits,
                           bwd_vocab_chunk=32, **TILES)

  def reference(h, w):
    logits = jnp.einsum("nd,vd->nv" if transposed else "nd,dv->nv", h, w,
                        preferred_element_type=jnp.float32)
    return log_probs_from_logits(logits.astype(logits_dtype).astype(jnp.float32), targets, 0.7)

  outs, grads = [], []
  for fn in (kernel, reference):
    out, vjp = jax.vjp(jax.jit(fn), h, w)
    outs.append(out)
    grads.append(vjp((g_logp, g_ent)))
  for a, b, tol in zip(outs[0] + grads[0], outs[1] + grads[1], _tols(dtype, transposed)):
    assert a.dtype == b.dtype and a.shape == b.shape
    _close(a, b, tol)


@pytest.mark.parametrize("tied,dtype", [(True, "float32"), (False, "float32"),
                                        (True, "bfloat16"), (False, "bfloat16")])
def test_dispatch_through_model_matches_fallback(monkeypatch, tied, dtype):
  """hidden_log_probs with the kernel forced (interpret) vs the chunked path, grads too."""
  cfg = ModelConfig(vocab_size=V, hidden_size=48, intermediate_size=64, num_layers=1,
                    num_heads=4, num_kv_heads=2, tie_word_embeddings=tied, dtype=dtype)
  graphdef, state = create(cfg)
  k = jax.random.split(jax.random.key(1), 4)
  hidden = jax.random.normal(k[0], (2, 19, 48)).astype(dtype)
  targets = jax.random.randint(k[1], (2, 19), 0, V)
  g_logp, g_ent = jax.random.normal(k[2], (2, 19)), jax.random.normal(k[3], (2, 19))

  def run(mode):
    monkeypatch.setenv(logprob_kernel.ENV, mode)

    def loss(state, hidden):  # a fresh function per mode, so jit retraces
      lp, ent = hidden_log_probs(nnx.merge(graphdef, state), hidden, targets,
                                 temperature=0.8, chunk=8)
      return jnp.sum(lp * g_logp) + jnp.sum(ent * g_ent), (lp, ent)

    (_, outs), (g_state, g_hidden) = jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(
        state, hidden)
    head = g_state["embed"] if tied else g_state["lm_head"]["kernel"]
    return (*outs, g_hidden, head[...])

  for a, b, tol in zip(run("interpret"), run("0"), _tols(dtype)):
    assert a.dtype == b.dtype
    _close(a, b, tol)


def test_cpu_path_is_unchanged(monkeypatch):
  """On CPU "auto" traces the very program of the pure-JAX path: same numbers, bit for bit."""
  monkeypatch.delenv(logprob_kernel.ENV, raising=False)
  assert jax.default_backend() == "cpu" and logprob_kernel.logprob_kernel_mode() is None
  cfg = ModelConfig(vocab_size=V, hidden_size=32, intermediate_size=64, num_layers=1,
                    num_heads=4, num_kv_heads=2)
  graphdef, state = create(cfg)
  ids = jax.random.randint(jax.random.key(2), (2, 11), 0, V)
  mask = jnp.ones_like(ids).at[0, :3].set(0)

  def traced(mode):
    monkeypatch.setenv(logprob_kernel.ENV, mode)
    fn = lambda s: sequence_log_probs(graphdef, s, ids, mask, chunk=4)  # noqa: E731
    return str(jax.make_jaxpr(fn)(state)), jax.jit(fn)(state)

  (auto_jaxpr, auto), (off_jaxpr, off) = traced("auto"), traced("0")
  assert auto_jaxpr == off_jaxpr and "pallas_call" not in auto_jaxpr
  for a, b in zip(auto, off):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


class _FakeGpu:
  device_kind = "NVIDIA H100"

  def __init__(self, capability):
    if capability is not None:
      self.compute_capability = capability


@pytest.mark.parametrize("flag,capability,count,mode", [
    ("auto", "9.0", 1, None), ("0", "9.0", 1, None), ("1", "9.0", 1, "gpu"),
    ("1", "9.0", 8, "gpu")])
def test_mode_on_gpus(monkeypatch, flag, capability, count, mode):
  """"auto" keeps the chunked path on GPUs too (measured faster on an H100); "1" runs the
  kernel, multi-device processes included."""
  monkeypatch.setenv(logprob_kernel.ENV, flag)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax, "local_devices", lambda: [_FakeGpu(capability)] * count)
  monkeypatch.setattr(jax, "device_count", lambda: count)
  assert logprob_kernel.logprob_kernel_mode() == mode


@pytest.mark.parametrize("capability,error", [
    ("7.0", "compute capability 7.0"), (None, "not a CUDA device"), ("gfx90a", "not a CUDA")])
def test_asking_for_the_kernel_where_it_cannot_compile_is_an_error(monkeypatch, capability,
                                                                     error):
  monkeypatch.setenv(logprob_kernel.ENV, "1")
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  monkeypatch.setattr(jax, "local_devices", lambda: [_FakeGpu(capability)])
  with pytest.raises(ValueError, match=error):
    logprob_kernel.logprob_kernel_mode()


def test_tiles_are_checked():
  h, w, targets, _ = _inputs("float32", False)
  with pytest.raises(ValueError, match="block_rows=8"):
    fused_log_probs(h, w, targets, **{**TILES, "block_rows": 8})
  with pytest.raises(ValueError, match="block_vocab=48"):
    fused_log_probs(h, w, targets, **{**TILES, "block_vocab": 48})


def test_mode_flag(monkeypatch):
  for flag, mode in [("0", None), ("auto", None), ("interpret", "interpret")]:
    monkeypatch.setenv(logprob_kernel.ENV, flag)
    assert logprob_kernel.logprob_kernel_mode() == mode
  for flag, error in [("yes please", "expected auto"), ("1", "backend is cpu")]:
    monkeypatch.setenv(logprob_kernel.ENV, flag)  # "1" asks for a GPU kernel: not a silent fallback
    with pytest.raises(ValueError, match=error):
      logprob_kernel.logprob_kernel_mode()


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("n,d,v", [(8192, 4096, 128256), (N, D, V)])  # aligned, ragged
def test_kernel_lowers_to_triton_for_cuda(transposed, n, d, v):
  """Pallas' Triton lowering (power-of-2 tiles, masked loads, loops) for CUDA, run on this
  CPU machine: it stops before PTX, so it cannot catch compile or runtime faults."""
  args = (jax.ShapeDtypeStruct((n, d), jnp.bfloat16),
          jax.ShapeDtypeStruct((v, d) if transposed else (d, v), jnp.bfloat16),
          jax.ShapeDtypeStruct((n,), jnp.int32))
  fn = jax.jit(lambda h, w, t: fused_log_probs(h, w, t, transposed=transposed,
                                               temperature=0.7, vocab_splits=2))
  text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 1
