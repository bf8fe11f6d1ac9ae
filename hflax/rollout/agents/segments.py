"""Trajectories whose history is not append-only, as segments that share a prefix.

Some chat templates rewrite what came before: Qwen3's drops the <think> reasoning of
earlier assistant turns when it renders a later one, and a compacting agent replaces old
turns by a summary. The context of such a turn is then not the previous context plus
what followed it, so one row of ids cannot hold the trajectory. Each stretch that is
append-only (the contexts from one rewrite to the next, with the turns sampled in them)
is a segment: a Trajectory of its own, holding the exact ids its turns were sampled
from, its model tokens, their log-probs and versions. The agent loop makes them itself
(AgentLoop's rewrite_history, or an environment's Observation.context): a trajectory's
`segments` are its earlier ones, and trajectory_rows turns its trajectories into rows.

For training, a trajectory's segments become rows whose "prompt" is the prefix all of
them share (typically the system prompt, the tools and the question) and whose
"response" is the rest of each. Rows with the same prompt in one micro-batch are packed
with the prompt once and each rest attending to it (hflax.controller.packing, as GRPO's
n samples of a prompt are), so the shared prefix is computed once and its gradient sums
every segment's contribution: the tokens and gradients of each segment computed on its
own, without the repeated prefix (tests/test_rollout_agents.py).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

from hflax.rollout.agents.loop import Trajectory


def shared_prefix(segments: Sequence[Trajectory]) -> int:
  """The length of the prefix every segment starts with, cut before any segment's first
  model token (a trained token must be scored in its own segment, never in a prompt) and
  so that every segment keeps a token after it."""
  ids = [s.token_ids for s in segments]
  n = min(len(x) for x in ids) - 1
  for s in segments:
    if any(s.model_mask):
      n = min(n, s.model_mask.index(True))
  k = 0
  while k < n and all(x[k] == ids[0][k] for x in ids):
    k += 1
  return k


def segment_rows(trajectories: Sequence[Sequence[Trajectory]]) -> tuple[list[Trajectory], list[int]]:
  """One row per segment (a Trajectory whose prompt is its trajectory's shared prefix),
  in order, and each row's trajectory index (for advantages: a trajectory's reward is
  every one of its segments'). An append-only trajectory is a single segment and keeps
  its own prompt. to_batch_fields takes the rows as it takes trajectories."""
  rows, owner = [], []
  for i, segments in enumerate(trajectories):
    if not segments:
      raise ValueError(f"trajectory {i} has no segments")
    cut = segments[0].prompt_len if len(segments) == 1 else shared_prefix(segments)
    for s in segments:
      if len(s.model_mask) != len(s.token_ids):
        raise ValueError(f"trajectory {i}: a segment's mask and ids differ in length")
      rows.append(dataclasses.replace(s, index=i, prompt_len=cut, token_ids=list(s.token_ids),
                                      model_mask=list(s.model_mask),
                                      log_probs=list(s.log_probs), versions=list(s.versions),
                                      segments=[]))
      owner.append(i)
  return rows, owner


def trajectory_rows(trajectories: Sequence[Trajectory]) -> tuple[list[Trajectory], list[int]]:
  """segment_rows of the agent loop's trajectories (each one's earlier segments, then
  itself): the training rows and each row's trajectory. A trajectory the loop kept
  append-only is its one row, as to_batch_fields takes it."""
  return segment_rows([list(t.segments) + [t] for t in trajectories])
