"""Continuous batching: a fixed number of decode slots, each refilled as its row ends.

One long response then holds one slot instead of every slot of its wave, so generation
time follows the total number of tokens rather than waves of the longest row.

All prompts of a call are prefilled up front in one batch, as the wave sampler does, and
their KV cache kept (width P): a slot that takes row r copies prompt r // n's columns in,
so the n samples of a prompt share one prefill, and row r's first token is the one the
wave sampler picks from the same logits. The slots' cache has the wave sampler's layout
(prompt in columns 0..P-1, response token s at column P + s - 1), each row writing at
its own column (the model's per-row slot0), so a row's attention reads what it would in
a wave. Every row keeps its own step counter and draws token s with
fold_in(fold_in(rng, s), row), so tokens and log-probs are the wave sampler's. On CPU the
last rows, once nobody waits, move into loops of fewer slots (tail_slots).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hflax import platforms
from hflax.models.transformer import (cache_columns, cache_where, init_cache,
                                      positions_from_mask)
from hflax.rollout.decoding import (SamplingParams, grow, outputs, pick, pick_with_keys,
                                    prefill, segment_ends)


# On CPU a decode step's time follows its rows, and a GRPO rollout's last rows run with
# most slots idle (bench/rl_step.py: a fifth to two fifths of the steps with at most half
# of the slots busy).
# Accelerators' small decode steps cost about the same whatever their rows: one size.
TAIL_MIN_SLOTS = 4


def tail_slots(slots: int) -> tuple[int, ...]:
  """The slot counts a call decodes with as its rows run out: halving, down to
  TAIL_MIN_SLOTS, on CPU; just `slots` elsewhere."""
  sizes = [slots]
  while platforms.step_time_follows_rows() and sizes[-1] // 2 >= TAIL_MIN_SLOTS:
    sizes.append(sizes[-1] // 2)
  return tuple(sizes)


def gather_slots(carry: dict, slots: int) -> dict:
  """The carry with its busy slots first, cut to `slots`; the caller moves only when every
  busy slot fits."""
  keep = jnp.argsort(~carry["active"], stable=True)[:slots]
  per_slot = ("row", "active", "step", "tok", "pos", "kv_valid")
  return {**carry, **{k: carry[k][keep] for k in per_slot},
          "cache": [{"k": c["k"][keep], "v": c["v"][keep]} for c in carry["cache"]]}


def decode_slots(graphdef, state, prompts_BxP, prompt_mask_BxP, rng, live_B, rows_B, *,
                 params: SamplingParams, segments: int, slots: int, shared: int = 0):
  """The wave sampler's _decode for one device's rows, decoded `slots` rows at a time."""
  model = nnx.merge(graphdef, state)
  B, P = prompts_BxP.shape
  N, n, R = params.max_new_tokens, params.n, B * params.n
  K = min(slots, R)
  rows_R = (rows_B[:, None] * n + jnp.arange(n)).reshape(R)
  prompt_pos_BxP = positions_from_mask(prompt_mask_BxP)

  last_BxD, store, store_valid_BxP = prefill(model, prompts_BxP, prompt_mask_BxP, shared)
  logits = jnp.repeat(model.step_logits(last_BxD), n, axis=0)
  first, first_logp = pick(logits, jax.random.fold_in(rng, 0), params, rows_R)
  eos = jnp.asarray(params.eos_ids or (-1,), jnp.int32)
  out_tokens = jnp.full((R, N), params.pad_id, jnp.int32).at[:, 0].set(first)
  out_logp = jnp.zeros((R, N), jnp.float32).at[:, 0].set(first_logp)
  out_mask = jnp.zeros((R, N), bool).at[:, 0].set(True)

  # Rows still going after their first token wait for a slot in batch order.
  waits = ~jnp.isin(first, eos) & jnp.repeat(live_B, n) & (N > 1)
  queue = jnp.argsort(~waits, stable=True).astype(jnp.int32)
  waiting = waits.sum(dtype=jnp.int32)

  def refill(c, free_K):
    """The i-th free slot takes the i-th waiting row; slots nobody takes go idle."""
    K = free_K.shape[0]
    rank = c["next"] + jnp.cumsum(free_K) - 1
    take = free_K & (rank < waiting)
    row = jnp.where(take, queue[jnp.minimum(rank, R - 1)], c["row"])

    def copy_in(c):
      prompt = row // n
      cache, kv_valid = c["cache"], c["kv_valid"]
      def put(old, new, axis):  # a taken slot's first P columns become its prompt's
        S = old.shape[axis]
        new = jnp.pad(new[prompt], [(0, S - P if a == axis else 0) for a in range(old.ndim)])
        taken = take.reshape((K,) + (1,) * (old.ndim - 1)) & (cache_columns(old, axis) < P)
        return cache_where(taken, new, old)

      cache = [{"k": put(o["k"], s["k"], 3), "v": put(o["v"], s["v"], 2)}
               for o, s in zip(cache, store)]
      # The response columns of the slot's previous row stay, unseen: only the mask resets.
      kv_valid = jnp.where(take[:, None], jnp.pad(store_valid_BxP[prompt],
                                                  [(0, 0), (0, kv_valid.shape[1] - P)]),
                           kv_valid)
      return {**c, "cache": cache, "kv_valid": kv_valid,
              "tok": jnp.where(take, first[row], c["tok"]),
              "pos": jnp.where(take, prompt_pos_BxP[prompt, -1] + 1, c["pos"]),
              "step": jnp.where(take, 1, c["step"])}

    c = jax.lax.cond(take.any(), copy_in, lambda c: c, c)
    return {**c, "row": row, "active": take | (c["active"] & ~free_K),
            "next": c["next"] + take.sum(dtype=jnp.int32)}

  def body(c):
    step, row, active = c["step"], c["row"], c["active"]
    col = P + step - 1  # where the previous token's K/V go
    kv_valid = c["kv_valid"].at[jnp.arange(row.shape[0]), col].set(True)
    hidden, cache = model(c["tok"][:, None], c["pos"][:, None], kv_valid, cache=c["cache"],
                          slot0=col)
    keys = None if params.greedy else jax.vmap(
        lambda s, r: jax.random.fold_in(jax.random.fold_in(rng, s), r))(step, rows_R[row])
    tok, logp = pick_with_keys(model.step_logits(hidden[:, 0]), keys, params)
    at = (jnp.where(active, row, R), step)  # idle slots write nowhere
    # Idle slots stand still, so their position stays in the cache's range.
    c = {**c, "cache": cache, "kv_valid": kv_valid, "tok": tok,
         "pos": jnp.where(active, c["pos"] + 1, c["pos"]),
         "step": jnp.where(active, step + 1, step), "it": c["it"] + 1,
         "out_tokens": c["out_tokens"].at[at].set(tok, mode="drop"),
         "out_logp": c["out_logp"].at[at].set(logp, mode="drop"),
         "out_mask": c["out_mask"].at[at].set(True, mode="drop")}
    return refill(c, active & (jnp.isin(tok, eos) | (step + 1 >= N)))

  carry = refill({
      "it": jnp.int32(1), "next": jnp.int32(0), "row": jnp.zeros((K,), jnp.int32),
      "active": jnp.zeros((K,), bool), "step": jnp.ones((K,), jnp.int32),
      "tok": jnp.zeros((K,), jnp.int32), "pos": jnp.zeros((K,), jnp.int32),
      "cache": init_cache(model.cfg, K, P), "kv_valid": jnp.zeros((K, P), bool),
      "out_tokens": out_tokens, "out_logp": out_logp, "out_mask": out_mask,
  }, jnp.ones((K,), bool))

  # A row's step never exceeds the loop's count of iterations, so the cache grows with
  # that count as the wave sampler's does; the last segment runs until every row is done.
  # The tail: once no row waits and the rows still going fit in the next, smaller number of
  # slots, the loop stops and they go on in that many (tail_slots); every segment after
  # that runs no step, so the smaller loops start from the whole-width cache.
  sizes = tail_slots(K)

  def shrinks(c, level):
    if level + 1 == len(sizes):
      return jnp.bool_(False)
    return (c["next"] >= waiting) & (c["active"].sum() <= sizes[level + 1])

  ends = segment_ends(N, segments)
  for i, end in enumerate(ends):
    cache, kv_valid = grow(carry["cache"], carry["kv_valid"], P + end)
    last = i == len(ends) - 1
    cond = lambda c, end=end, last=last: (c["active"].any() & (last | (c["it"] < end))  # noqa: E731
                                          & ~shrinks(c, 0))
    carry = jax.lax.while_loop(cond, body, {**carry, "cache": cache, "kv_valid": kv_valid})
  for level in range(1, len(sizes)):
    carry = jax.lax.while_loop(lambda c, level=level: c["active"].any() & ~shrinks(c, level),
                               body, gather_slots(carry, sizes[level]))

  widen = lambda x: jnp.repeat(x, n, axis=0)  # noqa: E731
  return outputs(widen(prompts_BxP), widen(prompt_mask_BxP), carry["out_tokens"],
                 carry["out_logp"], carry["out_mask"])
