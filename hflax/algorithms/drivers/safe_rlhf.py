"""Safe-RLHF (PPO-Lagrangian): PPO plus a cost model and a Lagrange multiplier that grows
while the mean cost exceeds its limit. Reward advantages come from the critic (GAE);
cost advantages are whitened cost returns (REINFORCE++), so no second critic is needed."""

from hflax import algorithms as alg
from hflax.algorithms.drivers.common import StepConfig, StepState, compute_advantage
from hflax.algorithms.drivers.registry import Algorithm, register_algorithm
from hflax.controller.roles import Roles
from hflax.controller.batch import Batch


def step(roles: Roles, prompts, cfg: StepConfig, state: StepState):
  actor, critic = roles.actor, roles.critic
  batch = actor.generate_sequences(prompts)
  batch = batch.union(roles.reward.compute_reward(batch))
  batch = batch.union(roles.cost.compute_reward(batch))  # a reward worker writing costs
  batch = batch.union(actor.old_log_probs(batch))
  if roles.ref is not None:
    batch = batch.union(roles.ref.compute_ref_log_prob(batch))
  batch = batch.union(critic.compute_values(batch))
  batch = compute_advantage(batch, cfg.algorithm, state, len(batch))
  cost_adv, _ = alg.reinforce_plus_plus_advantage(batch["token_level_costs"], batch["response_mask"])
  mean_cost = batch["token_level_costs"].sum(axis=1).mean()
  advantages = alg.safe_rlhf_advantage(batch["advantages"], cost_adv, state.lagrange_lambda)
  state.lagrange_lambda = float(alg.lagrange_update(
      state.lagrange_lambda, mean_cost, cfg.algorithm.cost_limit, cfg.algorithm.lambda_lr,
      max_lambda=cfg.algorithm.lambda_max))
  batch = Batch({**batch.arrays, "advantages": advantages}, batch.objects,
                {**batch.meta, "metrics": {**batch.meta.get("metrics", {}),
                                           "safe/cost/mean": mean_cost,
                                           "safe/lambda": state.lagrange_lambda}})
  batch = batch.union(critic.update_critic(batch))
  return batch.union(actor.update_actor(batch))


ALGORITHM = register_algorithm(Algorithm(name="safe_rlhf", step=step, uses_critic=True,
                                           uses_cost=True))
