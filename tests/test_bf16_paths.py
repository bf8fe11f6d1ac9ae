"""bfloat16 compute over float32 master weights in the actor worker: log-probs near fp32's,
and the first mini-batch exactly on-policy through the real update path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_step import CFG, SAMPLING, actor_loss, prompts_batch
from hflax.controller.batch import Batch
from hflax.controller.training import OptimConfig, UpdateConfig
from hflax.controller.actor import ActorRolloutWorker
from hflax.models import create
from hflax.sharding.placement import build_placement, colocated


def actor(dtype: str, devices: int = 1, update=None) -> ActorRolloutWorker:
  placed = build_placement(colocated(["actor"], devices))
  home = jax.sharding.SingleDeviceSharding(placed["actor"].pool.devices[0])
  cfg = CFG.replace(dtype=dtype, param_dtype="float32")
  return ActorRolloutWorker(placed["actor"], *create(cfg, seed=0), sampling=SAMPLING,
                            loss_fn=actor_loss, optim=OptimConfig(lr=1e-2, grad_clip=1.0),
                            update=update or UpdateConfig(mini_batch_size=8, micro_batch_size=4,
                                                          epochs=2), home=home)


@pytest.fixture(scope="module")
def rollout():
  """One fp32 rollout: the sequences both precisions score."""
  return actor("float32").generate_sequences(prompts_batch())


def test_bf16_log_probs_within_bf16_tolerance_of_fp32(rollout):
  fp32 = actor("float32").compute_log_prob(rollout)["old_log_probs"]
  bf16 = actor("bfloat16").compute_log_prob(rollout)["old_log_probs"]
  mask = np.asarray(rollout["response_mask"], bool)
  assert bf16.dtype == jnp.float32  # log-softmax is taken in fp32 even over bf16 matmuls
  diff = np.abs(np.asarray(bf16) - np.asarray(fp32))[mask]
  # bf16 keeps 8 mantissa bits: |log p| ~ log(64) ~ 4 rounds by ~0.016 per op, a few ops deep.
  assert diff.max() < 0.1, diff.max()
  assert diff.mean() < 0.02, diff.mean()
  assert diff.max() > 0  # the bf16 path really computed in bf16


def bf16_update(devices: int, update=None):
  """A bf16 actor's rollout, its recomputed old log-probs and one update; the metrics."""
  worker = actor("bfloat16", devices, update)
  assert worker.recompute_log_prob  # the KV-cache decode rounds otherwise than a full pass
  batch = worker.generate_sequences(prompts_batch())
  batch = batch.union(worker.old_log_probs(batch))
  rollout_lp = np.asarray(batch["rollout_log_probs"])
  mask = np.asarray(batch["response_mask"], bool)
  # Why the separate pass is needed: the sampler's own bf16 log-probs differ.
  assert np.abs(np.asarray(batch["old_log_probs"]) - rollout_lp)[mask].max() > 0
  rs = np.random.RandomState(0)
  advantages = jnp.asarray(rs.randn(*mask.shape).astype(np.float32)) * batch["response_mask"]
  batch = batch.union(Batch({"advantages": advantages}))
  metrics = worker.update_actor(batch).meta["metrics"]
  # Later mini-batches/epochs move off-policy: the metric is not zero by construction.
  assert float(metrics["actor/ppo_kl"]) != 0.0
  return {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize("devices", [1, 2])
def test_bf16_first_minibatch_exactly_on_policy(devices):
  # The first mini-batch trains on the very policy that scored it, and its loss takes the
  # update's own forward as the behaviour policy: exactly 0, whatever the compiler options
  # of the log-prob pass (without YNN fusions) and of the training step (with them).
  metrics = bf16_update(devices)
  assert metrics["actor/ppo_kl_first_minibatch"] == 0.0
  assert metrics["actor/pg_clipfrac_first_minibatch"] == 0.0


def test_bf16_first_minibatch_exactly_on_policy_with_fast_math_compiled(monkeypatch):
  # The suite compiles at LLVM level 0 (conftest), where the bf16 step's fast-math
  # reassociation does nothing; at the default level a fusion XLA duplicates could round
  # the behaviour log-probs apart from the trained ones. They stay equal.
  import hflax.controller.update_engine as workers  # where the training steps compile
  plain = workers.train_compiler_options
  monkeypatch.setattr(workers, "train_compiler_options", lambda devices, dtype: {
      **(plain(devices, dtype) or {}), "xla_backend_optimization_level": 3})
  metrics = bf16_update(1)
  assert metrics["actor/ppo_kl_first_minibatch"] == 0.0
  assert metrics["actor/pg_clipfrac_first_minibatch"] == 0.0


def test_bf16_one_step_per_batch_skips_the_old_log_prob_pass(monkeypatch):
  # One optimizer step per batch: nothing else reads recomputed old log-probs, so the
  # separate pass is not run (as TRL), and the step is still exactly on-policy.
  worker = actor("bfloat16", 1, UpdateConfig(mini_batch_size=16, micro_batch_size=8))
  batch = worker.generate_sequences(prompts_batch())
  assert len(batch) == 16
  calls = []
  monkeypatch.setattr(worker, "compute_log_prob", lambda b: calls.append(b))
  batch = batch.union(worker.old_log_probs(batch))
  assert calls == []
  mask = batch["response_mask"]
  advantages = jnp.asarray(np.random.RandomState(0).randn(*mask.shape).astype(np.float32)) * mask
  metrics = worker.update_actor(batch.union(Batch({"advantages": advantages}))).meta["metrics"]
  assert float(metrics["actor/ppo_kl"]) == 0.0
  assert float(metrics["actor/pg_clipfrac"]) == 0.0
  # A KL penalty in the reward reads the old log-probs: then the pass runs.
  worker.old_log_probs_in_reward = True
  worker.old_log_probs(batch)
  assert len(calls) == 1


def test_swiglu_rounds_once_to_bf16_and_differentiates_as_float32():
  """The MLP's silu(gate) * up in bfloat16: the float32 result rounded once (closer to
  float32 than rounding each step), the float32 form's gradient, and float32 unchanged."""
  from hflax.models.transformer import swiglu
  rs = np.random.RandomState(0)
  gate, up = (jnp.asarray(rs.normal(size=(16, 96)) * 3, jnp.float32) for _ in range(2))
  wide = lambda g, u: jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)  # noqa: E731
  g16, u16 = gate.astype(jnp.bfloat16), up.astype(jnp.bfloat16)
  got = jax.jit(swiglu)(g16, u16)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got, np.float32),
                                np.asarray(wide(g16, u16).astype(jnp.bfloat16), np.float32))
  stepwise = jax.nn.silu(g16) * u16  # every step rounded to bfloat16
  exact = wide(g16, u16)
  assert (float(jnp.abs(got.astype(jnp.float32) - exact).max())
          < float(jnp.abs(stepwise.astype(jnp.float32) - exact).max()))
  cotangent = jnp.asarray(rs.normal(size=(16, 96)), jnp.bfloat16)
  grads = jax.vjp(swiglu, g16, u16)[1](cotangent)
  want = jax.vjp(lambda g, u: wide(g, u).astype(jnp.bfloat16), g16, u16)[1](cotangent)
  for a, b in zip(grads, want):
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
  np.testing.assert_array_equal(swiglu(gate, up), jax.nn.silu(gate) * up)
