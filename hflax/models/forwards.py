"""The forward passes role workers compile: pure functions of (params, fields) built once
per model graph and setting.

Each builder is cached, so a worker asking twice gets the same function object, and the
jit cache keyed on it compiles once. Padded passes read rows of "input_ids" and
"attention_mask" and score the last `width` columns; packed passes read the fields of a
packed plan (controller.packing): "packed_tokens", "segment_ids", "response_index",
"response_valid", "response_before" and, where prompts are shared, "positions" and
"prefix_ids".
"""
from __future__ import annotations

import functools

import jax.numpy as jnp

from hflax.models.logprobs import packed_log_probs, sequence_log_probs
from hflax.models.lora import split_adapters
from hflax.models.transformer import forward


@functools.lru_cache(maxsize=None)
def log_probs_fn(graphdef, width: int, temperature: float):
  """(params, rows) -> (log-probs, entropy) [B, width] of the responses; rows with
  "routes" replay a mixture of experts' recorded routes."""
  def fn(params, rows):
    return sequence_log_probs(graphdef, params, rows["input_ids"], rows["attention_mask"],
                              temperature=temperature, last=width,
                              routes_BxTxLxK=rows.get("routes"))
  return fn


@functools.lru_cache(maxsize=None)
def packed_log_probs_fn(graphdef, temperature: float):
  """log_probs_fn on packed rows; compute_kernels: the kernels already cast for compute."""
  def fn(params, fields, compute_kernels=None):
    return packed_log_probs(graphdef, params, fields["packed_tokens"], fields["segment_ids"],
                            fields["response_index"], fields["response_valid"],
                            temperature=temperature, positions_RxL=fields.get("positions"),
                            prefix_ids_RxL=fields.get("prefix_ids"),
                            before_index_BxW=fields["response_before"],
                            compute_kernels=compute_kernels)
  return fn


@functools.lru_cache(maxsize=None)
def base_packed_log_probs_fn(base_graphdef, temperature: float):
  """packed_log_probs_fn of the base weights of a state that holds LoRA adapters."""
  inner = packed_log_probs_fn(base_graphdef, temperature)
  return lambda params, fields: inner(split_adapters(params)[1], fields)


@functools.lru_cache(maxsize=None)
def base_log_probs_fn(base_graphdef, width: int, temperature: float):
  """log_probs_fn of the base weights of a state that holds LoRA adapters."""
  inner = log_probs_fn(base_graphdef, width, temperature)
  return lambda params, rows: inner(split_adapters(params)[1], rows)


@functools.lru_cache(maxsize=None)
def values_fn(graphdef, width: int):
  """(params, rows) -> the value head's [B, width] values of the response tokens."""
  def fn(params, rows):
    model, hidden = forward(graphdef, params, rows["input_ids"], rows["attention_mask"])
    # The value of a response token is read at the position that predicts it.
    return model.values(hidden)[:, -width - 1:-1]
  return fn


@functools.lru_cache(maxsize=None)
def packed_values_fn(graphdef):
  """values_fn on packed rows: [B, W], 0 where a response token is not scored."""
  def fn(params, fields):
    segments = fields["segment_ids"]
    model, hidden = forward(graphdef, params, fields["packed_tokens"], segments > 0,
                            segment_ids_BxT=segments, positions_BxT=fields.get("positions"),
                            prefix_ids_BxT=fields.get("prefix_ids"))
    values = jnp.take(model.values(hidden).reshape(-1), fields["response_before"])
    return jnp.where(fields["response_valid"], values, 0.0)
  return fn


@functools.lru_cache(maxsize=None)
def reward_scores_fn(graphdef):
  """(params, rows) -> [B, W]: a reward model's score at each response's last real token
  (its first token for an empty response), 0 elsewhere."""
  def fn(params, rows):
    model, hidden = forward(graphdef, params, rows["input_ids"], rows["attention_mask"])
    values = model.values(hidden)
    response_mask = rows["response_mask"]
    width = response_mask.shape[1]
    length = response_mask.sum(axis=1).astype(jnp.int32)
    last = values.shape[1] - width + jnp.maximum(length, 1) - 1
    score = jnp.take_along_axis(values, last[:, None], axis=1)[:, 0]
    at_end = jnp.arange(width)[None, :] == (jnp.maximum(length, 1) - 1)[:, None]
    return jnp.where(at_end, score[:, None], 0.0)
  return fn
