"""Packing plans: the valid tokens of left-padded rows laid end to end in a few long rows.

A rollout row is [prompt (left-padded) | response (right-padded)]; with unequal response
lengths most of it can be padding. A plan (host-side numpy, from the attention mask
alone) says which token of the batch goes where in the packed rows, which sequence
(segment) it belongs to, and which batch rows it holds, so per-token results come back
in the [rows, response_width] layout the losses use.

Rows that repeat one prompt (GRPO's n samples of it) and land in the same micro-batch
share it: the prompt is packed once, as a segment of its own, and each response follows
as a segment whose prefix id is the prompt's (it attends to the prompt and to itself,
positions continuing the prompt's), so the prompt's activations are computed once, and
its gradient sums its responses' contributions as the padded rows' would.

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
  positions: np.ndarray  # [R, L] int32: its position in its sequence (after a shared prompt's)
  seq_rows: np.ndarray  # [S] int32: the batch row of each sequence slot (0 for an empty slot)
  # [S] int32: flat packed index (r * L + l) where the slot's row's token of rank 0 is or,
  # after a shared prompt, would be (its response tokens then sit at seq_start + rank)
  seq_start: np.ndarray
  member: np.ndarray  # [S] bool: whether the slot holds a sequence
  prefix_ids: np.ndarray  # [R, L] int32: the segment a token also sees (its own unless shared)
  # [S] int32: flat packed index of the shared prompt's last token, -1 for a slot not sharing
  prompt_last: np.ndarray
  shared_prompt_tokens: int = 0  # prompt tokens not computed thanks to sharing

  @property
  def tokens(self) -> int:
    return int(np.count_nonzero(self.segment_ids))

  @property
  def computed(self) -> int:
    return int(self.segment_ids.size)

  def arrays(self, shared: bool | None = None) -> dict:
    """What a device program takes: the packed rows and the [S] slot maps (the [S, W]
    layout is rebuilt there by response_layout); with `shared` (default: whether this
    plan shares prompts) the prefix ids and explicit positions too."""
    out = {"token_index": self.token_index, "segment_ids": self.segment_ids,
           "seq_rows": self.seq_rows, "seq_start": self.seq_start, "member": self.member,
           "prompt_last": self.prompt_last}
    if self.shared_prompt_tokens > 0 if shared is None else shared:
      out.update(prefix_ids=self.prefix_ids, positions=self.positions)
    return out


def stack(plans: list[PackedPlan]) -> dict:
  """The arrays of same-shaped plans stacked on a leading micro-batch axis (for a scan)."""
  shared = any(p.shared_prompt_tokens > 0 for p in plans)
  arrays = [p.arrays(shared) for p in plans]
  return {k: np.stack([a[k] for a in arrays]) for k in arrays[0]}


def prompt_groups(input_ids_BxT, mask_BxT, prompt_width: int) -> np.ndarray:
  """[B] int32: rows with the same id hold the same prompt (the tokens and mask of the
  first prompt_width columns)."""
  mask = np.asarray(mask_BxT, bool)[:, :prompt_width]
  prompts = np.where(mask, np.asarray(input_ids_BxT)[:, :prompt_width], -1)
  return np.unique(prompts, axis=0, return_inverse=True)[1].reshape(-1).astype(np.int32)


def response_before(index_SxW, prompt_last_S, scored_SxW):
  """[S, W] flat packed index of the token that predicts each response token (jnp): the
  one before it, or for the first response token of a slot sharing a prompt the
  prompt's last; 0 where not scored."""
  prompt_last = jnp.asarray(prompt_last_S)[:, None]
  first = (jnp.arange(index_SxW.shape[1]) == 0)[None] & (prompt_last >= 0)
  return jnp.where(scored_SxW, jnp.where(first, prompt_last, index_SxW - 1), 0)


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
  return [rows[one].tolist() for one in _lpt(lengths[rows], bins)]


def _lpt(sizes, bins: int) -> list[list[int]]:
  """Indices of `sizes` into `bins` lists, largest first into the least-filled."""
  sizes = np.asarray(sizes)
  heap = [(0, b) for b in range(bins)]  # (fill, bin): ties go to the lower bin
  out = [[] for _ in range(bins)]
  for i in np.argsort(-sizes, kind="stable").tolist():
    fill, b = heapq.heappop(heap)
    out[b].append(i)
    heapq.heappush(heap, (fill + int(sizes[i]), b))
  return out


