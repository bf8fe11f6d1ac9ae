"""The auto-mapper's memory model (automap/memory.py) against XLA's compiled memory analysis
of the runtime's own programs: the actor update, a forward log-prob pass, generation.

Stated factor: prediction / XLA within [0.7, 1.5] for both the transient bytes (XLA's
temp) and the whole footprint (arguments + outputs + temp - aliased). The shapes are
picked so that a different term dominates each: the MLP, dense attention scores, the
logits chunk, the KV cache.
"""
import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from hflax.algorithms.losses import ppo_clip_loss
from hflax.controller.training import make_train_step
from hflax.models import ModelConfig, create
from hflax.models.logprobs import sequence_log_probs
from hflax.rollout.sampler import SamplingParams, _generate, decode_segments
from hflax.sharding import automap
from hflax.sharding.automap import memory
from hflax.sharding.automap.cost import Simulator
from hflax.sharding.automap.mesh import MeshShape

LOW, HIGH = 0.7, 1.5


def config(layers=2, d=64, vocab=512, heads=4, kv=2, remat=False):
  return ModelConfig(vocab_size=vocab, hidden_size=d, intermediate_size=2 * d, num_layers=layers,
                     num_heads=heads, num_kv_heads=kv, remat=remat)


def xla(compiled):
  m = compiled.memory_analysis()
  total = (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
           - m.alias_size_in_bytes)
  return m.temp_size_in_bytes, total


def rows(batch, length, vocab):
  scored = length // 2
  return {"input_ids": jax.random.randint(jax.random.key(0), (batch, length), 0, vocab),
          "attention_mask": jnp.ones((batch, length), bool),
          "response_mask": jnp.ones((batch, scored), jnp.float32),
          "old_log_probs": jnp.zeros((batch, scored)), "advantages": jnp.ones((batch, scored))}


def compiled_update(cfg, batch, length):
  """The actor's update as workers.py compiles it: PPO-clip over the response log-probs,
  AdamW, parameters and optimizer state donated."""
  graphdef, state = create(cfg)
  params = nnx.state(nnx.merge(graphdef, state), nnx.Param)
  scored = length // 2

  def loss(p, r):
    logp, _ = sequence_log_probs(graphdef, p, r["input_ids"], r["attention_mask"], last=scored)
    per_token, _ = ppo_clip_loss(logp, r["old_log_probs"], r["advantages"], r["response_mask"])
    return jnp.mean(per_token), {}

  tx = optax.adamw(1e-3)
  step = jax.jit(make_train_step(loss, tx, 1), donate_argnums=(0, 1))
  return step.lower(params, tx.init(params), rows(batch, length, cfg.vocab_size)).compile()


@functools.cache
def update_memory(cfg, batch, length):
  """xla(compiled_update(...)): (temp, total) bytes, compiled once for the tests that read
  the same program (the 2-layer d=512 update without remat)."""
  return xla(compiled_update(cfg, batch, length))


