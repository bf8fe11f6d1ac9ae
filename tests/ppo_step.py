"""A PPO-shaped step over role workers, shared by the controller tests."""
import jax
import jax.numpy as jnp
import numpy as np

from hflax.algorithms import (aggregate_loss, apply_kl_penalty, gae_advantage, ppo_clip_loss,
                              value_loss)
from hflax.controller.batch import Batch
from hflax.controller.training import OptimConfig, UpdateConfig
from hflax.controller.actor import ActorRolloutWorker
from hflax.controller.workers import CriticWorker, ReferenceWorker, RewardModelWorker
from hflax.models import ModelConfig, create
from hflax.rollout import SamplingParams, left_pad
from hflax.sharding.placement import build_placement

CFG = ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2)
SAMPLING = SamplingParams(max_new_tokens=8, temperature=1.0, n=2, eos_ids=(5,), pad_id=0)


def actor_loss(logp, entropy, f):
  loss, metrics = ppo_clip_loss(logp, f["old_log_probs"], f["advantages"], f["response_mask"])
  metrics["entropy"] = aggregate_loss(entropy, f["response_mask"])
  return aggregate_loss(loss, f["response_mask"]), metrics


def critic_loss(values, f):
  loss, metrics = value_loss(values, f["values"], f["returns"], f["response_mask"])
  return aggregate_loss(loss, f["response_mask"]), metrics


def build_workers(placement_spec, devices=None, update=None):
  placed = build_placement(placement_spec, devices)
  home = jax.sharding.SingleDeviceSharding(placed["actor"].pool.devices[0])
  policy = create(CFG, seed=0)
  value = create(CFG, seed=1, head="value")
  reward = create(CFG, seed=2, head="value")
  update = update or UpdateConfig(mini_batch_size=16, micro_batch_size=8, epochs=2)
  optim = OptimConfig(lr=1e-2, grad_clip=1.0)
  return dict(
      actor=ActorRolloutWorker(placed["actor"], *policy, sampling=SAMPLING, loss_fn=actor_loss,
                               optim=optim, update=update, home=home),
      ref=ReferenceWorker(placed["ref"], *policy, home=home),
      critic=CriticWorker(placed["critic"], *value, loss_fn=critic_loss, optim=optim,
                          update=update, home=home),
      reward=RewardModelWorker(placed["reward"], *reward, home=home))


def prompts_batch(count=8, seed=0):
  rs = np.random.RandomState(seed)
  tokens, mask = left_pad([rs.randint(6, 64, size=rs.randint(2, 7)).tolist()
                           for _ in range(count)], 0)
  return Batch({"prompts": jnp.asarray(tokens), "prompt_mask": jnp.asarray(mask)})


def ppo_step(w, prompts):
  actor, ref, critic, reward = w["actor"], w["ref"], w["critic"], w["reward"]
  batch = actor.generate_sequences(prompts)
  batch = batch.union(reward.compute_reward(batch))
  batch = batch.union(actor.compute_log_prob(batch))
  batch = batch.union(ref.compute_ref_log_prob(batch))
  batch = batch.union(critic.compute_values(batch))
  rewards, kl = apply_kl_penalty(batch["token_level_scores"], batch["old_log_probs"],
                                 batch["ref_log_prob"], batch["response_mask"], 0.05)
  advantages, returns = gae_advantage(rewards, batch["values"], batch["response_mask"], 1.0, 0.95)
  batch = batch.union(Batch({"advantages": advantages, "returns": returns}))
  batch = batch.union(critic.update_critic(batch)).union(actor.update_actor(batch))
  return batch, {"critic/kl": kl, **batch.meta["metrics"]}
