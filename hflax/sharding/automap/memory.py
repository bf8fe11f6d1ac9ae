"""Device memory of hflax's compiled programs, term by term, as the runtime runs them.

One device's bytes for the three programs a role runs (no sharding: divide by the mesh
where the caller splits), each a Footprint of
  resident   what the program's arguments keep alive across calls: weights, optimizer
             state (the update donates both, so its outputs reuse them)
  transient  what XLA allocates while it runs (its compiled memory analysis's temp)

Terms, and the runtime code each follows:
  attention      hflax/models/transformer.py materialises fp32 scores and probabilities
                 [B, heads, T, S] per layer ("dense": quadratic in T); a blockwise kernel
                 keeps one [B, heads, T, block] tile instead ("blockwise": linear in T)
  layer          one decoder layer's working set per token: the MLP's gate, up and their
                 product (3F) beside the residual stream, or attention's q, k, v
  log-probs      hflax/models/logprobs.py: one [B, chunk, V] fp32 logits block alive
                 (B x chunk about chunked_head.BLOCK_TOKENS), forward and backward alike
  update         donated weights and AdamW moments; gradients are transient; without remat
                 each layer keeps its dot operands for the backward pass
  KV cache       hflax/rollout/sampler.py: the prompt's length bucket P, the prefill
                 cache [B, P] and the decode cache grown to [B * n, P + new_tokens]
  slots          hflax/rollout/continuous.py (continuous batching): every prompt's prefill
                 cache [B, P] stays alive for the slots to copy from, beside `slots` rows of
                 cache grown to P + new_tokens, and the prefill's working set before them
  packed rows    hflax/models/logprobs.py packed_log_probs: one row of the micro-batch's
                 real tokens; the logits block covers its sequences' response columns
  LM head        hflax/models/chunked_head.py: its backward pass holds one logits block
                 beyond the forward's two, tied or untied

Checked against XLA's compiled memory analysis of the real programs in
tests/test_automap_memory.py (CPU; within the factor stated there).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.util
import inspect
import math

import jax
import jax.extend
import jax.numpy as jnp

from hflax import platforms
from hflax.models.chunked_head import chunk_columns
from hflax.models.config import ModelConfig
from hflax.rollout.sampler import length_bucket

ATTENTIONS = ("dense", "blockwise")
F32 = 4


@dataclasses.dataclass(frozen=True)
class Footprint:
  resident: float
  transient: float

  @property
  def total(self) -> float:
    return self.resident + self.transient


def runtime_attention(cfg: ModelConfig | None = None, length: int = 1024) -> str:
  """What hflax.models runs for `cfg` (its `attention` setting) on this backend at `length`
  keys (its "auto" picks by length), found by tracing the runtime's attention: "dense" if
  some intermediate holds length x length entries, else "blockwise"."""
  if importlib.util.find_spec("hflax.models.attention") is None:
    return "dense"  # the transformer's own attention, which stores the scores
  return _traced_attention(getattr(cfg, "attention", "auto"), length, platforms.backend())


@functools.lru_cache(maxsize=None)
def _traced_attention(impl: str, length: int, backend: str) -> str:
  module = importlib.import_module("hflax.models.attention")
  return attention_kind(functools.partial(module.attention, impl=impl), length)


def attention_kind(fn, length: int = 1024) -> str:
  """"dense" or "blockwise": how `fn` (hflax.models.attention's signature) stores scores."""
  S = jax.ShapeDtypeStruct
  args = (S((1, length, 1, 8), jnp.float32), S((1, 1, 8, length), jnp.float32),
          S((1, 1, length, 8), jnp.float32), S((1, length), jnp.bool_),
          S((1, length), jnp.int32))
  traced = jax.make_jaxpr(fn)(*args)
  return "dense" if _largest(traced.jaxpr) >= length * length else "blockwise"


def _largest(jaxpr) -> int:
  """Elements of the largest value any equation of `jaxpr` (or its sub-jaxprs) makes."""
  most = 0
  for eqn in jaxpr.eqns:
    for var in eqn.outvars:
      most = max(most, math.prod(getattr(var.aval, "shape", ())))
    for sub in jax.extend.core.jaxprs_in_params(eqn.params):
      most = max(most, _largest(sub))
  return most


@functools.lru_cache(maxsize=None)
def blockwise_tile() -> tuple[int, int]:
  """(query rows, key columns) of hflax.models.attention.blockwise's default tile."""
  if importlib.util.find_spec("hflax.models.attention") is None:
    return 256, 512  # no blockwise runtime: a flash kernel's usual tile
  params = inspect.signature(importlib.import_module("hflax.models.attention").blockwise).parameters
  return params["q_block"].default, params["k_block"].default


def dtype_bytes(dtype: str) -> int:
  return jnp.dtype(dtype).itemsize


def _check(attention: str | None, cfg: ModelConfig | None = None, keys: int = 1024) -> str:
  attention = attention or runtime_attention(cfg, keys)
  if attention not in ATTENTIONS:
    raise ValueError(f"attention: {attention!r} is not one of {ATTENTIONS}")
  return attention


def weight_bytes(cfg: ModelConfig) -> float:
  return cfg.num_params * dtype_bytes(cfg.param_dtype)


def optimizer_bytes(cfg: ModelConfig) -> float:
  """AdamW's two moments, in the trained parameters' dtype (optax keeps them so)."""
  trained = cfg.num_lora_params if cfg.lora_rank else cfg.num_params
  return 2 * trained * dtype_bytes(cfg.param_dtype)


def attention_scores_bytes(cfg: ModelConfig, rows: int, queries: int, keys: int,
                           attention: str | None = None) -> float:
  """One layer's fp32 scores (or the blockwise tile) for `queries` x `keys`; without
  `attention`, what the runtime picks for this many keys."""
  if _check(attention, cfg, keys) == "dense":
    return rows * cfg.num_heads * queries * keys * F32
  q_block, k_block = blockwise_tile()
  tile = min(queries, q_block) * min(keys, k_block)
  return rows * cfg.num_heads * tile * F32


def layer_working_bytes(cfg: ModelConfig, rows: int, length: int,
                        attention: str | None = None) -> float:
  """The larger of one layer's MLP and attention working sets during a forward pass."""
  tokens, act = rows * length, dtype_bytes(cfg.dtype)
  d, f = cfg.hidden_size, cfg.intermediate_size
  qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
  mlp = tokens * (d + 3 * f) * act
  # Dense attention holds the scores and the probabilities; blockwise one tile at a time.
  kind = _check(attention, cfg, length)
  attn = tokens * (d + qkv) * act + (2 if kind == "dense" else 1) * attention_scores_bytes(
      cfg, rows, length, length, kind)
  return max(mlp, attn)


def logits_block_bytes(cfg: ModelConfig, rows: int, scored: int,
                       chunk: int | None = None) -> float:
  return rows * chunk_columns(rows, scored, chunk) * cfg.vocab_size * F32


def _pass_logits_bytes(cfg: ModelConfig, rows: int, length: int, scored: int | None,
                       scored_rows: int | None) -> float:
  """The logits block of a log-prob pass (forward_bytes' arguments): [rows, chunk, V], or
  for packed rows one row over their valid response tokens, at most the rows' tokens."""
  scored = length - 1 if scored is None else scored
  if scored_rows is None:
    return logits_block_bytes(cfg, rows, scored)
  return logits_block_bytes(cfg, 1, min(scored_rows * scored, rows * length))


def forward_bytes(cfg: ModelConfig, rows: int, length: int, scored: int | None = None,
                  attention: str | None = None, scored_rows: int | None = None) -> Footprint:
  """sequence_log_probs(last=scored): the layers run one after another, then the chunked
  vocabulary projection; the hidden states stay alive across both. scored_rows: packed
  rows holding that many sequences of up to `scored` response positions each
  (packed_log_probs), whose valid tokens, at most the rows' tokens, go through the
  projection as one row."""
  hidden = rows * length * cfg.hidden_size * dtype_bytes(cfg.dtype)
  logits = _pass_logits_bytes(cfg, rows, length, scored, scored_rows)
  peak = max(layer_working_bytes(cfg, rows, length, attention), logits)
  return Footprint(weight_bytes(cfg), hidden + peak)


def saved_layer_bytes(cfg: ModelConfig, rows: int, length: int,
                      attention: str | None = None) -> float:
  """What one layer keeps for its backward pass without remat: the operands of its dots
  (normed inputs, q, k, v, attention output, gate, up, their product), the residual
  stream, and with dense attention its probabilities."""
  tokens, act = rows * length, dtype_bytes(cfg.dtype)
  d, f = cfg.hidden_size, cfg.intermediate_size
  heads = (2 * cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
  return (tokens * (4 * d + heads + 3 * f) * act
          + attention_scores_bytes(cfg, rows, length, length, attention))


def update_bytes(cfg: ModelConfig, rows: int, length: int, scored: int | None = None,
                 attention: str | None = None, scored_rows: int | None = None) -> Footprint:
  """One optimizer step over a micro-batch of `rows` (make_train_step, donated)."""
  trained = cfg.num_lora_params if cfg.lora_rank else cfg.num_params
  resident = weight_bytes(cfg) + optimizer_bytes(cfg)
  grads = trained * dtype_bytes(cfg.param_dtype)
  # Weights stored wider than the compute dtype are cast for the forward and the cast is
  # what the backward reads (hflax/models/matmul.py; on CPU made once for every
  # micro-batch, transformer.compute_kernels): alive through the step.
  casts = (cfg.num_params * dtype_bytes(cfg.dtype)
           if dtype_bytes(cfg.dtype) < dtype_bytes(cfg.param_dtype) else 0)
  return Footprint(resident, grads + casts + activation_bytes(cfg, rows, length, scored,
                                                              attention, scored_rows))


def activation_bytes(cfg: ModelConfig, rows: int, length: int, scored: int | None = None,
                     attention: str | None = None, scored_rows: int | None = None) -> float:
  """A training pass's activations: what each layer saved (its input alone with remat),
  and the backward pass of one layer, which holds that layer's forward working set and
  its gradients (about as large again)."""
  per_layer = (rows * length * cfg.hidden_size * dtype_bytes(cfg.dtype) if cfg.remat
               else saved_layer_bytes(cfg, rows, length, attention))
  forward = forward_bytes(cfg, rows, length, scored, attention, scored_rows).transient
  # The LM head's hand-written backward pass (hflax/models/chunked_head.py) recomputes one
  # chunk's logits and holds one block beyond the forward pass's two: neither head's
  # weight gradient needs a transposed float32 copy of the cotangent (hflax/models/
  # matmul.py; measured in tests/test_automap_memory.py and
  # tests/test_automap_runtime_modes.py, on CPU: a packed 1024-token row over 8192 ids,
  # XLA's temp 50.0 / 47.9 MB untied / tied in float32, 39.5 / 37.4 in bfloat16).
  head = _pass_logits_bytes(cfg, rows, length, scored, scored_rows)
  return cfg.num_layers * per_layer + 2 * forward + head


def kv_cache_bytes(cfg: ModelConfig, rows: int, slots: int) -> float:
  return (2 * cfg.num_layers * rows * cfg.num_kv_heads * cfg.head_dim * slots
          * dtype_bytes(cfg.dtype))


def generate_bytes(cfg: ModelConfig, prompts: int, prompt_len: int, new_tokens: int,
                   n: int = 1, attention: str | None = None) -> Footprint:
  """sampler._generate: prefill the prompts' bucket, then decode B * n rows into a cache
  grown to P + new_tokens slots; the prefill's cache and attention are alive together.
  The prefill keeps four score-sized fp32 buffers (scores, masked scores, exponentials,
  probabilities: XLA:CPU allocated that many for hflax/models/attention.py's reference)."""
  P = length_bucket(prompt_len)
  prefill = (kv_cache_bytes(cfg, prompts, P)
             + 4 * attention_scores_bytes(cfg, prompts, P, P, attention))
  decode = kv_cache_bytes(cfg, prompts * n, P + new_tokens)
  return Footprint(weight_bytes(cfg), prefill + decode)


def slots_generate_bytes(cfg: ModelConfig, prompts: int, prompt_len: int, new_tokens: int,
                         slots: int, attention: str | None = None) -> Footprint:
  """continuous.decode_slots: all `prompts` prefilled at once into a cache of their bucket
  P, kept while sequences wait for a slot (a slot copies its prompt's columns in), and
  `slots` rows of cache grown to P + new_tokens. The prefill's working set (its hidden
  states and one layer's, forward_bytes) is counted beside them: XLA:CPU's peak held it."""
  P = length_bucket(prompt_len)
  prefill = forward_bytes(cfg, prompts, P, 1, attention).transient
  return Footprint(weight_bytes(cfg), kv_cache_bytes(cfg, prompts, P) + prefill
                   + kv_cache_bytes(cfg, slots, P + new_tokens))
