"""GRPO: n samples per prompt, group-normalised outcome advantages, KL as a loss, no critic.
With a teacher (distill.teacher_path) it is on-policy distillation: the teacher's per-token
log-probs on the samples give the advantages (hflax.algorithms.distill).

RLOO and REINFORCE++ are this loop with another advantage estimator (see their modules).
"""
from hflax.algorithms.drivers.common import (StepConfig, StepState, apply_distillation,
                                             compute_advantage)
from hflax.algorithms.drivers.registry import (Algorithm, needs_samples_per_group,
                                               register_algorithm)
from hflax.controller.roles import Roles


def step(roles: Roles, prompts, cfg: StepConfig, state: StepState):
  actor = roles.actor
  batch = actor.generate_sequences(prompts)
  batch = batch.union(roles.reward.compute_reward(batch))
  batch = batch.union(actor.old_log_probs(batch))
  if roles.ref is not None:
    batch = batch.union(roles.ref.compute_ref_log_prob(batch))
  if roles.teacher is not None:  # on-policy distillation
    batch = batch.union(roles.teacher.compute_teacher_log_prob(batch))
  batch = compute_advantage(batch, cfg.algorithm, state, len(batch))
  batch = apply_distillation(batch, cfg.distill)
  return batch.union(actor.update_actor(batch))


ALGORITHM = register_algorithm(Algorithm(
    name="grpo", step=step,
    check=needs_samples_per_group(("grpo", "rloo", "reinforce_plus_plus_baseline"))))
