"""Packing plans: the valid tokens of left-padded rows laid end to end in fewer, shorter rows.

A rollout row is [prompt (left-padded) | response (right-padded)]; with unequal response
lengths most of it can be padding. A plan (host-side numpy, from the attention mask
alone) says which token of the batch goes where in the packed rows, which sequence
(segment) it belongs to, and where each response token's log-prob is read back, so
results come back in the [rows, response_width] layout the losses use.

Shapes are bucketed (a few row counts and lengths) so a run compiles a bounded number
of programs however its lengths vary.
"""
from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class PackedPlan:
  token_index: np.ndarray  # [R, L] int32: flat index (row * T + column) of the batch token there
  segment_ids: np.ndarray  # [R, L] int32: 0 padding, k the k-th sequence of that packed row
  positions: np.ndarray  # [R, L] int32: the token's position within its sequence
  seq_start: np.ndarray  # [B] int32: flat packed index (r * L + l) of each sequence's first token
  member: np.ndarray  # [B] bool: the batch rows this plan holds

  @property
  def tokens(self) -> int:
    return int(np.count_nonzero(self.segment_ids))

  @property
  def computed(self) -> int:
    return int(self.segment_ids.size)

  def arrays(self) -> dict:
    """What a device program takes: the packed rows and two [B] maps (the [B, W] layout
    is rebuilt there by response_layout, so no per-plan [B, W] array is sent)."""
    return {"token_index": self.token_index, "segment_ids": self.segment_ids,
            "seq_start": self.seq_start, "member": self.member}


def response_layout(mask_BxT, response_width: int, seq_start_B, member_B):
  """([B, W] flat packed index of each response token, [B, W] whether it is scored), in
  jnp (inside a program, or on host arrays). A token's place in its packed sequence is
  its rank among its row's valid tokens; scored as the padded path scores: the token and
  the one before it valid."""
  mask = jnp.asarray(mask_BxT).astype(bool)
  T, W = mask.shape[1], response_width
  rank = jnp.cumsum(mask.astype(jnp.int32), axis=1)[:, T - W:] - 1
  scored = mask[:, T - W:] & mask[:, T - W - 1:T - 1] & jnp.asarray(member_B)[:, None]
  index = jnp.asarray(seq_start_B, jnp.int32)[:, None] + jnp.maximum(rank, 0)
  return jnp.where(scored, index, 0), scored


def bucket(n: int, cap: int | None = None, quantum: int = 16) -> int:
  """The smallest size of {q 2^k, 1.5 q 2^k} holding n (padding under a third), at most cap."""
  size = quantum
  while size < n:
    half = size + size // 2
    if half >= n:
      size = half
      break
    size *= 2
  return size if cap is None else max(min(size, cap), n)


def row_bucket(n: int, multiple: int) -> int:
  """Packed row counts: `multiple` (the data-parallel size) times a power of two."""
  k = 1
  while k * multiple < n:
    k *= 2
  return k * multiple


def sequence_lengths(mask_BxT) -> np.ndarray:
  return np.asarray(mask_BxT).astype(bool).sum(axis=1)


def check_budget(lengths, budget: int, field: str):
  longest = int(np.max(lengths, initial=0))
  if budget < longest:
    raise ValueError(f"{field}: {budget} tokens is less than the longest sequence "
                     f"({longest} tokens); raise it to at least {longest}")


def first_fit_decreasing(lengths, capacity: int, rows=None, field: str = "token budget"):
  """Bins (lists of row indices) of total length <= capacity, longest sequences first."""
  rows = np.arange(len(lengths)) if rows is None else np.asarray(rows)
  lengths = np.asarray(lengths)
  check_budget(lengths[rows], capacity, field)
  bins, fill = [], np.zeros(len(rows), np.int64)  # never more bins than sequences
  for row in rows[np.argsort(-lengths[rows], kind="stable")].tolist():
    size = int(lengths[row])
    fits = np.flatnonzero(fill[:len(bins)] <= capacity - size)  # a vector op per sequence
    b = int(fits[0]) if len(fits) else len(bins)
    if b == len(bins):
      bins.append([])
    bins[b].append(row)
    fill[b] += size
  return bins


def pack(mask_BxT, bins, *, rows: int | None = None, length: int | None = None) -> PackedPlan:
  """Packed row r holds the sequences of bins[r] in order, each row padded to `length`
  (default: the longest), `rows` rows in all (default: len(bins))."""
  mask = np.asarray(mask_BxT, bool)
  B, T = mask.shape
  fills = [int(sum(np.count_nonzero(mask[b]) for b in one)) for one in bins]
  rows = len(bins) if rows is None else rows
  length = max(fills, default=1) if length is None else length
  if rows < len(bins) or length < max(fills, default=0):
    raise ValueError(f"pack: {len(bins)} bins up to {max(fills, default=0)} tokens do not fit "
                     f"{rows} rows of {length}")
  token_index = np.zeros((rows, length), np.int32)
  segment_ids = np.zeros((rows, length), np.int32)
  positions = np.zeros((rows, length), np.int32)
  seq_start = np.zeros(B, np.int32)
  member = np.zeros(B, bool)
  for r, seqs in enumerate(bins):
    at = 0
    for k, b in enumerate(seqs, start=1):
      cols = np.flatnonzero(mask[b])
      n = len(cols)
      token_index[r, at:at + n] = b * T + cols
      segment_ids[r, at:at + n] = k
      positions[r, at:at + n] = np.arange(n)
      seq_start[b], member[b] = r * length + at, True
      at += n
  return PackedPlan(token_index, segment_ids, positions, seq_start, member)


def micro_batch_plans(mask_BxT, *, multiple: int, budget: int = 0,
                      groups=None, row_cap: int | None = None,
                      field: str = "ppo_max_token_len_per_gpu") -> list[PackedPlan]:
  """Plans of a batch's micro-batches.

  With `budget` (verl's use_dynamic_bsz): micro-batches cut by tokens, each `multiple`
  rows (one per data-parallel device) of at most `budget` tokens. Otherwise one plan per
  group of rows (default: all rows), packed into rows of at most `row_cap` tokens
  (default the padded width T, so no packed row is longer than a padded one).
  """
  mask = np.asarray(mask_BxT, bool)
  lengths = sequence_lengths(mask)
  # Rows with no token (padding rows of a batch) are left out: nothing to compute.
  groups = [np.arange(len(mask))] if groups is None else groups
  groups = [np.asarray(g, int)[lengths[np.asarray(g, int)] > 0] for g in groups]
  if budget:
    bins = first_fit_decreasing(lengths, budget, np.concatenate(groups), field)
    cuts = [bins[i:i + multiple] for i in range(0, len(bins), multiple)]
    return [pack(mask, cut, rows=multiple,
                 length=bucket(max(sum(int(lengths[b]) for b in one) for one in cut), budget))
            for cut in cuts]
  cap = row_cap or mask.shape[1]
  plans = []
  for group in groups:
    bins = first_fit_decreasing(lengths, cap, group, field)
    fill = max((sum(int(lengths[b]) for b in one) for one in bins), default=1)
    plans.append(pack(mask, bins, rows=row_bucket(len(bins), multiple), length=bucket(fill, cap)))
  return plans


def unpack(packed_RxL, plan: PackedPlan, mask_BxT, response_width: int, fill=0):
  """Per-token values of packed rows back at their response positions [B, W] (numpy)."""
  index, scored = map(np.asarray, response_layout(mask_BxT, response_width, plan.seq_start,
                                                  plan.member))
  return np.where(scored, np.asarray(packed_RxL).reshape(-1)[index], fill)
