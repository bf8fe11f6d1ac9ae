"""Transfer protocols: how a worker method lays a Batch onto its mesh and hands results back.

HybridFlow's ONE_TO_ALL and DP_PROTO become input shardings here: REPLICATE puts every row
on every device of the role's mesh; DATA_PARALLEL splits rows over the mesh's data axes,
and tensor-parallel devices of one data shard receive the same rows (the paper's 3D
protocol, which NamedSharding gives for free). Results are collected onto the controller's
home placement, so batches from roles on different meshes can be combined.
"""
from __future__ import annotations

import enum
import functools

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from hflax.controller.batch import Batch


# Batch.meta key of a padded batch: how many of its rows are real (the rest repeat them).
LIVE_ROWS = "live_rows"


class Protocol(enum.Enum):
  REPLICATE = "replicate"
  DATA_PARALLEL = "data_parallel"


def transfer(protocol: Protocol, inputs: tuple[str, ...] = ()):
  """Declares a worker method's protocol and the Batch fields it reads.

  The wrapped method receives a dict of arrays already on its mesh and returns a dict of
  arrays (or a Batch, or plain metrics); array results are collected to `self.home`.
  The attributes set here are what a remote backend reads to split and gather.
  """

  def wrap(method):
    @functools.wraps(method)
    def call(self, batch: Batch, *args, **kwargs):
      missing = [k for k in inputs if k not in batch]
      if missing:
        raise KeyError(f"{type(self).__name__}.{method.__name__} needs batch fields {missing}; "
                       f"the batch has {sorted(batch.keys())}")
      sharding = self.input_sharding(protocol)
      rows, pad = len(batch), 0
      if protocol is Protocol.DATA_PARALLEL:
        batch, pad = batch.pad_to_divisor(self.data_parallel_rows)
        batch = Batch(batch.arrays, batch.objects, {**batch.meta, LIVE_ROWS: rows})
      placed = {k: jax.device_put(batch.arrays[k], sharding) for k in inputs}
      out = method(self, placed, batch, *args, **kwargs)
      if isinstance(out, dict):
        return Batch({k: first_rows(jax.device_put(v, self.home), rows, pad)
                      for k, v in out.items()}, meta={})
      return out

    call.protocol, call.inputs = protocol, inputs
    return call

  return wrap


def first_rows(x, rows: int, pad: int):
  """The real rows of a result computed on a padded batch (`pad` rows added at the end)."""
  return x[:rows] if pad else x


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
