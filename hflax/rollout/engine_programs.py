"""The rollout engine's compiled programs: a slot table's cache and counters (the carry),
admission's prefill into free slots, the copy of a prefilled prompt into the slots of
requests admitted with the same prompt, a continuation's prefill after a kept context, and
`steps` decode steps of every busy slot. The host side (hflax.rollout.engine) calls them
between steps; each donates the carry it is given."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from hflax.models.transformer import init_cache, positions_from_mask
from hflax.rollout.decoding import SamplingParams, pick_with_keys, prefill
from hflax.rollout.requests import MAX_STOP_IDS


def empty_carry(cfg, slots: int, width: int) -> dict:
  """The carry of `slots` idle slots, each with a cache `width` columns wide."""
  S, W = slots, width
  key_shape = jax.random.key_data(jax.random.key(0)).shape
  return {"cache": init_cache(cfg, S, W), "kv_valid": jnp.zeros((S, W), bool),
          "tok": jnp.zeros((S,), jnp.int32), "pos": jnp.zeros((S,), jnp.int32),
          "step": jnp.ones((S,), jnp.int32), "col": jnp.zeros((S,), jnp.int32),
          "active": jnp.zeros((S,), bool),
          "key": jnp.zeros((S,) + key_shape, jnp.uint32), "row": jnp.zeros((S,), jnp.int32),
          "max_new": jnp.ones((S,), jnp.int32),
          "stops": jnp.full((S, MAX_STOP_IDS), -1, jnp.int32)}


def carry_bytes(cfg, slots: int, width: int) -> int:
  """Bytes empty_carry(cfg, slots, width) takes (shapes only, nothing allocated)."""
  shapes = jax.eval_shape(lambda: empty_carry(cfg, slots, width))
  return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(shapes))


def sampling_keys(key_data, steps, rows):
  """Each slot's key for its token `steps`: fold_in(fold_in(key, step), row)."""
  def fold(k, s, r):
    return jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(k), s), r)
  return jax.vmap(fold)(key_data, steps, rows)


@functools.partial(jax.jit, static_argnames=("graphdef", "params", "prompt_width"),
                   donate_argnames=("carry",))
def prefill_into(graphdef, state, carry, rows, *, params: SamplingParams, prompt_width: int):
  """Prefills the admitted prompts (rows: their left-padded tokens and mask, the slot each
  goes to, keys, rows, limits, stop ids) and writes each one's cache into its slot,
  right-aligned in the slot's first prompt_width columns; picks each first token (step 0).
  Returns the carry, (first tokens, their log-probs, whether each goes on) and each
  prompt's last hidden state (what copy_prefill picks from)."""
  model = nnx.merge(graphdef, state)
  tokens, mask = rows["tokens"], rows["mask"]
  K, p = tokens.shape
  last, cache, kv_valid = prefill(model, tokens, mask)
  first, logp, going = _first_tokens(model, last, rows, params)
  W = carry["kv_valid"].shape[1]
  def widen(x, axis):  # the prompt right-aligned in the slot's first prompt_width columns
    return jnp.pad(x, [(prompt_width - p, W - prompt_width) if a == axis else (0, 0)
                       for a in range(x.ndim)])
  at = rows["slot"]
  put = lambda old, new: old.at[at].set(new, mode="drop")  # noqa: E731
  new_cache = [{"k": put(o["k"], widen(n["k"], 3)), "v": put(o["v"], widen(n["v"], 2))}
               for o, n in zip(carry["cache"], cache)]
  carry = {**carry, "cache": new_cache,
           "kv_valid": put(carry["kv_valid"], widen(kv_valid, 1)),
           "tok": put(carry["tok"], first),
           "pos": put(carry["pos"], positions_from_mask(mask)[:, -1] + 1),
           "step": put(carry["step"], jnp.ones((K,), jnp.int32)),
           "col": put(carry["col"], jnp.full((K,), prompt_width, jnp.int32)),
           "active": put(carry["active"], going),
           "key": put(carry["key"], rows["key"]), "row": put(carry["row"], rows["row"]),
           "max_new": put(carry["max_new"], rows["max_new"]),
           "stops": put(carry["stops"], rows["stops"])}
  return carry, (first, logp, going), last


