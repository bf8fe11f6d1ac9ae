"""DAPO: GRPO with clip-higher and token-level loss (both config), overlong reward shaping,
and dynamic sampling: groups whose samples all got the same reward carry no signal, so
they are dropped and more prompts are generated until the batch is full. The filter reads
the reward before overlong shaping (the paper's accuracy; verl's filter_groups.metric=acc):
a group that is all wrong stays dropped even when its lengths differ."""
import numpy as np

from hflax import algorithms as alg
from hflax.algorithms.drivers.common import StepConfig, StepState, compute_advantage
from hflax.algorithms.drivers.registry import (Algorithm, needs_samples_per_group,
                                               register_algorithm)
from hflax.controller.roles import Roles
from hflax.controller.batch import Batch


def step(roles: Roles, prompt_batches, cfg: StepConfig, state: StepState):
  actor, n, want = roles.actor, roles.actor.sampling.n, cfg.train_batch_size
  kept, groups, rounds = [], 0, 0
  while groups < want:
    rounds += 1
    if rounds > cfg.algorithm.get("max_num_gen_batches", 8):
      raise RuntimeError(f"DAPO dynamic sampling found only {groups} of {want} prompt groups "
                         f"with varied rewards after {rounds - 1} generation rounds "
                         "(algorithm.max_num_gen_batches)")
    batch = actor.generate_sequences(next(prompt_batches))
    batch = batch.union(roles.reward.compute_reward(batch))
    varied = np.asarray(alg.samples_in_groups_with_variance(
        batch["token_level_scores"].sum(axis=1), batch["group_ids"], len(batch) // n))
    kept.append(_regroup(_overlong_shaping(batch, cfg).map_rows(np.flatnonzero(varied)),
                         offset=groups))
    groups += int(varied.sum()) // n
  batch = Batch.concat(kept)
  batch = batch.slice(0, want * n)
  batch.meta.setdefault("metrics", {})["train/num_gen_batches"] = rounds
  batch = batch.union(actor.old_log_probs(batch))
  if roles.ref is not None:
    batch = batch.union(roles.ref.compute_ref_log_prob(batch))
  batch = compute_advantage(batch, cfg.algorithm, state, len(batch))
  return batch.union(actor.update_actor(batch))


ALGORITHM = register_algorithm(Algorithm(
    name="dapo", step=step, takes_prompt_iterator=True,
    check=needs_samples_per_group(("grpo", "rloo", "reinforce_plus_plus_baseline"))))


def _overlong_shaping(batch: Batch, cfg) -> Batch:
  shaping = cfg.algorithm.get("overlong_buffer_len", 0)
  if not shaping:
    return batch
  penalty = alg.overlong_penalty(batch["response_length"], cfg.max_response_length,
                                 shaping, cfg.algorithm.get("overlong_penalty_factor", 1.0))
  last = batch["response_mask"].sum(axis=1).astype(np.int32) - 1
  onehot = np.arange(batch["response_mask"].shape[1])[None, :] == np.asarray(last)[:, None]
  shaped = batch["token_level_scores"] + np.asarray(penalty)[:, None] * onehot
  return Batch({**batch.arrays, "token_level_scores": shaped}, batch.objects, batch.meta)


def _regroup(batch: Batch, offset: int) -> Batch:
  """Group ids 0, 1, ... in order, from `offset` (the groups kept in earlier rounds), so
  they stay unique and below the group count once the rounds are concatenated."""
  ids = np.unique(np.asarray(batch["group_ids"]), return_inverse=True)[1] + offset
  return Batch({**batch.arrays, "group_ids": ids.astype(np.int32)}, batch.objects, batch.meta)
