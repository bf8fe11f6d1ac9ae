"""Chunked teacher-forced log-probs against a full log-softmax of the reference logits."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from hf_models import loaded_pair
from hflax.models.logprobs import sequence_log_probs


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
  return loaded_pair("qwen3", tmp_path_factory.mktemp("qwen3"), seed=2)


def _batch():
  ids = np.random.RandomState(0).randint(3, 128, size=(3, 19))
  mask = np.ones_like(ids)
  mask[0, :4] = 0
  mask[2, -5:] = 0  # right padding after a finished response
  return ids, mask


# Every chunk width at temperature 1 (one column, ragged, whole); the temperature divides
# each chunk's logits alike, so at 0.6 a ragged width and the single chunk.
@pytest.mark.parametrize("temperature,chunk", [(1.0, 1), (1.0, 5), (1.0, 7), (1.0, 128),
                                               (0.6, 7), (0.6, 128)])
def test_chunked_log_probs_and_entropy_match_reference(pair, chunk, temperature):
  model, graphdef, state = pair
  ids, mask = _batch()
  fn = jax.jit(sequence_log_probs, static_argnums=0, static_argnames=("chunk", "temperature"))
  logp, entropy = fn(graphdef, state, jnp.asarray(ids), jnp.asarray(mask), chunk=chunk,
                     temperature=temperature)
  with torch.no_grad():
    logits = model(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.double() / temperature
  ref_all = torch.log_softmax(logits, -1).numpy()
  ref = np.zeros(ids.shape)
  ref_entropy = np.zeros(ids.shape)
  for b in range(ids.shape[0]):
    for t in range(1, ids.shape[1]):
      if mask[b, t] and mask[b, t - 1]:
        ref[b, t] = ref_all[b, t - 1, ids[b, t]]
        p = np.exp(ref_all[b, t - 1])
        ref_entropy[b, t] = -(p * ref_all[b, t - 1]).sum()
  np.testing.assert_allclose(np.asarray(logp), ref, atol=2e-5)
  np.testing.assert_allclose(np.asarray(entropy), ref_entropy, atol=2e-5)


@pytest.mark.parametrize("last", [1, 7, 18])
def test_last_columns_equal_the_full_computation(pair, last):
  # last=width projects only the response columns onto the vocabulary (the actor's update
  # and log-prob passes): values and gradients must be the full pass's, sliced.
  # Compiled, not run op by op: the full pass (shared by the three cases) and each
  # gradient is one program.
  _, graphdef, state = pair
  ids, mask = map(jnp.asarray, _batch())
  log_probs = jax.jit(sequence_log_probs, static_argnums=0, static_argnames=("chunk", "last"))
  full = log_probs(graphdef, state, ids, mask, chunk=5)
  tail = log_probs(graphdef, state, ids, mask, chunk=5, last=last)
  for a, b in zip(full, tail):
    assert b.shape == (3, last)
    np.testing.assert_allclose(np.asarray(b), np.asarray(a[:, -last:]), atol=1e-6)

  def loss(state, last):
    logp, entropy = sequence_log_probs(graphdef, state, ids, mask, chunk=5, last=last)
    return logp[:, -last:].sum() + 0.1 * entropy[:, -last:].sum()

  grad_full = jax.jit(jax.grad(
      lambda s: (lambda lp, en: lp[:, -last:].sum() + 0.1 * en[:, -last:].sum())(
          *sequence_log_probs(graphdef, s, ids, mask, chunk=5))))(state)
  grad_tail = jax.jit(jax.grad(loss), static_argnums=1)(state, last)
  for a, b in zip(jax.tree.leaves(grad_full), jax.tree.leaves(grad_tail)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)


def test_gradient_does_not_depend_on_chunking(pair):
  _, graphdef, state = pair
  ids, mask = map(jnp.asarray, _batch())

  def loss(state, chunk):
    logp, entropy = sequence_log_probs(graphdef, state, ids, mask, chunk=chunk)
    return logp.sum() + 0.1 * entropy.sum()

  grads = [jax.jit(jax.grad(loss), static_argnums=1)(state, c) for c in (4, 32)]
  for a, b in zip(jax.tree.leaves(grads[0]), jax.tree.leaves(grads[1])):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
  assert max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grads[0])) > 0


def test_chunks_past_the_count_are_skipped_not_changed(pair):
  """hidden_log_probs(count=c) (a traced scalar, as packed passes give it): the first c
  positions and their gradients are the full computation's; chunks wholly past c are
  never projected (their values read 0). Counts 0, 5, 11 and 19 (none, a chunk's end,
  within a chunk, every position) run through the same compiled programs."""
  from hflax.models.logprobs import hidden_log_probs
  from hflax.models.transformer import forward
  _, graphdef, state = pair
  ids, mask = map(jnp.asarray, _batch())
  ids, mask = ids[:1], jnp.ones_like(mask[:1])

  def run(state, count):
    model, hidden = forward(graphdef, state, ids, mask)
    return hidden_log_probs(model, hidden[:, :-1], ids[:, 1:], chunk=5, count=count)

  def loss(state, count, skip):
    logp, entropy = run(state, count if skip else None)
    keep = jnp.arange(ids.shape[1] - 1) < count
    return jnp.sum(jnp.where(keep, logp + 0.1 * entropy, 0.0))

  part_of = jax.jit(run)
  full = part_of(state, None)
  grad_of = jax.jit(jax.grad(loss), static_argnums=2)
  for count in (0, 5, 11, 19):
    part = part_of(state, jnp.int32(count))
    computed = -(-count // 5) * 5  # whole chunks: those holding a needed position
    for a, b in zip(full, part):
      np.testing.assert_allclose(np.asarray(b[:, :computed]), np.asarray(a[:, :computed]),
                                 atol=1e-6, err_msg=f"count {count}")
      assert not np.asarray(b[:, computed:]).any() and np.asarray(a[:, computed:]).all()
    grad_full = grad_of(state, jnp.int32(count), False)
    grad_part = grad_of(state, jnp.int32(count), True)
    for a, b in zip(jax.tree.leaves(grad_full), jax.tree.leaves(grad_part)):
      np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=1e-5, rtol=1e-5,
                                 err_msg=f"count {count}")
    largest = max(float(jnp.abs(g).max()) for g in jax.tree.leaves(grad_part))
    assert largest > 0 if count else largest == 0, count


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_remat_and_mixed_precision_gradients(dtype):
  """Rematerialisation changes memory, not the gradient; bf16 compute with f32 master
  weights stays close to the f32 gradient."""
  from hflax.models import ModelConfig, create
  cfg = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                    num_heads=4, num_kv_heads=2)
  graphdef, state = create(cfg)
  ids, mask = map(jnp.asarray, _batch())
  ids = ids % 64

  def loss_of(cfg):
    gd, _ = create(cfg)
    return lambda s: sequence_log_probs(gd, s, ids, mask)[0].sum()

  def grads(cfg):
    return jax.jit(jax.grad(loss_of(cfg)))(state)

  jaxpr = lambda cfg: str(jax.make_jaxpr(jax.grad(loss_of(cfg)))(state))  # noqa: E731
  assert jaxpr(cfg.replace(remat=True)).count("remat") > jaxpr(cfg).count("remat")

  base = grads(cfg)
  other = grads(cfg.replace(remat=True, dtype=dtype))
  tol = 1e-5 if dtype == "float32" else 5e-2
  for a, b in zip(jax.tree.leaves(base), jax.tree.leaves(other)):
    assert b.dtype == jnp.float32  # master weights and their gradients stay float32
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=tol * max(1, float(jnp.abs(a).max())))
