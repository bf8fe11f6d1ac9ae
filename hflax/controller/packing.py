"""Packing plans: the valid tokens of left-padded rows laid end to end in a few long rows.

A rollout row is [prompt (left-padded) | response (right-padded)]; with unequal response
lengths most of it can be padding. A plan (host-side numpy, from the attention mask
alone) says which token of the batch goes where in the packed rows, which sequence
(segment) it belongs to, and which batch rows it holds, so per-token results come back
in the [rows, response_width] layout the losses use.

Every micro-batch is `multiple` packed rows (one per data-parallel device), the sequences
balanced across all rows of all micro-batches, and all micro-batches of a call share one
shape, so they stack into one program that scans over them. Lengths and sequence counts
are rounded up by `fine_bucket`: a run compiles a bounded number of shapes, and a row
wastes fewer than max(16, L / 8) of its L tokens.
"""
from __future__ import annotations

import dataclasses
import heapq

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class PackedPlan:
  token_index: np.ndarray  # [R, L] int32: flat index (row * T + column) of the batch token there
  segment_ids: np.ndarray  # [R, L] int32: 0 padding, k the k-th sequence of that packed row
  positions: np.ndarray  # [R, L] int32: the token's position within its sequence
  seq_rows: np.ndarray  # [S] int32: the batch row of each sequence slot (0 for an empty slot)
  seq_start: np.ndarray  # [S] int32: flat packed index (r * L + l) of the slot's first token
  member: np.ndarray  # [S] bool: whether the slot holds a sequence

  @property
  def tokens(self) -> int:
    return int(np.count_nonzero(self.segment_ids))

  @property
  def computed(self) -> int:
    return int(self.segment_ids.size)

  def arrays(self) -> dict:
    """What a device program takes: the packed rows and the [S] slot maps (the [S, W]
    layout is rebuilt there by response_layout)."""
    return {"token_index": self.token_index, "segment_ids": self.segment_ids,
            "seq_rows": self.seq_rows, "seq_start": self.seq_start, "member": self.member}


def stack(plans: list[PackedPlan]) -> dict:
  """The arrays of same-shaped plans stacked on a leading micro-batch axis (for a scan)."""
  return {k: np.stack([p.arrays()[k] for p in plans]) for k in plans[0].arrays()}


def response_layout(mask_SxT, response_width: int, seq_start_S, member_S):
  """([S, W] flat packed index of each response token, [S, W] whether it is scored), in
  jnp (inside a program, or on host arrays), for the slots' rows of the attention mask. A
  token's place in its packed sequence is its rank among its row's valid tokens; scored
  as the padded path scores: the token and the one before it valid."""
  mask = jnp.asarray(mask_SxT).astype(bool)
  T, W = mask.shape[1], response_width
  rank = jnp.cumsum(mask.astype(jnp.int32), axis=1)[:, T - W:] - 1
  scored = mask[:, T - W:] & mask[:, T - W - 1:T - 1] & jnp.asarray(member_S)[:, None]
  index = jnp.asarray(seq_start_S, jnp.int32)[:, None] + jnp.maximum(rank, 0)
  return jnp.where(scored, index, 0), scored


