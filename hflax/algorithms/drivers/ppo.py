"""PPO (actor, critic, reference, reward): the HybridFlow paper's dataflow."""
from hflax.algorithms.drivers.common import Roles, StepState, compute_advantage


def step(roles: Roles, prompts, cfg, state: StepState):
  actor, critic = roles.actor, roles.critic
  batch = actor.generate_sequences(prompts)
  batch = batch.union(roles.reward.compute_reward(batch))
  batch = batch.union(actor.old_log_probs(batch))
  if roles.ref is not None:
    batch = batch.union(roles.ref.compute_ref_log_prob(batch))
  batch = batch.union(critic.compute_values(batch))
  batch = compute_advantage(batch, cfg.algorithm, state, len(batch))
  batch = batch.union(critic.update_critic(batch))
  if state.step >= cfg.trainer.get("critic_warmup", 0):
    batch = batch.union(actor.update_actor(batch))
  return batch
