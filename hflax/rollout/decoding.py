"""The pieces of generation that the wave sampler (sampler.py) and continuous batching
(continuous.py) share: sampling parameters, the prompts' prefill, the token pick, the
cache's growth between loop segments, and the result fields.

The log-probs returned with each token are those of the sampled token under
softmax(logits / temperature) (the raw model distribution for greedy decoding), before
top-k/top-p truncation: what teacher-forced `sequence_log_probs` computes for the same
sequences.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flax import nnx

from hflax import platforms
from hflax.models.chunked_head import softmax_stats
from hflax.models.transformer import Attention, init_cache, positions_from_mask


@dataclasses.dataclass(frozen=True)
class SamplingParams:
  max_new_tokens: int = 64
  temperature: float = 1.0  # 0 means greedy
  top_k: int = 0  # 0 keeps every token
  top_p: float = 1.0
  n: int = 1  # samples per prompt, interleaved: row i * n + j is sample j of prompt i
  eos_ids: tuple[int, ...] = ()
  pad_id: int = 0
  # Mixture of experts: also return each token's experts ("routes", hflax.rollout.routes)
  # for the trainer to replay.
  record_routes: bool = False

  def __post_init__(self):
    checks = [(self.max_new_tokens >= 1, "max_new_tokens must be >= 1"),
              (self.temperature >= 0, "temperature must be >= 0 (0 = greedy)"),
              (self.top_k >= 0, "top_k must be >= 0 (0 = off)"),
              (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
              (self.n >= 1, "n must be >= 1")]
    for ok, message in checks:
      if not ok:
        raise ValueError(f"SamplingParams: {message}, got {self}")
    object.__setattr__(self, "eos_ids", tuple(int(i) for i in self.eos_ids))

  @property
  def greedy(self) -> bool:
    return self.temperature == 0


def prefill(model, prompts_BxP, prompt_mask_BxP, shared: int = 0):
  """The prompts' KV cache (width P), its validity mask, and each row's last hidden state
  [B, D] (the first new token's).

  shared (static): the prompts' first `shared` real tokens are the same in every row and
  each row has at least one token after them (sampler.shared_prefix_length). They are
  prefilled once, for one row, and every row's cache starts with a copy of theirs; the
  rest of each prompt follows, left-padded: the cache holds [prefix | pads | rest] where
  the prompts hold [pads | prefix | rest]. Attention reads slots through the mask and
  positions count real tokens, so the layout changes nothing a row computes; the copy
  saves (B - 1) x shared tokens of prefill, a chat template's system prompt.
  """
  B, P = prompts_BxP.shape
  cfg = model.cfg
  if not shared:
    hidden, cache = model(prompts_BxP, positions_from_mask(prompt_mask_BxP), prompt_mask_BxP,
                          cache=init_cache(cfg, B, P), slot0=0)
    return hidden[:, -1], cache, prompt_mask_BxP
  C = shared
  # Row i's prompt starts at column P - len_i; its first C tokens are every row's.
  start = P - prompt_mask_BxP[0].sum(dtype=jnp.int32)
  prefix_1xC = jax.lax.dynamic_slice_in_dim(prompts_BxP[:1], start, C, axis=1)
  kv_valid_BxP = jnp.concatenate([jnp.ones((B, C), bool), prompt_mask_BxP[:, :P - C]], axis=1)
  _, cache = model(prefix_1xC, jnp.arange(C)[None], kv_valid_BxP[:1],
                   cache=init_cache(cfg, 1, P), slot0=0)
  cache = jax.tree.map(lambda x: jnp.broadcast_to(x, (B,) + x.shape[1:]), cache)
  # Row i's rest, right-aligned in columns C..P-1: prompt columns C.. hold it where the
  # mask (shifted by C) is set; the other columns are masked out whatever they hold.
  positions_BxP = positions_from_mask(kv_valid_BxP)
  hidden, cache = model(prompts_BxP[:, C:], positions_BxP[:, C:], kv_valid_BxP, cache=cache,
                        slot0=C)
  return hidden[:, -1], cache, kv_valid_BxP


def filter_logits(logits_BxV, top_k: int = 0, top_p: float = 1.0):
  """Sets to -inf every logit outside the top-k and outside the top-p nucleus.

  The nucleus is the smallest set of most likely tokens whose probability reaches top_p;
  ties at either threshold are kept.
  """
  if top_k > 0:
    # The k-th largest as the least of the top k: asked for top_k's last value alone, XLA
    # sorts the whole row, many times the cost of the rest of a decode step.
    top_BxK = jax.lax.top_k(logits_BxV, min(top_k, logits_BxV.shape[-1]))[0]
    kth = jnp.min(top_BxK, axis=-1, keepdims=True)
    logits_BxV = jnp.where(logits_BxV < kth, -jnp.inf, logits_BxV)
    if top_p < 1.0:
      threshold = nucleus_in_top(top_BxK, logits_BxV, top_p)
      logits_BxV = jnp.where(logits_BxV < threshold, -jnp.inf, logits_BxV)
  elif top_p < 1.0:
    nucleus = nucleus_by_bisection if platforms.sort_is_slow() else nucleus_by_sort
    logits_BxV = jnp.where(logits_BxV < nucleus(logits_BxV, top_p), -jnp.inf, logits_BxV)
  return logits_BxV


def nucleus_in_top(top_BxK, filtered_BxV, top_p):
  """nucleus_by_sort's threshold for a row left with its top k (top_BxK, descending, as
  lax.top_k gives them): the nucleus lies among them, already sorted. Values tied with
  the k-th that the filter kept come after it in the order, so they change the
  normalizer (summed over the whole filtered row) and nothing before them."""
  # The max as a reduction, not top_BxK[:, :1]: XLA turns a slice of top_k into a sort.
  first = jnp.max(top_BxK, axis=-1, keepdims=True)
  total = jnp.sum(jnp.exp(filtered_BxV - first), axis=-1, keepdims=True)
  probs = jnp.exp(top_BxK - first) / total
  kept = jnp.cumsum(probs, axis=-1) - probs < top_p
  return jnp.min(jnp.where(kept, top_BxK, jnp.inf), axis=-1, keepdims=True)


def nucleus_by_sort(logits_BxV, top_p):
  """[B, 1]: the least logit of each row's nucleus, from the row sorted (all of it its
  "top", summed in sorted order as softmax over the sorted row would)."""
  sorted_desc = -jnp.sort(-logits_BxV, axis=-1)
  return nucleus_in_top(sorted_desc, sorted_desc, top_p)


def nucleus_by_bisection(logits_BxV, top_p):
  """nucleus_by_sort's threshold without a sort: the least logit v whose strictly greater
  logits hold less than top_p of the probability, found by bisecting v over the floats'
  order (32 halvings of the int32 keys that order them). The mass above v is summed
  unsorted, so a nucleus whose mass lies within rounding of top_p may differ in its last
  tokens from the sorted cumulative sum's.

  Why: XLA:CPU sorts a row of a large vocabulary with scalar code, so a many-row decode
  step spent most of its time sorting; the 32 masked sums take a small fraction of it."""
  top = jnp.max(logits_BxV, axis=-1, keepdims=True)
  weights = jnp.exp(logits_BxV - top)
  total = jnp.sum(weights, axis=-1, keepdims=True)
  # Invariant: the mass above lo's value reaches top_p and the mass above hi's does not.
  lo, hi = _order_key(jnp.min(logits_BxV, axis=-1, keepdims=True)) - 1, _order_key(top)

  def halve(_, bounds):
    lo, hi = bounds
    # (hi - lo) // 2 through uint32: the difference of two int32 keys can overflow int32.
    mid = lo + ((hi.astype(jnp.uint32) - lo.astype(jnp.uint32)) >> 1).astype(jnp.int32)
    above = jnp.sum(jnp.where(logits_BxV > _key_value(mid), weights, 0), axis=-1,
                    keepdims=True)
    short = above < top_p * total
    return jnp.where(short, lo, mid), jnp.where(short, mid, hi)

  return _key_value(jax.lax.fori_loop(0, 32, halve, (lo, hi))[1])


def _order_key(x):
  """int32 keys in the order of the float32 values x (-0.0 just below +0.0)."""
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)
  return jnp.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def _key_value(key):
  """The float32 value of an _order_key."""
  return jax.lax.bitcast_convert_type(jnp.where(key < 0, key ^ 0x7FFFFFFF, key), jnp.float32)


def pick(logits_BxV, key, params: SamplingParams, rows_B):
  """Next tokens and their log-probs (see the module docstring for which distribution).

  Row r draws from fold_in(key, rows_B[r]), its index in the whole batch, so a row samples
  the same tokens whichever device, and beside whichever other rows, it is decoded.
  """
  keys = None if params.greedy else jax.vmap(jax.random.fold_in, (None, 0))(key, rows_B)
  return pick_with_keys(logits_BxV, keys, params)


def pick_with_keys(logits_BxV, keys_B, params: SamplingParams):
  """pick with each row's own key (unused when greedy)."""
  if params.greedy:
    return greedy_pick(logits_BxV)
  scaled = logits_BxV / params.temperature
  tokens = gumbel_max(keys_B, filter_logits(scaled, params.top_k, params.top_p))
  return tokens.astype(jnp.int32), chosen_log_probs(scaled, tokens)