def _unit_size(unit, lengths, prompt_lengths) -> int:
  """Tokens of a packing unit: a row, or a tuple of rows sharing their prompt."""
  if not isinstance(unit, tuple):
    return int(lengths[unit])
  p = int(prompt_lengths[unit[0]])
  return p + sum(int(lengths[b]) - p for b in unit)


def _units(lengths, prompt_lengths, prompts, rows, limit: int | None) -> list:
  """`rows` as packing units: the rows of one prompt (same id in `prompts`) as tuples
  of at most `limit` tokens each (the prompt counted once), the others alone."""
  if prompts is None:
    return [int(b) for b in rows]
  by_prompt = {}
  for b in rows:
    by_prompt.setdefault(int(prompts[b]), []).append(int(b))
  units = []
  for members in by_prompt.values():
    p = int(prompt_lengths[members[0]])
    if len(members) < 2 or p == 0:
      units += members
      continue
    cap = max(limit or 0, *(int(lengths[b]) for b in members)) if limit else None
    chunk, fill = [], p
    for b in members:
      n = int(lengths[b]) - p
      if chunk and cap is not None and fill + n > cap:
        units.append(tuple(chunk) if len(chunk) > 1 else chunk[0])
        chunk, fill = [], p
      chunk.append(b)
      fill += n
    units.append(tuple(chunk) if len(chunk) > 1 else chunk[0])
  return units


def _balance_units(lengths, prompt_lengths, prompts, rows, bins: int, budget: int) -> list:
  """`rows` into `bins` lists of units (see _units), LPT by unit size. A large prompt
  group may leave other bins empty while the fullest sets every row's length, so the
  rows of a prompt are cut into units of at most 1 to 4 mean bin fills (plus a prompt),
  or not cut (capped at the budget), whichever fills the fullest bin least (ties: the
  most sharing)."""
  size = lambda u: _unit_size(u, lengths, prompt_lengths)  # noqa: E731
  whole = _units(lengths, prompt_lengths, prompts, rows, None)
  mean = sum(size(u) for u in whole) / max(bins, 1)
  longest_prompt = int(max(prompt_lengths[rows], default=0)) if prompts is not None else 0
  limits = sorted({int(np.ceil(mean * f)) + extra for f in (4, 2, 1.5, 1.25, 1)
                   for extra in (longest_prompt, 0)}, reverse=True)
  best, fullest = None, None
  for limit in [budget or None] + (limits if prompts is not None else []):
    units = whole if limit is None else _units(lengths, prompt_lengths, prompts, rows,
                                                min(limit, budget or limit))
    split = [[units[i] for i in one] for one in _lpt([size(u) for u in units], bins)]
    most = max((sum(size(u) for u in one) for one in split), default=0)
    if best is None or most < fullest:
      best, fullest = split, most
  return best


def _rows_of(units) -> list[int]:
  return [b for u in units for b in (u if isinstance(u, tuple) else (u,))]


def pack(mask_BxT, bins, *, length: int | None = None, slots: int | None = None,
         prompt_width: int = 0) -> PackedPlan:
  """Packed row r holds the sequences of bins[r] in order, each row padded to `length`
  (default: the longest), with `slots` sequence slots (default: as many as sequences).
  An entry of a bin is a batch row, or a tuple of rows whose first prompt_width columns
  are the same prompt: packed once, then each row's response columns."""
  mask = np.asarray(mask_BxT, bool)
  T = mask.shape[1]
  lengths, prompt_lengths = mask.sum(axis=1), mask[:, :prompt_width].sum(axis=1)
  fills = [sum(_unit_size(u, lengths, prompt_lengths) for u in one) for one in bins]
  count = sum(len(_rows_of(one)) for one in bins)
  length = max(fills, default=1) if length is None else length
  slots = count if slots is None else slots
  if length < max(fills, default=0) or slots < count:
    raise ValueError(f"pack: {len(bins)} bins up to {max(fills, default=0)} tokens and "
                     f"{count} sequences do not fit rows of {length} and {slots} slots")
  token_index = np.zeros((len(bins), length), np.int32)
  segment_ids = np.zeros((len(bins), length), np.int32)
  positions = np.zeros((len(bins), length), np.int32)
  prefix_ids = np.zeros((len(bins), length), np.int32)
  seq_rows, seq_start = np.zeros(slots, np.int32), np.zeros(slots, np.int32)
  prompt_last = np.full(slots, -1, np.int32)
  member = np.zeros(slots, bool)
  s, saved = 0, 0
  for r, units in enumerate(bins):
    at, k = 0, 0

    def lay(b, cols, prefix, position0):
      nonlocal at, k
      n = len(cols)
      k += 1
      token_index[r, at:at + n] = b * T + cols
      segment_ids[r, at:at + n] = k
      prefix_ids[r, at:at + n] = k if prefix is None else prefix
      positions[r, at:at + n] = position0 + np.arange(n)
      at += n

    for unit in units:
      if not isinstance(unit, tuple):
        seq_rows[s], seq_start[s], member[s] = unit, r * length + at, True
        lay(unit, np.flatnonzero(mask[unit]), None, 0)
        s += 1
        continue
      cols = np.flatnonzero(mask[unit[0], :prompt_width])
      p, prompt_segment = len(cols), k + 1
      lay(unit[0], cols, None, 0)
      for b in unit:
        seq_rows[s], seq_start[s], member[s] = b, r * length + at - p, True
        prompt_last[s] = r * length + at - 1 if b == unit[0] else prompt_last[s - 1]
        lay(b, prompt_width + np.flatnonzero(mask[b, prompt_width:]), prompt_segment, p)
        s += 1
      saved += (len(unit) - 1) * p
  return PackedPlan(token_index, segment_ids, positions, seq_rows, seq_start, member,
                    prefix_ids, prompt_last, saved)


