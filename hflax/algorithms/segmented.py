"""One advantage per trajectory when a trajectory trains as several rows (segments).

A multi-turn trajectory whose history was rewritten (hflax.rollout.agents.segments) is
several rows, one per segment, but one sample of its prompt: its group (GRPO's n samples)
must count it once, with its score, and every one of its segments must train with that
one advantage. The batch says which rows belong together in `segment_head`: each row's
index of its trajectory's last segment row (the row whose score is the trajectory's),
-1 on rows that only pad the batch.
"""
from __future__ import annotations

from typing import Callable, Mapping

import jax.numpy as jnp
import numpy as np


def trajectory_advantages(estimator: Callable, fields: Mapping, head_B) -> tuple:
  """estimator(fields) -> (advantages, returns), run on the trajectories' last segment
  rows only; each row then gets its trajectory's advantage on its response tokens (0 on
  padding rows). The estimator must give one advantage per sequence (outcome estimators:
  grpo, rloo, reinforce_plus_plus_baseline); one that varies over a sequence's tokens is
  refused, since a segment's tokens have no place in another segment's return."""
  head = np.asarray(head_B)
  rows = head.shape[0]
  own = np.flatnonzero(head == np.arange(rows))
  if len(own) == 0 or ((head >= 0) & (head[np.maximum(head, 0)] != head)).any():
    raise ValueError("segment_head must point every row at a row that points at itself")
  sub = {k: jnp.asarray(v)[own] for k, v in fields.items()}
  advantages, _ = estimator(sub)
  mask = sub["response_mask"].astype(jnp.float32)
  per_trajectory = (advantages * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)
  if not np.allclose(np.asarray(advantages), np.asarray(per_trajectory[:, None] * mask),
                     rtol=1e-6, atol=1e-6):
    raise ValueError("segmented trajectories need one advantage per trajectory; this "
                     "advantage estimator varies over a response's tokens")
  slot = np.zeros(rows, np.int32)
  slot[own] = np.arange(len(own))
  which = jnp.asarray(slot[np.maximum(head, 0)])
  per_row = jnp.where(jnp.asarray(head >= 0), per_trajectory[which], 0.0)
  out = per_row[:, None] * jnp.asarray(fields["response_mask"]).astype(jnp.float32)
  return out, out