def greedy_pick(logits_BxV):
  """(argmax_rows(logits), chosen_log_probs(logits, argmax)): each row's first maximum and
  its log-prob.

  On CPU the maximum is the first entry where logits - max is 0 (cheaper than an argmax
  there). A row where no difference is 0 or whose log-prob is NaN (a NaN or +inf logit)
  sends the batch to argmax_rows (its log-prob is NaN either way)."""
  logits_BxV = logits_BxV.astype(jnp.float32)
  if not platforms.argmax_is_slow():
    tokens_B = argmax_rows(logits_BxV).astype(jnp.int32)
    return tokens_B, chosen_log_probs(logits_BxV, tokens_B)
  V = logits_BxV.shape[-1]
  first_B = _first_true(logits_BxV - jnp.max(logits_BxV, axis=-1, keepdims=True) == 0)
  log_prob_B = chosen_log_probs(logits_BxV, jnp.minimum(first_B, V - 1))
  # A NaN logit: XLA:CPU's max may skip it, but the sum does not.
  found = (first_B < V) & ~jnp.isnan(log_prob_B)
  tokens_B = jax.lax.cond(jnp.all(found), lambda: first_B,
                          lambda: argmax_rows(logits_BxV).astype(jnp.int32))
  return tokens_B, log_prob_B


