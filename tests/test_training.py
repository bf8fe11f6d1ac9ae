"""Training mechanics: mini-batch order, learning-rate schedules, gradient clipping,
micro-batch accumulation, and the jitted step's CPU compilation (YNNPACK, same numbers)."""
import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from hflax.controller.training import (BF16_FAST_MATH, OptimConfig, UpdateConfig, learning_rate,
                                       make_optimizer, make_train_step, mini_batch_order,
                                       train_compiler_options)
from hflax.models import ModelConfig, create
from hflax.models.logprobs import sequence_log_probs
from jaxpr_casts import bfloat16_casts

CFG = ModelConfig(family="llama", vocab_size=64, hidden_size=32, intermediate_size=64,
                  num_layers=2, num_heads=4, num_kv_heads=2, dtype="float32")


def test_cpu_steps_use_ynnpack_in_float32_unless_turned_off(monkeypatch):
  options = train_compiler_options(jax.devices()[:2])
  assert options == {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_DOT"}
  monkeypatch.setenv("HFLAX_CPU_YNN", "0")
  assert train_compiler_options(jax.devices()[:2]) is None


def test_cpu_bfloat16_steps_reassociate_float32_math_unless_turned_off(monkeypatch):
  assert train_compiler_options(jax.devices()[:2], "bfloat16") == BF16_FAST_MATH
  assert train_compiler_options(jax.devices()[:2], "float16") is None
  monkeypatch.setenv("HFLAX_CPU_FAST_MATH", "0")
  assert train_compiler_options(jax.devices()[:2], "bfloat16") is None


def test_fast_math_bfloat16_gradient_stays_as_close_to_float32():
  """Reassociated float32 sums move a bf16 step's gradient by far less than bf16 itself
  does: its distance to the float32 gradient stays what the default compilation's is.
  Both compile as users do, at LLVM's default level with XLA:CPU's default fusion emitters:
  under the suite's compile-speed options (conftest) the fast-math options change nothing."""
  cfg = CFG.replace(vocab_size=512, num_layers=3)
  graphdef32, state = create(cfg)
  graphdef16, _ = create(cfg.replace(dtype="bfloat16"))
  tokens = jax.random.randint(jax.random.key(1), (4, 40), 0, cfg.vocab_size)
  mask = jnp.ones_like(tokens).at[:, :7].set(0)  # left padding, as rollouts have

  def grad_fn(graphdef):
    return jax.grad(lambda p: -sequence_log_probs(graphdef, p, tokens, mask)[0].sum())

  flat = lambda g: jnp.concatenate([x.ravel() for x in jax.tree.leaves(g)])  # noqa: E731
  exact = flat(jax.jit(grad_fn(graphdef32))(state))
  dist, grads = {}, {}
  level = {"xla_backend_optimization_level": 3, "xla_cpu_use_fusion_emitters": True}
  for name, options in (("default", level), ("fast", {**BF16_FAST_MATH, **level})):
    grads[name] = flat(jax.jit(grad_fn(graphdef16), compiler_options=options)(state))
    dist[name] = float(jnp.linalg.norm(grads[name] - exact) / jnp.linalg.norm(exact))
  assert not jnp.array_equal(grads["fast"], grads["default"])  # the options took effect
  assert 0 < dist["default"] < 0.1
  assert dist["fast"] < 1.25 * dist["default"]


def test_bfloat16_steps_keep_their_dots_in_bfloat16():
  """The dot-only YNN option widened bf16 x bf16 -> f32 dots to f32 (1.5x slower on a CPU
  with AMX); the options a bf16 step gets must leave them bf16."""
  x = jnp.ones((448, 576), jnp.bfloat16)
  w = jnp.ones((576, 1536), jnp.bfloat16)
  dot = lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32)  # noqa: E731
  options = train_compiler_options(jax.devices()[:1], "bfloat16")
  text = jax.jit(dot, compiler_options=options).lower(x, w).compile().as_text()
  assert "f32[448,576]" not in text  # no widened operand


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


