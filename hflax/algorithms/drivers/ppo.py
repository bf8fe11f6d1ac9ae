"""PPO (actor, critic, reference, reward): the HybridFlow paper's dataflow."""
from hflax.algorithms.drivers.common import StepConfig, StepState, compute_advantage
from hflax.algorithms.drivers.registry import Algorithm, register_algorithm
from hflax.controller.roles import Roles


def step(roles: Roles, prompts, cfg: StepConfig, state: StepState):
  actor, critic = roles.actor, roles.critic
  batch = actor.generate_sequences(prompts)
  batch = batch.union(roles.reward.compute_reward(batch))
  batch = batch.union(actor.old_log_probs(batch))
  if roles.ref is not None:
    batch = batch.union(roles.ref.compute_ref_log_prob(batch))
  batch = batch.union(critic.compute_values(batch))
  batch = compute_advantage(batch, cfg.algorithm, state, len(batch))
  batch = batch.union(critic.update_critic(batch))
  if state.step >= cfg.critic_warmup:
    batch = batch.union(actor.update_actor(batch))
  return batch


ALGORITHM = register_algorithm(Algorithm(name="ppo", step=step, uses_critic=True))