def chosen_log_probs(logits_BxV, tokens_B):
  """log_softmax(logits_BxV)[b, tokens_B[b]] by the very operations of the trainer's
  teacher-forced pass (chunked_head.softmax_stats: one max, one variadic sum, then
  picked - (max + log sum)), without writing the [B, V] log-probs out (12.5 MB a decode
  step at 64 rows of a 49k vocabulary).

  Why not a log-softmax of its own: (picked - max) - log sum and picked - (max + log sum)
  round differently, and a plain sum adds in another order than the variadic reduction;
  each cost the sampler's float32 log-probs an ulp against the trainer's for the same
  logits (tests/test_rollout_agents.py measures what is left)."""
  return softmax_stats(logits_BxV[:, None, :], tokens_B[:, None], 1.0)[0][:, 0]


def first_max(x_V):
  """jnp.argmax(x_V) (the first maximum; the first NaN if any), as a max and a min."""
  return _first_maxima(x_V[None])[0]


def _first_maxima(x_BxV):
  """Per row, the index of the first maximum (the first NaN if any): a max, then a min over
  the indices where it is reached. The indices are counted in float32 where they are
  exact (V <= 2^24): XLA:CPU vectorizes a float32 min, not an int32 one, and either beats
  jnp.argmax's scalar reduction."""
  return _first_true((x_BxV == jnp.max(x_BxV, axis=-1, keepdims=True)) | jnp.isnan(x_BxV))


