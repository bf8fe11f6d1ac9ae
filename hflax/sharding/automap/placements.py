"""Placements (set partitions of the roles) and the device counts a pool may take."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

Placement = tuple[tuple[str, ...], ...]


def set_partitions(items: Sequence[str]) -> Iterator[Placement]:
  """Every way to split `items` into non-empty groups (Bell(n) of them: 15 for 4 roles).

  Recursive on the first item: it either joins a group of a partition of the rest, or
  stands alone. Groups keep the input order, so each partition comes out exactly once.
  """
  items = tuple(items)
  if not items:
    yield ()
    return
  first, rest = items[0], items[1:]
  for partition in set_partitions(rest):
    yield ((first,),) + partition
    for i, group in enumerate(partition):
      yield partition[:i] + ((first,) + group,) + partition[i + 1:]


def placements(roles: Sequence[str]) -> list[Placement]:
  """Set partitions in a stable order: fewer pools first, groups sorted by role order."""
  order = {r: i for i, r in enumerate(roles)}
  seen = set()
  for p in set_partitions(roles):
    groups = tuple(sorted((tuple(sorted(g, key=order.get)) for g in p),
                          key=lambda g: order[g[0]]))
    seen.add(groups)
  return sorted(seen, key=lambda p: (len(p), [[order[r] for r in g] for g in p]))


def device_counts(total: int, devices_per_node: int) -> list[int]:
  """Pool sizes worth trying: powers of two inside a node, then whole nodes."""
  counts = []
  n = 1
  while n < min(devices_per_node, total):
    counts.append(n)
    n *= 2
  counts += list(range(devices_per_node, total + 1, devices_per_node))
  if not counts or counts[-1] != total and total < devices_per_node:
    counts.append(total)
  return sorted(set(counts))


def label(placement: Placement) -> str:
  """'colocate', 'standalone', 'split' (actor+ref | the scorers), or the groups spelled out."""
  if len(placement) == 1:
    return "colocate"
  if all(len(g) == 1 for g in placement):
    return "standalone"
  groups = {frozenset(g) for g in placement}
  roles = set().union(*groups)
  if frozenset({"actor", "ref"}) in groups and len(groups) == 2 and \
      frozenset(roles - {"actor", "ref"}) in groups:
    return "split"
  return " | ".join("+".join(g) for g in placement)
