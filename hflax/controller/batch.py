"""Batch: hflax's DataProto. Arrays sharing a leading batch dimension, per-sample Python
objects (e.g. ground-truth answers), and meta info.

Arrays stay wherever they are (any device, any mesh): select, union, repeat, reorder and
friends are jnp operations on the arrays' own devices, so nothing goes through the host
unless `to_host` is called.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Iterable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np


def _rows(x) -> int:
  return int(x.shape[0])


@dataclasses.dataclass
class Batch:
  arrays: dict[str, Any] = dataclasses.field(default_factory=dict)
  objects: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)  # dtype=object
  meta: dict[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    self.objects = {k: np.asarray(v, dtype=object) if not isinstance(v, np.ndarray) else v
                    for k, v in self.objects.items()}
    sizes = {k: _rows(v) for k, v in {**self.arrays, **self.objects}.items()}
    if len(set(sizes.values())) > 1:
      raise ValueError(f"Batch fields disagree on the batch size: {sizes}")

  @classmethod
  def from_dict(cls, fields: Mapping[str, Any], meta: Mapping[str, Any] | None = None) -> "Batch":
    """Numeric fields become arrays, anything else (strings, dicts) per-sample objects."""
    arrays, objects = {}, {}
    for k, v in fields.items():
      if isinstance(v, jax.Array) or (isinstance(v, np.ndarray) and v.dtype != object):
        arrays[k] = v
      else:
        objects[k] = v
    return cls(arrays, objects, dict(meta or {}))

  def __len__(self) -> int:
    for v in (*self.arrays.values(), *self.objects.values()):
      return _rows(v)
    return 0

  def __getitem__(self, key: str):
    if key in self.arrays:
      return self.arrays[key]
    if key in self.objects:
      return self.objects[key]
    raise KeyError(f"Batch has no field {key!r}; it has {sorted(self.keys())}")

  def __contains__(self, key: str) -> bool:
    return key in self.arrays or key in self.objects

  def keys(self) -> list[str]:
    return [*self.arrays, *self.objects]

  def select(self, keys: Iterable[str] = (), meta_keys: Iterable[str] | None = None) -> "Batch":
    keys = list(keys)
    missing = [k for k in keys if k not in self]
    if missing:
      raise KeyError(f"Batch has no field(s) {missing}; it has {sorted(self.keys())}")
    meta = self.meta if meta_keys is None else {k: self.meta[k] for k in meta_keys}
    return Batch({k: v for k, v in self.arrays.items() if k in keys},
                 {k: v for k, v in self.objects.items() if k in keys}, dict(meta))

  def union(self, other: "Batch") -> "Batch":
    """Fields of both; a key in both must hold the same value (by identity or equality)."""
    if len(self) and len(other) and len(self) != len(other):
      raise ValueError(f"cannot union batches of {len(self)} and {len(other)} rows")
    for key in set(self.keys()) & set(other.keys()):
      if not _same(self[key], other[key]):
        raise ValueError(f"union: field {key!r} differs between the two batches")
    meta = {**self.meta, **other.meta}
    for key in set(self.meta) & set(other.meta):
      if key == "metrics":  # each role reports its own metrics; gather them all
        meta[key] = {**self.meta[key], **other.meta[key]}
      elif not _same(self.meta[key], other.meta[key]):
        raise ValueError(f"union: meta {key!r} differs between the two batches")
    return Batch({**self.arrays, **other.arrays}, {**self.objects, **other.objects}, meta)

  def map_rows(self, index) -> "Batch":
    """Rows picked by an index array (works for any permutation, repeat or slice)."""
    idx_np = np.asarray(index)
    arrays = {k: v[idx_np] if isinstance(v, np.ndarray) else jnp.take(v, jnp.asarray(idx_np), 0)
              for k, v in self.arrays.items()}
    return Batch(arrays, {k: v[idx_np] for k, v in self.objects.items()}, dict(self.meta))

  def reorder(self, permutation: Sequence[int]) -> "Batch":
    return self.map_rows(permutation)

  def repeat(self, n: int, interleave: bool = True) -> "Batch":
    """n copies of every row: interleaved (a a b b) or tiled (a b a b)."""
    rows = np.arange(len(self))
    return self.map_rows(np.repeat(rows, n) if interleave else np.tile(rows, n))

  def slice(self, start: int, stop: int) -> "Batch":
    return Batch({k: v[start:stop] for k, v in self.arrays.items()},
                 {k: v[start:stop] for k, v in self.objects.items()}, dict(self.meta))

  def chunk(self, chunks: int) -> list["Batch"]:
    if len(self) % chunks:
      raise ValueError(f"cannot split {len(self)} rows into {chunks} equal chunks")
    size = len(self) // chunks
    return [self.slice(i * size, (i + 1) * size) for i in range(chunks)]

  @staticmethod
  def concat(batches: Sequence["Batch"]) -> "Batch":
    keys = [set(b.keys()) for b in batches]
    if any(k != keys[0] for k in keys):
      raise ValueError(f"concat: batches have different fields: {[sorted(k) for k in keys]}")
    first = batches[0]
    arrays = {k: (np.concatenate if isinstance(v, np.ndarray) else jnp.concatenate)(
        [b.arrays[k] for b in batches]) for k, v in first.arrays.items()}
    objects = {k: np.concatenate([b.objects[k] for b in batches]) for k in first.objects}
    return Batch(arrays, objects, dict(first.meta))

  def pad_to_divisor(self, divisor: int) -> tuple["Batch", int]:
    """Repeats leading rows so the size divides `divisor`; returns (batch, rows added)."""
    pad = -len(self) % divisor
    if not pad:
      return self, 0
    return self.map_rows(np.concatenate([np.arange(len(self)), np.arange(pad) % len(self)])), pad

  def unpad(self, pad: int) -> "Batch":
    return self.slice(0, len(self) - pad) if pad else self

  def place(self, sharding, keys: Iterable[str] | None = None) -> "Batch":
    """Arrays (or just `keys`) moved onto `sharding` (asynchronously)."""
    keys = set(self.arrays if keys is None else keys)
    moved = {k: jax.device_put(v, sharding) if k in keys else v for k, v in self.arrays.items()}
    return Batch(moved, dict(self.objects), dict(self.meta))

  def to_host(self) -> "Batch":
    return Batch({k: np.asarray(v) for k, v in self.arrays.items()}, dict(self.objects),
                 dict(self.meta))


def _same(a, b) -> bool:
  if a is b:
    return True
  try:
    if hasattr(a, "shape") or hasattr(b, "shape"):
      return np.shape(a) == np.shape(b) and bool(np.array_equal(np.asarray(a), np.asarray(b)))
    return bool(a == b)
  except Exception:  # noqa: BLE001 - objects without a usable equality are different
    return False