def compiled_forward(cfg, batch, length):
  graphdef, state = create(cfg)
  r = rows(batch, length, cfg.vocab_size)
  fn = jax.jit(lambda s, ids, m: sequence_log_probs(graphdef, s, ids, m, last=length // 2))
  return fn.lower(state, r["input_ids"], r["attention_mask"]).compile()


def assert_within(predicted, measured, what):
  ratio = predicted / measured
  assert LOW <= ratio <= HIGH, f"{what}: model {predicted:.3g} B / XLA {measured:.3g} B = {ratio:.2f}"


@pytest.mark.parametrize("layers, batch, length, d, vocab", [
    (2, 32, 32, 512, 512),   # MLP activations
    (2, 4, 256, 64, 512),    # dense attention scores
    (2, 16, 64, 256, 4096),  # logits chunk and gradients
])
def test_update_memory_within_factor(layers, batch, length, d, vocab):
  cfg = config(layers, d, vocab)
  temp, total = update_memory(cfg, batch, length)
  predicted = memory.update_bytes(cfg, batch, length, length // 2)  # the runtime's attention
  assert_within(predicted.transient, temp, "update temp")
  assert_within(predicted.total, total, "update total")


@pytest.mark.parametrize("layers, batch, length, d, vocab", [
    (2, 32, 32, 512, 512), (2, 4, 256, 64, 512), (2, 8, 32, 128, 8192)])
def test_forward_memory_within_factor(layers, batch, length, d, vocab):
  cfg = config(layers, d, vocab)
  temp, total = xla(compiled_forward(cfg, batch, length))
  predicted = memory.forward_bytes(cfg, batch, length, length // 2)
  assert_within(predicted.transient, temp, "forward temp")
  assert_within(predicted.total, total, "forward total")


@pytest.mark.parametrize("batch, prompt, new_tokens", [(8, 64, 128), (16, 40, 128), (8, 64, 32)])
def test_generate_memory_within_factor(batch, prompt, new_tokens):
  cfg = config(d=256, heads=4, kv=4)
  graphdef, state = create(cfg)
  params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
  tokens = jnp.zeros((batch, memory.length_bucket(prompt)), jnp.int32)
  compiled = _generate.lower(graphdef, state, tokens, jnp.ones(tokens.shape, bool),
                             jax.random.key(0), params=params,
                             segments=decode_segments(new_tokens)).compile()
  temp, total = xla(compiled)
  predicted = memory.generate_bytes(cfg, batch, prompt, new_tokens)
  assert_within(predicted.transient, temp, "generate temp")
  assert_within(predicted.total, total, "generate total")
  # The cache is most of it, and it is the sampler's: the prompt's bucket (64 for 40) plus
  # the new tokens, not the prompt's own length.
  cache = memory.kv_cache_bytes(cfg, batch, memory.length_bucket(prompt) + new_tokens)
  assert cache > 0.3 * temp


def key_blocks(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, kv_valid_BxS, q_slot_BxT, block=128):
  """One-head attention a key block at a time with a running max and sum (no [T, S])."""
  q_BxTxDh, k_BxDhxS, v_BxSxDh = q_BxTxHxDh[:, :, 0], k_BxKxDhxS[:, 0], v_BxKxSxDh[:, 0]

  def step(carry, j):
    m, l, acc = carry
    k = jax.lax.dynamic_slice_in_dim(k_BxDhxS, j * block, block, axis=2)
    v = jax.lax.dynamic_slice_in_dim(v_BxSxDh, j * block, block, axis=1)
    s = jnp.einsum("btd,bds->bts", q_BxTxDh, k) * q_BxTxDh.shape[-1] ** -0.5
    seen = (jnp.arange(block) + j * block)[None, None] <= q_slot_BxT[:, :, None]
    s = jnp.where(seen, s, -1e30)
    m_new = jnp.maximum(m, s.max(-1))
    p = jnp.exp(s - m_new[..., None])
    scale = jnp.exp(m - m_new)
    return (m_new, l * scale + p.sum(-1),
            acc * scale[..., None] + jnp.einsum("bts,bsd->btd", p, v)), None

  B, T, Dh = q_BxTxDh.shape
  init = (jnp.full((B, T), -1e30), jnp.zeros((B, T)), jnp.zeros((B, T, Dh)))
  (_, l, acc), _ = jax.lax.scan(step, init, jnp.arange(k_BxDhxS.shape[2] // block))
  return (acc / l[..., None])[:, :, None]


def test_attention_kind_is_read_from_the_traced_program():
  from hflax.models import attention
  assert memory.attention_kind(attention.reference) == "dense"
  assert memory.attention_kind(key_blocks) == "blockwise"
  # Both compute the same thing (so the blockwise probe is an attention, not a stand-in).
  k = jax.random.split(jax.random.key(0), 3)
  T = 256
  q = jax.random.normal(k[0], (1, T, 1, 8))
  kk, v = jax.random.normal(k[1], (1, 1, 8, T)), jax.random.normal(k[2], (1, 1, T, 8))
  args = (q, kk, v, jnp.ones((1, T), bool), jnp.arange(T)[None])
  assert jnp.allclose(key_blocks(*args), attention.reference(*args), atol=1e-5)


def test_attention_term_follows_the_runtime():
  cfg = config(layers=1, d=64, heads=4, kv=4).replace(attention="reference")
  lengths = (512, 1024)
  # What the runtime runs for this config, traced: the quadratic scores of XLA's scratch
  # below must then be what the model charges when left to the runtime's pick.
  assert [memory.runtime_attention(cfg, n) for n in lengths] == ["dense"] * 2
  temps = [xla(compiled_forward(cfg, 1, n))[0] for n in lengths]
  dense = [memory.forward_bytes(cfg, 1, n, n // 2).transient for n in lengths]
  blockwise = [memory.forward_bytes(cfg, 1, n, n // 2, "blockwise").transient for n in lengths]
  # Doubling the length: XLA's scratch grows about 4x (quadratic scores), as the dense
  # model says, and unlike the blockwise model's 2x.
  grows = temps[1] / temps[0]
  assert 3.3 < grows < 4.5, grows
  assert abs(dense[1] / dense[0] - grows) < 0.5
  assert blockwise[1] / blockwise[0] < 2.5
  for measured, predicted in zip(temps, dense):
    assert_within(predicted, measured, "attention-bound forward temp")


def test_long_contexts_run_blockwise_and_the_model_follows():
  """At thousands of keys the runtime's "auto" runs blockwise attention: XLA's scratch
  grows about linearly with the length, and the model (left to the runtime's pick) too."""
  cfg = config(layers=1, d=64, heads=4, kv=4)
  lengths = (2048, 4096)
  assert [memory.runtime_attention(cfg, n) for n in lengths] == ["blockwise"] * 2
  temps = [xla(compiled_forward(cfg, 1, n))[0] for n in lengths]
  assert temps[1] / temps[0] < 2.6
  predicted = [memory.forward_bytes(cfg, 1, n, n // 2).transient for n in lengths]
  for measured, model in zip(temps, predicted):
    assert_within(model, measured, "blockwise forward temp")
  assert predicted[1] < memory.forward_bytes(cfg, 1, 4096, 2048, "dense").transient / 4


def test_remat_lowers_the_model_but_not_xla_cpu_peak():
  """With remat each layer keeps only its input; the model counts that (the saving a
  memory-aware schedule realises). XLA:CPU schedules every layer's recomputation early,
  so its compiled peak barely moves: the model is then a lower bound there."""
  on, off = config(remat=True, d=512), config(remat=False, d=512)
  temp_on, _ = update_memory(on, 32, 32)
  temp_off, _ = update_memory(off, 32, 32)  # test_update_memory_within_factor's first case
  assert 0.9 < temp_on / temp_off <= 1.0
  model_on = memory.update_bytes(on, 32, 32, 16, "dense").transient
  model_off = memory.update_bytes(off, 32, 32, 16, "dense").transient
  assert model_on < 0.6 * model_off
  assert model_on <= temp_on


def test_simulator_charges_dense_attention_and_the_sampler_cache():
  """A 7B actor at 4k tokens: dense scores push training past the memory blockwise
  attention leaves free, and the sampler's prefill cache fits fewer sequences."""
  cfg = automap.llama2_config("7b")
  prof = automap.get_profile("a100-80gb")
  mesh = MeshShape(1, 8, 1)
  kw = dict(prompt_len=2048, response_len=2048, prompts_per_step=64, mini_batch_size=64)
  dense = Simulator(automap.Workload.ppo(cfg, attention="dense", **kw), prof)
  flash = Simulator(automap.Workload.ppo(cfg, attention="blockwise", **kw), prof)
  args = (cfg, mesh, 8)
  assert dense._activations(*args, train=False, remat=False) > \
      2 * flash._activations(*args, train=False, remat=False)
  sampler = Simulator(automap.Workload.ppo(cfg, **kw), prof).generate(mesh, 1, 60e9)
  paged = Simulator(automap.Workload.ppo(cfg, kv_cache="paged", **kw), prof).generate(
      mesh, 1, 60e9)
  assert 0 < sampler.max_num_seqs < paged.max_num_seqs


def test_simulator_counts_each_models_own_dtypes():
  """One model in bfloat16 and in float32 (a CPU job's): the float32 reference keeps
  twice the bytes, its generation copy and KV cache take twice the memory, so fewer
  sequences fit, and a decode step reads twice the bytes."""
  bf16 = automap.llama2_config("7b")
  fp32 = bf16.replace(dtype="float32", param_dtype="float32")
  prof, mesh = automap.get_profile("a100-80gb"), MeshShape(1, 8, 1)
  kw = dict(prompt_len=1024, response_len=1024, prompts_per_step=64, mini_batch_size=64)
  sims = {c.dtype: Simulator(automap.Workload.ppo(c, **kw), prof) for c in (bf16, fp32)}
  resident = {k: s.resident("ref", mesh) for k, s in sims.items()}
  assert resident == {"bfloat16": 2 * bf16.num_params / 8, "float32": 4 * bf16.num_params / 8}
  fits = {k: s.generate(mesh, 1, 60e9).max_num_seqs for k, s in sims.items()}
  assert 0 < fits["float32"] < fits["bfloat16"]
  # One row, one token of context: the weights' bytes dominate the step's reads.
  step = {k: s._decode_step((mesh, 1, 8), s.wl.models["actor"], 1, 1) for k, s in sims.items()}
  extra = 2 * bf16.num_params / sims["float32"].hbm_rate
  assert step["float32"] - step["bfloat16"] == pytest.approx(extra, rel=1e-3)


def test_bad_input_names_the_field():
  with pytest.raises(ValueError, match="attention"):
    memory.forward_bytes(config(), 1, 8, attention="flash")
  with pytest.raises(ValueError, match="attention"):
    automap.Workload.ppo(config(), attention="flash")
  with pytest.raises(ValueError, match="kv_cache"):
    automap.Workload.ppo(config(), kv_cache="vllm")
