"""Held-out metrics over N samples per prompt, under verl's names.

Rows i*N .. i*N + N - 1 hold prompt i's N samples (as generate_sequences returns them).
Per data source and per variable, each metric is computed per prompt and averaged over
prompts. The variables are `reward` (the scores) and every numeric entry a reward
function returns in its dict beside "score" (verl's reward_extra_info: math_dapo's
`acc`, and `score` itself). The core variable is `acc` when the reward function
returned one, else `reward`, as in verl's trainer (`_val_metrics_update`):

  val-core/{source}/{core}/mean@N        mean
  val-aux/{source}/{var}/std@N           spread of a prompt's N values (N > 1)
  val-core/{source}/{core}/best@N/mean   best of the N (pass@N for 0/1 scores)
  val-aux/{source}/{var}/best@k/mean     expected best of k samples, k = 2, 4, 8, ... < N,
                     .../best@k/std      and its spread over the k-subsets; worst@k alike
  val-core/{source}/{core}/maj@N/mean    value of the answer most samples give (when the
                                         reward says what each sample answered)

Every metric of the other variables (and of the core one at k < N) is under val-aux/.
So a rule returning a number is reported as val-core/{source}/reward/mean@N, and
math_dapo's dict as val-core/{source}/acc/mean@N beside val-aux/{source}/reward/mean@N.

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


def concat_extra_info(parts: Sequence[dict], sizes: Sequence[int]) -> dict[str, list]:
  """The reward_extra_info of several scored batches (`sizes` rows each) as one, a row
  without a variable holding None for it (its data source then reports no such metric)."""
  names = list(dict.fromkeys(name for part in parts for name in part))
  out = {name: [] for name in names}
  for part, size in zip(parts, sizes, strict=True):
    for name in names:
      values = list(part.get(name, [None] * size))
      if len(values) != size:
        raise ValueError(f"reward_extra_info {name!r} has {len(values)} values for {size} rows")
      out[name] += values
  return out


def _variable_metrics(values_PxN: np.ndarray, preds_PxN, core: str, aux: str) -> dict:
  """One variable's metrics for one data source (prompts x samples): see the docstring."""
  n = values_PxN.shape[1]
  out = {f"{core}/mean@{n}": float(values_PxN.mean())}
  if n == 1:
    return out
  out[f"{aux}/std@{n}"] = float(values_PxN.std(axis=1).mean())
  for k in subset_sizes(n):
    section = core if k == n else aux
    best, best_std = best_of_k(values_PxN, k)
    worst, worst_std = best_of_k(-values_PxN, k)
    out[f"{section}/best@{k}/mean"] = float(best.mean())
    out[f"{aux}/worst@{k}/mean"] = float(-worst.mean()) + 0.0  # + 0.0: no "-0.0"
    if k < n:  # with every sample taken there is one subset: no spread
      out[f"{aux}/best@{k}/std"] = float(best_std.mean())
      out[f"{aux}/worst@{k}/std"] = float(worst_std.mean())
  if any(p is not None for row in preds_PxN for p in row):
    out[f"{core}/maj@{n}/mean"] = float(np.mean(
        [majority_score(v, p) for v, p in zip(values_PxN, preds_PxN)]))
  return out


def validation_metrics(scores, data_sources: Sequence[str], samples_per_prompt: int = 1,
                       preds: Sequence | None = None,
                       extra_info: dict[str, Sequence] | None = None) -> dict[str, float]:
  """{val-core|val-aux}/{data_source}/{variable}/{metric}: see the module docstring.

  extra_info: the scorer's reward_extra_info, {variable: one value per row (None: the row
  has none)}; a data source reports a variable only when all its rows have it.
  """
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
  variables = {"reward": list(scores)}
  for name, values in (extra_info or {}).items():
    if name in ("reward", "pred"):  # the scores themselves; the answers votes read
      continue
    if len(values) != len(scores):
      raise ValueError(f"reward_extra_info {name!r} has {len(values)} values for "
                       f"{len(scores)} scores")
    variables[name] = list(values)
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
    preds_PxN = [[preds[i] for i in r] for r in rows]
    present = {}
    for name, values in variables.items():
      picked = [values[i] for i in rows.reshape(-1)]
      if all(v is not None and not isinstance(v, str) for v in picked):
        present[name] = np.asarray(picked, np.float64).reshape(rows.shape)
    core_name = "acc" if "acc" in present else "reward"
    for name, values_PxN in present.items():
      aux = f"val-aux/{source}/{name}"
      core = f"val-core/{source}/{name}" if name == core_name else aux
      out.update(_variable_metrics(values_PxN, preds_PxN, core, aux))
  return out
