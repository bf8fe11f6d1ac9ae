"""The jitted training step: on CPU it compiles with YNNPACK matmuls, same numbers."""
import jax
import jax.numpy as jnp
import numpy as np
import optax

from hflax.controller.training import make_train_step, train_compiler_options
from hflax.models import ModelConfig, create
from hflax.models.logprobs import sequence_log_probs

CFG = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, dtype="float32")


def test_cpu_steps_use_ynnpack_unless_turned_off(monkeypatch):
  options = train_compiler_options(jax.devices()[:2])
  assert options == {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}
  monkeypatch.setenv("HFLAX_CPU_YNN", "0")
  assert train_compiler_options(jax.devices()[:2]) is None


def test_ynnpack_step_matches_the_default_compilation():
  graphdef, state = create(CFG)
  tokens = jax.random.randint(jax.random.key(0), (8, 12), 0, CFG.vocab_size)
  rows = {"tokens": tokens, "mask": jnp.ones_like(tokens)}

  def loss_fn(params, r):
    logp, _ = sequence_log_probs(graphdef, params, r["tokens"], r["mask"])
    loss = -logp.mean()
    return loss, {"loss": loss}

  tx = optax.adamw(1e-2)
  step = make_train_step(loss_fn, tx, micro_batches=2)
  results = []
  for options in (None, train_compiler_options(jax.devices()[:1])):
    params, opt = state, tx.init(state)
    fn = jax.jit(step, compiler_options=options)
    for _ in range(3):
      params, opt, metrics = fn(params, opt, rows)
    results.append((params, metrics))
  (p0, m0), (p1, m1) = results
  np.testing.assert_allclose(float(m1["loss"]), float(m0["loss"]), rtol=1e-5)
  for a, b in zip(jax.tree.leaves(p0), jax.tree.leaves(p1)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
