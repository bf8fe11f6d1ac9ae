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
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from hflax.controller.batch import Batch
from hflax.rollout.sampler import shared_padding_cut


# Batch.meta key of a padded batch: how many of its rows are real (the rest repeat them).
LIVE_ROWS = "live_rows"
# The fields as wide as a whole sequence (prompt and response); the rest are per row or
# per response token.
# "routes": a mixture of experts' recorded experts, one entry a token (routing replay).
SEQUENCE_FIELDS = ("input_ids", "attention_mask", "position_ids", "routes")


class Protocol(enum.Enum):
  REPLICATE = "replicate"
  DATA_PARALLEL = "data_parallel"


def transfer(protocol: Protocol, inputs: tuple[str, ...] = (), packs=None):
  """Declares a worker method's protocol and the Batch fields it reads.

  The wrapped method receives a dict of arrays already on its mesh and returns a dict of
  arrays (or a Batch, or plain metrics); array results are collected to `self.home`.
  The attributes set here are what a remote backend reads to split and gather.
  A method reading whole sequences gets them less their shared leading padding
  (`without_shared_padding`), unless `packs(self)` says this call packs its real tokens,
  which skips all padding already (and keeps one input width, so one program).
  """

  def wrap(method):
    @functools.wraps(method)
    def call(self, batch: Batch, *args, **kwargs):
      missing = [k for k in inputs if k not in batch]
      if missing:
        raise KeyError(f"{type(self).__name__}.{method.__name__} needs batch fields {missing}; "
                       f"the batch has {sorted(batch.keys())}")
      if "input_ids" in inputs and not (packs is not None and packs(self)):
        batch = without_shared_padding(batch)
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


def without_shared_padding(batch: Batch) -> Batch:
  """The batch less the leading sequence columns that are padding in every row, its
  prompt part kept at the longest prompt's bucket (sampler.shared_padding_cut).

  The loader pads prompts to data.max_prompt_length; a padded forward or update would
  compute every one of those columns. Exact: no token attends to a pad column, positions
  count real tokens only, and every pass reads its results from the last columns (the
  response's). Each process of a pool holds the whole batch, so all cut the same columns.
  """
  if "responses" not in batch or "attention_mask" not in batch:
    return batch
  mask = batch["attention_mask"]
  cut = shared_padding_cut(mask, prompt_width=mask.shape[1] - batch["responses"].shape[1])
  if cut == 0:
    return batch
  # Cut on the host, where the mask already is: the fields go to the role's mesh next.
  arrays = {k: np.asarray(v)[:, cut:] if k in SEQUENCE_FIELDS else v
            for k, v in batch.arrays.items()}
  return Batch(arrays, batch.objects, batch.meta)


def first_rows(x, rows: int, pad: int):
  """The real rows of a result computed on a padded batch (`pad` rows added at the end)."""
  return x[:rows] if pad else x


def replicated(mesh) -> NamedSharding:
  return NamedSharding(mesh, P())