def test_mini_batch_order_covers_every_row_once_per_epoch():
  plain = mini_batch_order(8, UpdateConfig(mini_batch_size=4, epochs=2), seed=0)
  assert [list(i) for i in plain] == [[0, 1, 2, 3], [4, 5, 6, 7]] * 2
  cfg = UpdateConfig(mini_batch_size=3, micro_batch_size=1, epochs=3, shuffle=True)
  order = mini_batch_order(12, cfg, seed=5)
  assert len(order) == 3 * 4 and all(len(i) == 3 for i in order)
  epochs = [np.concatenate(order[e * 4:(e + 1) * 4]) for e in range(3)]
  for rows in epochs:
    assert sorted(rows) == list(range(12))
  assert any(list(e) != list(range(12)) for e in epochs)  # shuffled, not the identity
  assert list(epochs[0]) != list(epochs[1])  # a fresh permutation every epoch
  again = mini_batch_order(12, cfg, seed=5)
  assert all((a == b).all() for a, b in zip(order, again))
  other = mini_batch_order(12, cfg, seed=6)
  assert any((a != b).any() for a, b in zip(order, other))


def test_mini_batch_order_rejects_sizes_that_do_not_divide():
  with pytest.raises(ValueError, match="mini_batch_size=5 does not divide the 12 rows"):
    mini_batch_order(12, UpdateConfig(mini_batch_size=5), seed=0)
  with pytest.raises(ValueError, match="micro_batch_size=4 does not divide mini_batch_size=6"):
    mini_batch_order(12, UpdateConfig(mini_batch_size=6, micro_batch_size=4), seed=0)


def test_learning_rate_schedules_match_their_closed_forms():
  constant = learning_rate(OptimConfig(lr=3e-4))
  assert all(float(constant(t)) == pytest.approx(3e-4) for t in (0, 7, 10_000))
  lr, warmup, total, floor = 1e-3, 4, 14, 0.1
  schedule = learning_rate(OptimConfig(lr=lr, warmup_steps=warmup, schedule="cosine",
                                       total_steps=total, min_lr_ratio=floor))
  for t in range(0, 20):
    if t < warmup:
      want = lr * t / warmup
    else:
      progress = min(t - warmup, total - warmup) / (total - warmup)
      want = lr * ((1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)) + floor)
    assert float(schedule(t)) == pytest.approx(want, rel=1e-5, abs=1e-12), t
  with pytest.raises(ValueError, match="total_steps must exceed"):
    learning_rate(OptimConfig(schedule="cosine", warmup_steps=5, total_steps=5))
  with pytest.raises(ValueError, match="optim.schedule"):
    learning_rate(OptimConfig(schedule="linear"))


@pytest.mark.parametrize("clip,scale", [(1.0, 1.0 / 13), (20.0, 1.0), (0.0, 1.0)],
                         ids=["clipped", "under-the-clip", "off"])
def test_gradients_are_clipped_to_the_global_norm(clip, scale):
  """Global norm 13 (= sqrt(3^2 + 4^2 + 12^2)): clip 1 scales by 1/13, clip 20 or off keeps it."""
  b1 = 0.9
  tx = make_optimizer(OptimConfig(lr=0.1, b1=b1, grad_clip=clip))
  params = {"a": jnp.zeros(2), "b": jnp.zeros(())}
  grads = {"a": jnp.array([3.0, 4.0]), "b": jnp.array(12.0)}
  _, state = tx.update(grads, tx.init(params), params)
  # Adam's first update is scale-free, so the clipping shows in its first moment: (1 - b1) g.
  mu = optax.tree_utils.tree_get(state, "mu")
  np.testing.assert_allclose(mu["a"], (1 - b1) * scale * np.array([3.0, 4.0]), rtol=1e-6)
  np.testing.assert_allclose(mu["b"], (1 - b1) * scale * 12.0, rtol=1e-6)