def fine_bucket(n: int, quantum: int = 16, cap: int | None = None) -> int:
  """n rounded up to a step of 1/8 of the power of two above it, the step at least
  `quantum`: fewer than max(quantum, n / 8) wasted, 8 sizes per doubling; at most cap
  (but never below n)."""
  step = max(quantum, 1 << max(int(n - 1).bit_length() - 4, 0))
  size = max(-(-n // step) * step, quantum)
  return size if cap is None else max(min(size, cap), n)


def sequence_lengths(mask_BxT) -> np.ndarray:
  return np.asarray(mask_BxT).astype(bool).sum(axis=1)


def check_budget(lengths, budget: int, field: str):
  longest = int(np.max(lengths, initial=0))
  if budget < longest:
    raise ValueError(f"{field}: {budget} tokens is less than the longest sequence "
                     f"({longest} tokens); raise it to at least {longest}")


def balance(lengths, rows, bins: int) -> list[list[int]]:
  """`rows` into `bins` lists, longest first into the least-filled (LPT: the fullest is
  at most 4/3 of the best possible)."""
  lengths = np.asarray(lengths)
  rows = np.asarray(rows, int)
  heap = [(0, b) for b in range(bins)]  # (fill, bin): ties go to the lower bin
  out = [[] for _ in range(bins)]
  for row in rows[np.argsort(-lengths[rows], kind="stable")].tolist():
    fill, b = heapq.heappop(heap)
    out[b].append(row)
    heapq.heappush(heap, (fill + int(lengths[row]), b))
  return out


def pack(mask_BxT, bins, *, length: int | None = None, slots: int | None = None) -> PackedPlan:
  """Packed row r holds the sequences of bins[r] in order, each row padded to `length`
  (default: the longest), with `slots` sequence slots (default: as many as sequences)."""
  mask = np.asarray(mask_BxT, bool)
  T = mask.shape[1]
  fills = [int(sum(np.count_nonzero(mask[b]) for b in one)) for one in bins]
  count = sum(len(one) for one in bins)
  length = max(fills, default=1) if length is None else length
  slots = count if slots is None else slots
  if length < max(fills, default=0) or slots < count:
    raise ValueError(f"pack: {len(bins)} bins up to {max(fills, default=0)} tokens and "
                     f"{count} sequences do not fit rows of {length} and {slots} slots")
  token_index = np.zeros((len(bins), length), np.int32)
  segment_ids = np.zeros((len(bins), length), np.int32)
  positions = np.zeros((len(bins), length), np.int32)
  seq_rows, seq_start = np.zeros(slots, np.int32), np.zeros(slots, np.int32)
  member = np.zeros(slots, bool)
  s = 0
  for r, seqs in enumerate(bins):
    at = 0
    for k, b in enumerate(seqs, start=1):
      cols = np.flatnonzero(mask[b])
      n = len(cols)
      token_index[r, at:at + n] = b * T + cols
      segment_ids[r, at:at + n] = k
      positions[r, at:at + n] = np.arange(n)
      seq_rows[s], seq_start[s], member[s] = b, r * length + at, True
      at, s = at + n, s + 1
  return PackedPlan(token_index, segment_ids, positions, seq_rows, seq_start, member)


def micro_batch_plans(mask_BxT, *, multiple: int, budget: int = 0, micro_batches: int = 1,
                      groups=None, field: str = "ppo_max_token_len_per_gpu") -> list[PackedPlan]:
  """Same-shaped plans of a batch's micro-batches, each `multiple` packed rows.

  The batch's sequences are balanced over all micro_batches x multiple rows. With
  `budget` (verl's use_dynamic_bsz) micro_batches is only where the search starts: as
  many micro-batches as it takes for no row to hold more than `budget` tokens, the
  tokens spread evenly over them. Rows are `fine_bucket` of the fullest one (capped at
  the budget); the sequence slots of every micro-batch `fine_bucket` of the most any
  holds (a multiple of `multiple`, at most the batch's rows), so that each computes its
  loss on those rows alone. `groups` (row index arrays, no budget) fixes which rows each
  micro-batch holds instead: each group balanced over its own `multiple` rows.
  """
  mask = np.asarray(mask_BxT, bool)
  lengths = sequence_lengths(mask)
  live = np.flatnonzero(lengths > 0)  # rows with no token (a batch's padding): nothing to do
  cuts = max(micro_batches, 1)
  if budget and groups is not None:
    raise ValueError(f"{field}: a token budget cuts micro-batches by tokens, not by row groups")
  if budget:
    check_budget(lengths, budget, field)
    cuts = max(cuts, -(-int(lengths.sum()) // (budget * multiple)))
  while True:
    if groups is None:
      bins = balance(lengths, live, cuts * multiple)
    else:
      bins = [b for g in groups for b in balance(lengths, np.intersect1d(g, live), multiple)]
    fullest = max(int(lengths[one].sum()) for one in bins)
    if not budget or fullest <= budget:
      break
    cuts += 1  # ends: with a row per sequence each holds one, and none exceeds the budget
  length = fine_bucket(max(fullest, 1), cap=budget or None)
  most = max(sum(len(one) for one in bins[i:i + multiple]) for i in range(0, len(bins), multiple))
  rows = -(-len(mask) // multiple) * multiple
  slots = min(-(-fine_bucket(max(most, 1), quantum=8) // multiple) * multiple, rows)
  return [pack(mask, bins[i:i + multiple], length=length, slots=slots)
          for i in range(0, len(bins), multiple)]


def unpack(packed_RxL, plan: PackedPlan, mask_BxT, response_width: int):
  """Per-token values of packed rows back at their response positions [B, W] (numpy), 0
  outside the plan's sequences."""
  mask = np.asarray(mask_BxT)
  index, scored = map(np.asarray, response_layout(mask[plan.seq_rows], response_width,
                                                  plan.seq_start, plan.member))
  out = np.zeros((len(mask), response_width), np.asarray(packed_RxL).dtype)
  np.add.at(out, plan.seq_rows, np.where(scored, np.asarray(packed_RxL).reshape(-1)[index], 0))
  return out