def _first_true(mask_BxV):
  """Per row, the index of the first True, or V where there is none (see _first_maxima
  for why the indices are float32 where exact)."""
  V = mask_BxV.shape[-1]
  dtype = jnp.float32 if V <= 2**24 else jnp.int32
  index = jax.lax.broadcasted_iota(dtype, mask_BxV.shape, mask_BxV.ndim - 1)
  return jnp.min(jnp.where(mask_BxV, index, jnp.asarray(V, dtype)), axis=-1).astype(jnp.int32)


def argmax_rows(logits_BxV):
  """jnp.argmax(logits_BxV, axis=-1); on CPU as _first_maxima (argmax's (value, index)
  reduction runs there as scalar code)."""
  if not platforms.argmax_is_slow():
    return jnp.argmax(logits_BxV, axis=-1)
  return _first_maxima(logits_BxV)


def gumbel_max(keys_B, logits_BxV):
  """The tokens `vmap(jax.random.categorical)` draws from these keys and logits, exactly
  (the same Gumbel noise, the first maximum, NaN counted as the maximum as argmax does).

  Why not categorical itself: XLA:CPU fuses the Gumbel noise into argmax's reduction,
  which runs as scalar code (argmax alone is as fast as a max), and the noise of 64 rows
  of a 49k vocabulary does not fit in cache; a max and a min over the noisy logits are
  vectorized, and rows taken 8 at a time stay in cache, several times faster (the more so
  the more rows). Nothing is reshaped along the vocabulary,
  which tensor-parallel generation splits across devices.
  """
  def row(key_and_logits):
    key, logits_V = key_and_logits
    return first_max(logits_V + jax.random.gumbel(key, logits_V.shape, logits_V.dtype))

  if not platforms.argmax_is_slow():
    return jax.vmap(row)((keys_B, logits_BxV))
  return jax.lax.map(row, (keys_B, logits_BxV), batch_size=8)


def grow(cache, kv_valid_BxS, width):
  """Widens a cache (and its validity mask) to `width` slots with empty slots on the right."""
  extra = width - kv_valid_BxS.shape[1]
  pad = lambda x, axis: jnp.pad(x, [(0, extra if a == axis else 0) for a in range(x.ndim)])  # noqa: E731
  return ([{"k": pad(c["k"], 3), "v": pad(c["v"], 2)} for c in cache], pad(kv_valid_BxS, 1))


def decode_segments(max_new_tokens: int) -> int:
  """Up to 4 loop segments, each at least 32 steps: fewer wasted reads, bounded code size."""
  return max(1, min(4, max_new_tokens // 32))


def kernel_attends(model) -> bool:
  """Whether every layer's decode step attends through the CPU decode-attention kernel
  (hflax.platforms.cpu.attention), which reads each row only up to its last visible slot:
  a cache grown once to its full width then costs it no reads, and one loop saves the
  copies of the whole cache that growing it between segments makes (a few percent of a
  call)."""
  layers = [m for _, m in nnx.iter_modules(model) if isinstance(m, Attention)]
  return (bool(layers) and all(getattr(m, "kernel_decodes", False) for m in layers)
          and platforms.decode_attention_kernel_usable(model.cfg.dtype))


def segment_ends(max_new_tokens: int, segments: int) -> list[int]:
  """Decode steps at which the cache grows: attention reads only slots that can be filled."""
  return sorted({-(-max_new_tokens * (i + 1) // segments) for i in range(segments)})


def outputs(prompts, prompt_mask, out_tokens, out_logp, out_mask, routes=None) -> dict:
  """The sampler's result fields from its prompt rows and response arrays (and, given
  prompt and response routes, their "routes" field)."""
  attention_mask = jnp.concatenate([prompt_mask, out_mask], axis=1)
  extra = {} if routes is None else {"routes": jnp.concatenate(routes, axis=1)}
  return extra | {
      "prompts": prompts,
      "prompt_mask": prompt_mask,
      "responses": out_tokens,
      "response_mask": out_mask,
      "input_ids": jnp.concatenate([prompts, out_tokens], axis=1),
      "attention_mask": attention_mask,
      "position_ids": positions_from_mask(attention_mask),
      "rollout_log_probs": out_logp,
      "response_length": out_mask.sum(axis=1).astype(jnp.int32),
  }
