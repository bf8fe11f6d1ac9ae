"""Routing replay's record (mixture-of-experts models): the experts each token the rollout
fed to the model went through, in every sparse layer, as a batch field "routes" [rows,
prompt + response columns, sparse layers, k] int32, -1 for a token the rollout never fed
(padding, a response's last token: it is sampled, not read). The training forward
replays it (hflax.models.moe), so a token's log-prob under training is computed through
the experts that sampled it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from hflax.models import moe
from hflax.models.logprobs import sequence_log_probs

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


def replay_stats(record, replayed_BxTxLxK, num_experts: int) -> dict:
  """Per row, from a replaying forward's record: how many recorded tokens the current
  router alone would have sent to the same experts ("agree", of "tokens"), and how many
  of the replayed top-k picks went to each expert in each sparse layer ("load" [B, L, E]).
  Rows first, so they split and gather like the batch."""
  _, logits = moe.stacked(record)
  fresh = moe.rows_first(jax.lax.top_k(jax.nn.softmax(logits.astype(jnp.float32), -1),
                                       replayed_BxTxLxK.shape[-1])[1])
  recorded = replayed_BxTxLxK[..., 0, 0] >= 0
  same = jnp.all(jnp.sort(fresh, -1) == jnp.sort(replayed_BxTxLxK, -1), axis=(-2, -1))
  picks = jax.nn.one_hot(replayed_BxTxLxK, num_experts, dtype=jnp.float32)  # -1: all zero
  return {"agree": (same & recorded).sum(-1).astype(jnp.float32),
          "tokens": recorded.sum(-1).astype(jnp.float32),
          "load": picks.sum(axis=(1, 3))}


def replay_metrics(stats) -> dict:
  """The step's metrics from replay_stats' rows (numpy): the share of recorded tokens the
  trainer's router would have routed as the rollout did, and the busiest expert's share
  of its layer's picks against an even share (1: balanced), the worst layer's."""
  import numpy as np
  agree, tokens, load = (np.asarray(stats[k]) for k in ("agree", "tokens", "load"))
  per_layer = load.sum(axis=0)  # [L, E]
  even = per_layer.sum(axis=-1, keepdims=True) / per_layer.shape[-1]
  imbalance = float(np.max(per_layer / np.maximum(even, 1e-9))) if per_layer.size else 0.0
  total = float(np.sum(tokens))
  return {"actor/route_agreement": float(np.sum(agree)) / total if total else 1.0,
          "actor/expert_load_max": imbalance}


@functools.lru_cache(maxsize=None)
def replay_log_probs_fn(graphdef, width: int, temperature: float, num_experts: int):
  """forwards.log_probs_fn replaying rows["routes"], with replay_stats as a third result."""
  def fn(params, rows):
    with moe.recording() as record:
      logp, entropy = sequence_log_probs(graphdef, params, rows["input_ids"],
                                         rows["attention_mask"], temperature=temperature,
                                         last=width, routes_BxTxLxK=rows["routes"])
    return logp, entropy, replay_stats(record, rows["routes"], num_experts)
  return fn