def _first_tokens(model, last, rows, params: SamplingParams):
  """Each row's step-0 token and log-prob from its prompt's last hidden state, with its
  own key and row, and whether it goes on (no stop id, room for more)."""
  K = last.shape[0]
  step = rows.get("first_step", jnp.zeros((K,), jnp.int32))
  keys = None if params.greedy else sampling_keys(rows["key"], step, rows["row"])
  first, logp = pick_with_keys(model.step_logits(last), keys, params)
  going = ~jnp.any(first[:, None] == rows["stops"], axis=1) & (rows["max_new"] > step + 1)
  return first, logp, going


@functools.partial(jax.jit, static_argnames=("graphdef", "params"), donate_argnames=("carry",))
def copy_prefill(graphdef, state, carry, last, rows, *, params: SamplingParams):
  """Requests admitted with the same prompt as one prefill_into just prefilled (a group's
  samples): slot rows["slot"][i] gets a copy of slot rows["from"][i]'s row (its cache,
  validity, position and column), and its first token is picked from that prompt's last
  hidden state, last[rows["src"][i]], with its own key, row, stops and limit.

  The pick runs as prefill_into's does, the head and the pick over as many rows as its
  call had, so a copy's first token and log-prob are bit for bit those its own prefill
  would give; its cache is the prompt's, the same bits. Returns what prefill_into does
  but the hidden states."""
  model = nnx.merge(graphdef, state)
  first, logp, going = _first_tokens(model, last[rows["src"]], rows, params)
  K = first.shape[0]
  at, src = rows["slot"], rows["from"]
  put = lambda old, new: old.at[at].set(new, mode="drop")  # noqa: E731
  copy = lambda x: put(x, x[src])  # noqa: E731
  carry = {**carry, "cache": [{"k": copy(c["k"]), "v": copy(c["v"])} for c in carry["cache"]],
           "kv_valid": copy(carry["kv_valid"]), "pos": copy(carry["pos"]),
           "col": copy(carry["col"]), "tok": put(carry["tok"], first),
           "step": put(carry["step"], jnp.ones((K,), jnp.int32)),
           "active": put(carry["active"], going),
           "key": put(carry["key"], rows["key"]), "row": put(carry["row"], rows["row"]),
           "max_new": put(carry["max_new"], rows["max_new"]),
           "stops": put(carry["stops"], rows["stops"])}
  return carry, (first, logp, going)


@functools.partial(jax.jit, static_argnames=("graphdef", "params", "steps"),
                   donate_argnames=("carry",))
def decode_steps(graphdef, state, carry, *, params: SamplingParams, steps: int):
  """Up to `steps` decode steps of every active slot (fewer once none is active). Each
  step writes a slot's last token's keys and values at its column (a fresh request's
  step-t token at prompt_width + t - 1: the batch sampler's layout) and picks the next;
  a slot stops at a stop id or its max_new. Returns the carry and, per slot and step,
  the token, its log-prob and whether the slot emitted it."""
  model = nnx.merge(graphdef, state)
  S, W = carry["kv_valid"].shape
  out = {"tokens": jnp.full((S, steps), params.pad_id, jnp.int32),
         "log_probs": jnp.zeros((S, steps), jnp.float32),
         "emitted": jnp.zeros((S, steps), bool)}

  def body(state_i):
    c, o, i = state_i
    active, step = c["active"], c["step"]
    # Idle slots write where their next token would go (a kept context's free column),
    # left invalid: a continuation overwrites it.
    col = jnp.minimum(c["col"], W - 1)
    rows = jnp.arange(S)
    kv_valid = c["kv_valid"].at[rows, col].set(active | c["kv_valid"][rows, col])
    hidden, cache = model(c["tok"][:, None], c["pos"][:, None], kv_valid, cache=c["cache"],
                          slot0=col)
    keys = None if params.greedy else sampling_keys(c["key"], step, c["row"])
    tok, logp = pick_with_keys(model.step_logits(hidden[:, 0]), keys, params)
    tok = jnp.where(active, tok, params.pad_id)
    o = {"tokens": o["tokens"].at[:, i].set(tok),
         "log_probs": o["log_probs"].at[:, i].set(jnp.where(active, logp, 0.0)),
         "emitted": o["emitted"].at[:, i].set(active)}
    ends = jnp.any(tok[:, None] == c["stops"], axis=1) | (step + 1 >= c["max_new"])
    c = {**c, "cache": cache, "kv_valid": kv_valid, "tok": tok,
         "pos": jnp.where(active, c["pos"] + 1, c["pos"]),
         "step": jnp.where(active, step + 1, step), "col": jnp.where(active, col + 1, col),
         "active": active & ~ends}
    return c, o, i + 1

  carry, out, _ = jax.lax.while_loop(lambda s: (s[2] < steps) & s[0]["active"].any(), body,
                                     (carry, out, jnp.int32(0)))
  return carry, out


