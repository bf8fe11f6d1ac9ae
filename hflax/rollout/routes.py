"""Routing replay's record (mixture-of-experts models): the experts each token the rollout
fed to the model went through, in every sparse layer, as a batch field "routes" [rows,
prompt + response columns, sparse layers, k] int32, -1 for a token the rollout never fed
(padding, a response's last token: it is sampled, not read). The training forward
replays it (hflax.models.moe), so a token's log-prob under training is computed through
the experts that sampled it.
"""
from __future__ import annotations

import jax.numpy as jnp

from hflax.models import moe

UNRECORDED = -1


def width(cfg) -> tuple[int, int]:
  """(sparse layers, k) of a model config: the last two axes of its routes."""
  return cfg.num_sparse_layers, cfg.num_experts_per_tok


def check(cfg, params) -> None:
  """One line before any device work where routes cannot be recorded."""
  if params.record_routes and not cfg.num_sparse_layers:
    raise ValueError("record_routes: the model has no mixture-of-experts layers to record")


def unrecorded(rows: int, columns: int, cfg):
  return jnp.full((rows, columns) + width(cfg), UNRECORDED, jnp.int32)


def of_call(record, fed_BxT):
  """One model call's record as [B, T, sparse layers, k], -1 where a token was not fed."""
  routes = moe.rows_first(moe.stacked(record)[0])
  return jnp.where(fed_BxT[..., None, None], routes, UNRECORDED)
