"""What crosses process boundaries: Batches and arguments as host (numpy) values.

Driver -> members: `to_wire` turns every JAX array (the driver's own, e.g. advantages
computed on its CPU) into numpy and PRNG keys into `HostKey`; the payload is put in
Ray's object store once and every member of the group reads the same object. Members
hand the numpy arrays straight to the role methods, whose `jax.device_put` onto the
role's global sharding copies just the process's own shards (each process slices the
same host value), so nothing is scattered by hand.

Members -> driver: role methods collect results onto `home`, which in this backend is
the pool's fully replicated sharding, so every process holds the whole result and
`to_host` reads it from a local shard; anything still sharded is gathered with
`process_allgather` (a collective: every member converts the same tree in the same
order). Only process 0's copy is sent back.
"""
from __future__ import annotations

import dataclasses

import jax
import numpy as np

from hflax.controller.batch import Batch
from hflax.rollout.host import host_array


@dataclasses.dataclass(frozen=True)
class HostKey:
  """A typed PRNG key as host data (typed keys cannot be pickled as arrays)."""
  impl: str
  data: np.ndarray

  def to_key(self):
    return jax.random.wrap_key_data(self.data, impl=self.impl)


def _is_key(x) -> bool:
  return isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)


def _host_array(x):
  if _is_key(x):
    return HostKey(str(jax.random.key_impl(x)), _host_array(jax.random.key_data(x)))
  return host_array(x)


def _leaf(x):
  if isinstance(x, Batch):
    return Batch({k: _leaf(v) for k, v in x.arrays.items()}, dict(x.objects), to_host(x.meta))
  if isinstance(x, jax.Array):
    return _host_array(x)
  return x


def to_host(tree):
  """Every JAX array in `tree` (Batches, dicts, nnx.State, optax states...) as numpy."""
  return jax.tree.map(_leaf, tree, is_leaf=lambda x: isinstance(x, Batch))


to_wire = to_host  # the driver's arrays are fully addressable: the same conversion


def from_wire(tree):
  """HostKeys back to typed keys (numpy arrays stay numpy: the methods place them)."""
  def leaf(x):
    if isinstance(x, HostKey):
      return x.to_key()
    if isinstance(x, Batch):
      return Batch(dict(x.arrays), dict(x.objects), from_wire(x.meta))
    return x
  return jax.tree.map(leaf, tree, is_leaf=lambda x: isinstance(x, (Batch, HostKey)))
