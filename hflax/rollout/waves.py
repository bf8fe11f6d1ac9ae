"""How many generation waves a batch takes when a replica may hold only so many sequences.

Shared by the actor (which generates in these waves) and the auto-mapper's simulator
(which times and sizes them), so that the plan's memory is the runtime's.
"""
from __future__ import annotations


def generation_waves(prompts: int, replicas: int, n: int, max_num_seqs: int = 0
                     ) -> tuple[int, int]:
  """(waves, prompts per replica in each wave) for `prompts` prompts of n samples each,
  split over `replicas` generation replicas. Without a cap (0) one wave takes them all;
  with one, as few waves of equal size as keep each replica at max_num_seqs sequences
  (prompts x n) or fewer, as vLLM's max_num_seqs bounds its running batch."""
  per_replica = -(-prompts // replicas)
  if not max_num_seqs:
    return 1, per_replica
  fits = max_num_seqs // n
  if fits < 1:
    raise ValueError(f"max_num_seqs={max_num_seqs} is less than the {n} samples of one "
                     "prompt, which are generated together")
  waves = -(-per_replica // fits)
  return waves, -(-per_replica // waves)


def generation_slots(prompts: int, replicas: int, n: int, max_num_seqs: int = 0) -> int:
  """Decode slots per generation replica under continuous batching (generate_over_rows'
  `slots`), all rows in one wave: max_num_seqs sequences, or without a cap (0) every
  sequence of the replica's share. A slot holds one sample, so a cap below n is fine."""
  if max_num_seqs < 0:
    raise ValueError(f"max_num_seqs must be >= 0 (0: no cap), got {max_num_seqs}")
  rows = -(-prompts // replicas) * n
  return min(max_num_seqs, rows) if max_num_seqs else rows
