"""bfloat16 compute over float32 master weights in the actor worker: log-probs near fp32's,
and the first mini-batch exactly on-policy through the real update path."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_step import CFG, SAMPLING, actor_loss, prompts_batch
from hflax.controller.batch import Batch
from hflax.controller.training import OptimConfig, UpdateConfig
from hflax.controller.workers import ActorRolloutWorker
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
def test_bf16_first_minibatch_on_policy_within_rounding(devices):
  metrics = bf16_update(devices)
  # The first mini-batch trains on the very policy that scored it: nothing is clipped and
  # the KL is bf16 rounding (measured 3e-5..1.2e-4), far below a step's (lr 1e-2) effect.
  assert abs(metrics["actor/ppo_kl_first_minibatch"]) < 1e-3
  assert metrics["actor/pg_clipfrac_first_minibatch"] == 0.0


def test_bf16_first_minibatch_ppo_kl_exactly_zero_with_one_dot_backend(monkeypatch):
  # With one dot backend for both programs the update's first forward repeats the
  # log-prob pass bit for bit, as long as its micro-batches are not narrower than 8 rows
  # (micro-batches of 4 rows gave -1e-8: Eigen blocks a [4*T, D] dot otherwise).
  monkeypatch.setenv("HFLAX_CPU_YNN", "0")
  update = UpdateConfig(mini_batch_size=8, micro_batch_size=8, epochs=2)
  assert bf16_update(1, update)["actor/ppo_kl_first_minibatch"] == 0.0


@pytest.mark.xfail(strict=True, reason=(
    "hflax/controller/training.py compiles CPU training steps with YNNPACK dot fusions "
    "(train_compiler_options) and log-prob passes without; the two round bf16 dots "
    "differently, so the first mini-batch's ppo_kl is 3e-5..1.2e-4 instead of 0 (compiling "
    "the log-prob pass with the same options still leaves 6e-6..1e-4: the fusions differ "
    "between a forward and a forward+backward program). See the bench report's fix"))
def test_bf16_first_minibatch_ppo_kl_exactly_zero_default_options():
  assert bf16_update(1)["actor/ppo_kl_first_minibatch"] == 0.0
