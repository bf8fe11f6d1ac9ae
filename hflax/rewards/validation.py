"""Held-out metrics over N samples per prompt, under verl's names.

Rows i*N .. i*N + N - 1 hold prompt i's N samples (as generate_sequences returns them).
Per data source, each metric is computed per prompt and averaged over prompts:

  val-core/{source}/acc/mean@N        mean score
  val-aux/{source}/acc/std@N          spread of a prompt's N scores (N > 1)
  val-core/{source}/acc/best@N/mean   best of the N scores (pass@N for 0/1 scores)
  val-aux/{source}/acc/best@k/mean    expected best of k samples, k = 2, 4, 8, ... < N,
                   .../best@k/std     and its spread over the k-subsets; worst@k alike
  val-core/{source}/acc/maj@N/mean    score of the answer most samples give (when the
                                      reward says what each sample answered)

best@k and worst@k are exact: the mean over every k-subset of a prompt's N samples, which
for 0/1 scores is the unbiased pass@k estimator (Chen et al., 2021). verl estimates them by
a bootstrap that draws with replacement, so its best@N repeats samples and falls below the
best of the N. maj@N votes over all N samples as verl does: giving no answer (None) is a
vote too, and a tie goes to the answer given first. Answers that cannot be hashed (a list)
vote by their repr.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from math import comb
from typing import Sequence

import numpy as np


def subset_order_weights(n: int, k: int) -> np.ndarray:
  """w[i]: the chance that the (i+1)-th smallest of n values is the largest of a random
  k-subset (C(i, k-1) / C(n, k)); reversed, the chance it is the smallest."""
  if not 1 <= k <= n:
    raise ValueError(f"subset size k={k} must be in [1, {n}]")
  total = comb(n, k)
  return np.array([comb(i, k - 1) / total for i in range(n)])


def best_of_k(scores_PxN: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
  """Per prompt: mean and std of the best score over all k-subsets of its N samples."""
  weights = subset_order_weights(scores_PxN.shape[1], k)
  ascending = np.sort(scores_PxN, axis=1)
  mean = ascending @ weights
  return mean, np.sqrt(np.maximum(ascending ** 2 @ weights - mean ** 2, 0.0))


def _ballot(pred):
  try:
    hash(pred)
    return pred
  except TypeError:
    return repr(pred)


def majority_score(scores_N: Sequence[float], preds_N: Sequence) -> float:
  """The score of the first sample giving the most common answer."""
  ballots = [_ballot(p) for p in preds_N]
  votes = Counter(ballots)
  winner = max(votes, key=votes.get)  # Counter keeps first-seen order: ties go to the first
  return float(scores_N[ballots.index(winner)])


def subset_sizes(n: int) -> list[int]:
  sizes, k = [], 2
  while k < n:
    sizes.append(k)
    k *= 2
  return sizes + [n]


def validation_metrics(scores, data_sources: Sequence[str], samples_per_prompt: int = 1,
                       preds: Sequence | None = None) -> dict[str, float]:
  """{val-core|val-aux}/{data_source}/acc/{metric}: see the module docstring."""
  n = samples_per_prompt
  scores = np.asarray(scores, np.float64).reshape(-1)
  if len(scores) != len(data_sources):
    raise ValueError(f"{len(scores)} scores for {len(data_sources)} data sources")
  if n < 1 or len(scores) % n:
    raise ValueError(f"{len(scores)} scores do not split into groups of "
                     f"samples_per_prompt={n}")
  preds = [None] * len(scores) if preds is None else list(preds)
  if len(preds) != len(scores):
    raise ValueError(f"{len(preds)} predictions for {len(scores)} scores")
  prompts = defaultdict(list)  # data source -> row indices of its prompts' first samples
  for start in range(0, len(scores), n):
    group = set(data_sources[start:start + n])
    if len(group) != 1:
      raise ValueError(f"rows {start}..{start + n - 1} are one prompt's samples but have "
                       f"data sources {sorted(group)}")
    prompts[data_sources[start]].append(start)
  out = {}
  for source, starts in sorted(prompts.items()):
    rows = np.asarray(starts)[:, None] + np.arange(n)
    group_scores = scores[rows]
    core, aux = f"val-core/{source}/acc", f"val-aux/{source}/acc"
    out[f"{core}/mean@{n}"] = float(group_scores.mean())
    if n == 1:
      continue
    out[f"{aux}/std@{n}"] = float(group_scores.std(axis=1).mean())
    for k in subset_sizes(n):
      section = core if k == n else aux
      best, best_std = best_of_k(group_scores, k)
      worst, worst_std = best_of_k(-group_scores, k)
      out[f"{section}/best@{k}/mean"] = float(best.mean())
      out[f"{aux}/worst@{k}/mean"] = float(-worst.mean()) + 0.0  # + 0.0: no "-0.0"
      if k < n:  # with every sample taken there is one subset: no spread
        out[f"{aux}/best@{k}/std"] = float(best_std.mean())
        out[f"{aux}/worst@{k}/std"] = float(worst_std.mean())
    if any(preds[r] is not None for r in rows.reshape(-1)):
      out[f"{core}/maj@{n}/mean"] = float(np.mean(
          [majority_score(scores[r], [preds[i] for i in r]) for r in rows]))
  return out
