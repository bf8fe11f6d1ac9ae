"""ReMax: one extra greedy generation per prompt is the baseline; no critic."""
import dataclasses

import jax.numpy as jnp

from hflax.algorithms.drivers.common import StepConfig, StepState, compute_advantage
from hflax.algorithms.drivers.registry import Algorithm, register_algorithm
from hflax.controller.roles import Roles
from hflax.controller.batch import Batch


def step(roles: Roles, prompts, cfg: StepConfig, state: StepState):
  actor = roles.actor
  batch = actor.generate_sequences(prompts)
  greedy = dataclasses.replace(actor.sampling, temperature=0.0, n=1)
  baseline = roles.reward.compute_reward(actor.generate_sequences(prompts, sampling=greedy))
  baseline_scores = jnp.repeat(baseline["token_level_scores"].sum(axis=1), actor.sampling.n)
  batch = batch.union(Batch({"reward_baselines": baseline_scores}))
  batch = batch.union(roles.reward.compute_reward(batch))
  batch = batch.union(actor.old_log_probs(batch))
  if roles.ref is not None:
    batch = batch.union(roles.ref.compute_ref_log_prob(batch))
  batch = compute_advantage(batch, cfg.algorithm, state, len(batch))
  return batch.union(actor.update_actor(batch))


ALGORITHM = register_algorithm(Algorithm(name="remax", step=step))