def test_micro_batch_accumulation_equals_one_full_batch_step():
  """A mean loss over equal micro-batches averages to the full batch's gradient."""
  x = jax.random.normal(jax.random.key(1), (8, 3))
  y = jax.random.normal(jax.random.key(2), (8,))
  params = {"w": jnp.array([0.5, -1.0, 2.0]), "b": jnp.array(0.3)}

  def loss_fn(p, rows):
    loss = jnp.mean((rows["x"] @ p["w"] + p["b"] - rows["y"]) ** 2)
    return loss, {"loss": loss}

  # By hand: d/dw mean((xw + b - y)^2) = 2/N x^T r, d/db = 2 mean(r).
  xs, ys = np.asarray(x, np.float64), np.asarray(y, np.float64)
  residual = xs @ np.asarray(params["w"], np.float64) + 0.3 - ys
  grad = {"w": 2 * xs.T @ residual / 8, "b": 2 * residual.mean()}
  lr = 0.1
  results = []
  for micro in (1, 2, 4):
    step = jax.jit(make_train_step(loss_fn, optax.sgd(lr), micro_batches=micro))
    new, _, metrics = step(params, optax.sgd(lr).init(params), {"x": x, "y": y})
    np.testing.assert_allclose(new["w"], params["w"] - lr * grad["w"], atol=1e-6)
    np.testing.assert_allclose(new["b"], 0.3 - lr * grad["b"], atol=1e-6)
    assert float(metrics["loss"]) == pytest.approx((residual ** 2).mean(), rel=1e-5)
    assert float(metrics["grad_norm"]) == pytest.approx(
        math.sqrt((grad["w"] ** 2).sum() + grad["b"] ** 2), rel=1e-5)
    results.append(new)
  for other in results[1:]:
    for a, b in zip(jax.tree.leaves(results[0]), jax.tree.leaves(other)):
      np.testing.assert_allclose(a, b, atol=1e-6)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_of_unequal_token_counts_give_the_mini_batch_aggregate(mode):
  """Weighted by aggregation_weight, micro-batches holding 12 and 1 valid tokens (2 and 1
  sequences) give the mini-batch's own token (or sequence) mean, not the mean of the two
  means."""
  from hflax.algorithms import aggregate_loss, aggregation_weight
  mask = np.zeros((4, 6), np.float32)
  mask[0, :6] = mask[2, :6] = 1  # micro-batch 0 takes rows 0 and 2: 12 tokens
  mask[1, :1] = 1  # micro-batch 1 takes rows 1 and 3 (all padding): 1 token
  x = np.asarray(jax.random.normal(jax.random.key(3), (4, 6)))
  rows = {"x": jnp.asarray(x), "response_mask": jnp.asarray(mask)}
  params = {"w": jnp.array(1.5)}

  def loss_fn(p, f):
    loss = aggregate_loss((p["w"] * f["x"]) ** 2, f["response_mask"], mode)
    return loss, {"loss": loss}

  whole = jax.grad(lambda p: loss_fn(p, rows)[0])(params)["w"]
  weight = lambda f: aggregation_weight(f["response_mask"], mode)  # noqa: E731
  step = jax.jit(make_train_step(loss_fn, optax.sgd(1.0), micro_batches=2, weight_fn=weight))
  new, _, metrics = step(params, optax.sgd(1.0).init(params), rows)
  np.testing.assert_allclose(1.5 - new["w"], whole, rtol=1e-6)
  np.testing.assert_allclose(metrics["loss"], loss_fn(params, rows)[0], rtol=1e-6)
  if mode == "token-mean":  # by hand: d/dw mean over the 13 tokens of w^2 x^2
    np.testing.assert_allclose(whole, 2 * 1.5 * (x ** 2 * mask).sum() / 13, rtol=1e-5)
  unweighted = jax.jit(make_train_step(loss_fn, optax.sgd(1.0), micro_batches=2))
  assert abs(float(1.5 - unweighted(params, optax.sgd(1.0).init(params), rows)[0]["w"])
             - float(whole)) > 1e-3  # equal weights would get it wrong


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fsdp_gradients_gather_weights_instead_of_resharding_activations(dtype):
  """Under the pool's mesh the model pins its activations to row splits between layers
  (transformer.rows_split): an FSDP gradient then gathers weights and never reshuffles
  activations (no all-to-all), and equals the one-device gradient (in bf16, whose CPU
  backward writes transposed operands out under layout constraints, up to bf16 rounding
  of differently split sums)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  from hflax.sharding.layouts import TRAIN_RULES, state_shardings, train_mesh
  # Shaped like bench/automap.py's critic, where XLA left alone chose the reshuffles.
  cfg = ModelConfig(family="llama", vocab_size=261, hidden_size=128, intermediate_size=384,
                    num_layers=2, num_heads=8, num_kv_heads=4, dtype=dtype,
                    param_dtype="float32")
  graphdef, state = create(cfg, seed=0)
  mesh = train_mesh(jax.devices()[:4], fsdp=4)
  rs = np.random.RandomState(0)
  tokens = jnp.asarray(rs.randint(0, cfg.vocab_size, size=(16, 48)), jnp.int32)
  mask = jnp.ones((16, 48), bool)

  def loss(params, tokens, mask):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      logp, _ = sequence_log_probs(graphdef, params, tokens, mask)
    return -jnp.mean(logp)

  rows = NamedSharding(mesh, P(("data", "fsdp")))
  sharded = jax.device_put(state, state_shardings(state, mesh, TRAIN_RULES))
  grad = jax.jit(jax.grad(loss), in_shardings=(state_shardings(state, mesh, TRAIN_RULES),
                                               rows, rows))
  hlo = grad.lower(sharded, tokens, mask).compile().as_text()
  reshuffles = [line for line in hlo.splitlines() if " all-to-all(" in line]
  assert " all-gather(" in hlo or " all-gather-start(" in hlo
  # Only the token-embedding lookup (a gather from the row-split table) may reshuffle.
  assert all("_take" in line for line in reshuffles), reshuffles
  # Finished before the next compile starts: twice in CI on a 2-core Xeon a worker crashed
  # inside jax's cache write of the next program (executable.serialize) while this
  # 4-device program ran; never reproduced alone.
  got = jax.block_until_ready(grad(sharded, jax.device_put(tokens, rows),
                                   jax.device_put(mask, rows)))
  want = jax.jit(jax.grad(loss))(state, tokens, mask)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    assert a.dtype == jnp.float32  # master weights' gradients
    if dtype == "float32":
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    else:  # measured: at most 3.5% of a leaf's largest entry, before and after the change
      assert float(jnp.max(jnp.abs(a - b))) <= 0.1 * float(jnp.max(jnp.abs(b)))


def test_a_bfloat16_step_casts_its_kernels_once_for_all_micro_batches():
  """prepare=compute_kernels: each float32 kernel is cast to bfloat16 once, before the loop
  over micro-batches (cast inside, SmolLM2's bf16 update converted its 106M kernel weights
  once per micro-batch: XLA does not hoist the casts); the step computes the same bits."""
  import functools
  from hflax.models.transformer import compute_kernels
  cfg = CFG.replace(dtype="bfloat16", param_dtype="float32")
  graphdef, state = create(cfg)
  tx = make_optimizer(OptimConfig(lr=1e-2, grad_clip=0.0))
  rng = np.random.RandomState(0)
  rows = {"tokens": jnp.asarray(rng.randint(1, 64, (6, 10)), jnp.int32),
          "mask": jnp.asarray(rng.rand(6, 10) > 0.2)}

  def loss(params, r, kernels=None):
    logp, _ = sequence_log_probs(graphdef, params, r["tokens"], r["mask"],
                                 compute_kernels=kernels)
    return -jnp.sum(logp * r["mask"]), {}

  kernels = compute_kernels(graphdef, state)
  dense = 7 * cfg.num_layers + (not cfg.tie_word_embeddings)  # q, k, v, o, gate, up, down; head
  assert len(kernels) == dense
  assert all(k.dtype == jnp.bfloat16 for k in kernels.values())
  assert compute_kernels(*create(CFG)) == {}  # float32 compute: nothing to cast
  shapes = {k.shape for k in kernels.values()}
  once = make_train_step(loss, tx, 3, prepare=functools.partial(compute_kernels, graphdef))
  each = make_train_step(loss, tx, 3)
  opt = tx.init(state)
  assert bfloat16_casts(jax.make_jaxpr(once)(state, opt, rows).jaxpr, shapes) == (dense, 0)
  outside, inside = bfloat16_casts(jax.make_jaxpr(each)(state, opt, rows).jaxpr, shapes)
  assert outside == 0 and inside >= dense
  got, want = jax.jit(once)(state, opt, rows), jax.jit(each)(state, opt, rows)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