@functools.partial(jax.jit, static_argnames=("graphdef", "params"), donate_argnames=("carry",))
def extend(graphdef, state, carry, rows, *, params: SamplingParams):
  """Continuations: row i's tokens (its kept context's last token, then the new ones,
  right-padded) are prefilled into slot rows["slot"][i] at columns start.., against the
  context already there, and its first token picked (step 0). Padding columns are
  written but never marked valid; the next decode step overwrites the first of them."""
  S = carry["kv_valid"].shape[0]
  at = jnp.minimum(rows["slot"], S - 1)  # padding rows read a slot, write none
  return _prefill_after(nnx.merge(graphdef, state), carry, rows, carry["kv_valid"][at],
                        carry["pos"][at], params)


@functools.partial(jax.jit, static_argnames=("graphdef", "params"), donate_argnames=("carry",))
def resume_into(graphdef, state, carry, rows, *, params: SamplingParams):
  """Resumed requests (Request.partial): row i's prompt and partial tokens, right-padded,
  are prefilled into free slot rows["slot"][i] from column 0 (start 0, positions from 0,
  whatever the slot held before masked out), and its next token is picked as token
  rows["first_step"][i] of its stream. Returns what extend does."""
  K = rows["tokens"].shape[0]
  W = carry["kv_valid"].shape[1]
  return _prefill_after(nnx.merge(graphdef, state), carry, rows, jnp.zeros((K, W), bool),
                        jnp.zeros((K,), jnp.int32), params)


def _prefill_after(model, carry, rows, kv_valid, pos, params: SamplingParams):
  """Prefills row i's tokens (rows["length"][i] of them real) into slot rows["slot"][i]
  at columns rows["start"][i].., after the context that kv_valid [K, W] marks (positions
  going on from pos [K]), and picks its next token at its stream's step
  rows["first_step"][i] (default 0), which the decode steps then count on from."""
  tokens, length, start, at = rows["tokens"], rows["length"], rows["start"], rows["slot"]
  K, T = tokens.shape
  S = carry["kv_valid"].shape[0]
  take = lambda x: x[jnp.minimum(at, S - 1)]  # noqa: E731  padding rows read a slot, write none
  real_KxT = jnp.arange(T)[None] < length[:, None]
  columns_KxT = start[:, None] + jnp.arange(T)
  kv_valid = kv_valid.at[jnp.arange(K)[:, None], columns_KxT].set(real_KxT, mode="drop")
  positions = pos[:, None] + jnp.arange(T)
  hidden, cache = model(tokens, positions, kv_valid,
                        cache=[{"k": take(c["k"]), "v": take(c["v"])} for c in carry["cache"]],
                        slot0=start)
  last = jnp.take_along_axis(hidden, (length - 1)[:, None, None], axis=1)[:, 0]
  first, logp, going = _first_tokens(model, last, rows, params)
  step = rows.get("first_step", jnp.zeros((K,), jnp.int32))
  put = lambda old, new: old.at[at].set(new, mode="drop")  # noqa: E731
  carry = {**carry,
           "cache": [{"k": put(o["k"], n["k"]), "v": put(o["v"], n["v"])}
                     for o, n in zip(carry["cache"], cache)],
           "kv_valid": put(carry["kv_valid"], kv_valid), "tok": put(carry["tok"], first),
           "pos": put(carry["pos"], positions[jnp.arange(K), length - 1] + 1),
           "step": put(carry["step"], step + 1),
           "col": put(carry["col"], start + length), "active": put(carry["active"], going),
           "key": put(carry["key"], rows["key"]), "row": put(carry["row"], rows["row"]),
           "max_new": put(carry["max_new"], rows["max_new"]),
           "stops": put(carry["stops"], rows["stops"])}
  return carry, (first, logp, going)