# fill_fewest cuts each micro-batch in this many packed ones of 1/FILL_SPLIT the length
# where the batch's longest sequence fits that (_fill_cuts): a shorter batch then pads its
# last filled one to half as much. On SmolLM2-135M (GRPO, 8 x 8 x 128, fp32) 8
# micro-batches cost what 4 did per packed token, and a later step computed 2304 tokens
# instead of 3072 for 2230 real ones.
FILL_SPLIT = 2


def micro_batch_plans(mask_BxT, *, multiple: int, budget: int = 0, micro_batches: int = 1,
                      groups=None, field: str = "ppo_max_token_len_per_gpu", prompts=None,
                      prompt_width: int = 0, floor: tuple[int, ...] = (0, 0, 0),
                      fill_fewest: bool = False, split_tokens: float = 0) -> list[PackedPlan]:
  """Same-shaped plans of a batch's micro-batches, each `multiple` packed rows.

  The batch's sequences are balanced over all micro_batches x multiple rows. With
  `budget` (verl's use_dynamic_bsz) micro_batches is only where the search starts: as
  many micro-batches as it takes for no row to hold more than `budget` tokens, the
  tokens spread evenly over them. Rows are `fine_bucket` of the fullest one (capped at
  the budget); the sequence slots of every micro-batch `fine_bucket` of the most any
  holds (a multiple of `multiple`, at most the batch's rows), so that each computes its
  loss on those rows alone. `groups` (row index arrays, no budget) fixes which rows each
  micro-batch holds instead: each group balanced over its own `multiple` rows.
  `prompts` (prompt_groups of the first prompt_width columns) lets the rows of one prompt
  in one micro-batch share it (see the module's doc); None packs every row alone.
  `floor` (length, slots, micro-batches): the least of each to use, e.g. the largest a
  run has compiled so far (shape_floor), so that lengths that drift up and down reuse one
  program; the micro-batch count is used by fill_fewest alone (a 2-tuple: 0).
  `fill_fewest` (no budget, no groups): the floor's micro-batch count, or on the first
  call _fill_cuts' (micro_batches, or FILL_SPLIT x that where each packed row would still
  hold `split_tokens` tokens on average), each with a slot for every one of the batch's
  rows; once a floor length is set the sequences fill the fewest
  micro-batches whose rows fit it, the rest left empty for the program to skip
  (make_scan_step's `empty`): a batch shorter than the one that set the floor computes
  fewer rows of that length instead of the same rows, mostly padding.
  """
  floor = (*floor, 0)[:3]
  mask = np.asarray(mask_BxT, bool)
  lengths = sequence_lengths(mask)
  live = np.flatnonzero(lengths > 0)  # rows with no token (a batch's padding): nothing to do
  prompt_lengths = mask[:, :prompt_width].sum(axis=1)
  cuts = max(micro_batches, 1)
  if budget and groups is not None:
    raise ValueError(f"{field}: a token budget cuts micro-batches by tokens, not by row groups")
  if budget:
    check_budget(lengths, budget, field)
    total = _total_tokens(lengths, prompt_lengths, prompts, live)
    cuts = max(cuts, -(-total // (budget * multiple)))
  fill_fewest = fill_fewest and not budget and groups is None
  if fill_fewest:
    cuts = floor[2] or _fill_cuts(lengths, prompt_lengths, prompts, live, cuts, multiple,
                                  split_tokens)
  fewer = (_fewest_bins(lengths, prompt_lengths, prompts, live, cuts, multiple, floor[0])
           if fill_fewest and floor[0] else None)
  while True:
    if fewer is not None:
      bins = fewer
    elif groups is None:
      bins = _balance_units(lengths, prompt_lengths, prompts, live, cuts * multiple, budget)
    else:
      bins = [b for g in groups for b in _balance_units(
          lengths, prompt_lengths, prompts, np.intersect1d(g, live), multiple, budget)]
    fullest = _fullest(bins, lengths, prompt_lengths)
    if not budget or fullest <= budget:
      break
    cuts += 1  # ends: with a row per sequence each holds one, and none exceeds the budget
  length = max(fine_bucket(max(fullest, 1), cap=budget or None), min(floor[0], budget or floor[0]))
  most = max(sum(len(_rows_of(one)) for one in bins[i:i + multiple])
             for i in range(0, len(bins), multiple))
  rows = -(-len(mask) // multiple) * multiple
  slots = min(max(-(-fine_bucket(max(most, 1), quantum=8) // multiple) * multiple, floor[1]),
              rows) if not fill_fewest else rows
  return [pack(mask, bins[i:i + multiple], length=length, slots=slots, prompt_width=prompt_width)
          for i in range(0, len(bins), multiple)]


def _total_tokens(lengths, prompt_lengths, prompts, live) -> int:
  """Tokens of the live rows packed, each shared prompt counted once."""
  return sum(_unit_size(u, lengths, prompt_lengths)
             for u in _units(lengths, prompt_lengths, prompts, live, None))


def _fullest(bins, lengths, prompt_lengths) -> int:
  return max(sum(_unit_size(u, lengths, prompt_lengths) for u in one) for one in bins)


def _fill_cuts(lengths, prompt_lengths, prompts, live, cuts: int, multiple: int,
               split_tokens: float) -> int:
  """FILL_SPLIT x cuts micro-batches where a mean packed row of that many holds the
  longest sequence (a sequence is never split: rows of half the length would all pad up
  to it) and at least split_tokens tokens, else cuts."""
  finer = cuts * FILL_SPLIT
  longest = int(lengths[live].max()) if len(live) else 0
  mean = _total_tokens(lengths, prompt_lengths, prompts, live) / (finer * multiple)
  return finer if split_tokens and mean >= max(longest, split_tokens) else cuts


def _fewest_bins(lengths, prompt_lengths, prompts, live, cuts: int, multiple: int,
                 length: int) -> list | None:
  """The bins of the fewest of `cuts` micro-batches of `multiple` rows whose balanced rows
  (units cut to at most `length` tokens) all fit `length`, then empty bins up to `cuts`;
  None when no fewer than `cuts` do."""
  total = _total_tokens(lengths, prompt_lengths, prompts, live)
  for used in range(max(-(-total // (length * multiple)), 1), cuts):
    bins = _balance_units(lengths, prompt_lengths, prompts, live, used * multiple, length)
    if _fullest(bins, lengths, prompt_lengths) <= length:
      return bins + [[] for _ in range((cuts - used) * multiple)]
  return None


def shape_floor(plans: list[PackedPlan], floor: tuple[int, ...] = (0, 0, 0)
                ) -> tuple[int, int, int]:
  """The (length, slots, micro-batches) high-water mark of `floor` and these plans'
  shape. A run whose packed lengths drift (each step's responses differ) would otherwise
  compile a program for every new bucket, each a long compile for a real model on a CPU;
  packing later micro-batches at least this large costs a little padding instead."""
  floor = (*floor, 0)[:3]
  return (max(floor[0], plans[0].token_index.shape[1]), max(floor[1], len(plans[0].seq_rows)),
          max(floor[2], len(plans)))


def unpack(packed_RxL, plan: PackedPlan, mask_BxT, response_width: int):
  """Per-token values of packed rows back at their response positions [B, W] (numpy), 0
  outside the plan's sequences."""
  mask = np.asarray(mask_BxT)
  index, scored = map(np.asarray, response_layout(mask[plan.seq_rows], response_width,
                                                  plan.seq_start, plan.member))
  out = np.zeros((len(mask), response_width), np.asarray(packed_RxL).dtype)
  np.add.at(out, plan.seq_rows, np.where(scored, np.asarray(packed_RxL).reshape(-1)[index], 0))
  return out
