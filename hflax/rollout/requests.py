"""The rollout engine's host side: what a request is, what comes back, and the host's
records of slots (hflax.rollout.engine drives them; engine_programs compiles the steps)."""
from __future__ import annotations

import dataclasses
from typing import Hashable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

MAX_STOP_IDS = 8  # stop ids per slot (the engine's and the request's): a static width


@dataclasses.dataclass
class Request:
  """One sequence to continue. prompt_ids: its token ids (the whole context so far);
  max_new_tokens: at most the engine's (default: the engine's); stop_ids: tokens that end
  it besides the engine's eos ids (a tool call's closing token, say); key and row: its
  sampling stream (default: the engine's key and a row counted per submission).

  keep: when it finishes, its slot keeps the cache (a trajectory's next turn continues
  from it) until a request `continues` it or `release(id)`. continues: the id of a kept
  request; prompt_ids are then only the new tokens (a tool's observation and the next
  turn's header), prefilled after the kept context and its last sampled token, so the
  context is never tokenized or prefilled again.

  partial: what an earlier engine sampled for this request (an aborted request's tokens, a
  checkpoint's), with their log-probs and versions, which it keeps. Prompt and tokens are
  prefilled by the current weights, and sampling goes on at token len(partial.token_ids)
  of the request's stream (key, row), where the interrupted request would have; its
  max_new_tokens counts the partial tokens, and its completion holds them."""
  prompt_ids: Sequence[int]
  id: Hashable = None
  max_new_tokens: int | None = None
  stop_ids: tuple[int, ...] = ()
  key: jax.Array | None = None
  row: int | None = None
  keep: bool = False
  continues: Hashable = None
  partial: Completion | None = None


@dataclasses.dataclass
class Completion:
  """A request's result: the tokens sampled, each one's log-prob and the weight version
  that sampled it; finish_reason "stop" (an eos or stop id, the last token), "length"
  (max_new_tokens) or "abort" (the tokens so far)."""
  id: Hashable
  prompt_ids: list[int]
  token_ids: list[int]
  log_probs: list[float]
  versions: list[int]
  finish_reason: str


@dataclasses.dataclass
class Held:
  """A finished request kept for a continuation: its slot and where its context ends."""
  slot: int
  last_token: int
  end: int  # the column the last token goes to: the context holds columns 0..end-1


@dataclasses.dataclass
class Live:
  """A decoding request and what it has sampled so far, each token's version beside it."""
  request: Request
  tokens: list
  log_probs: list
  versions: list


def first_live(request: Request) -> Live:
  """A request's record before its first token here: a resumed one's partial tokens."""
  p = request.partial
  return (Live(request, [], [], []) if p is None else
          Live(request, list(p.token_ids), list(p.log_probs), list(p.versions)))


def completion(live: Live, reason: str) -> Completion:
  """What the host hands back for `live`, ended for `reason`."""
  return Completion(live.request.id, list(live.request.prompt_ids), live.tokens,
                    live.log_probs, live.versions, reason)


def stop_row(stop_ids, eos_ids) -> np.ndarray:
  """A slot's stop ids and the engine's eos ids, padded with -1 to MAX_STOP_IDS."""
  ids = sorted(set(stop_ids) | set(eos_ids))
  return np.asarray(ids + [-1] * (MAX_STOP_IDS - len(ids)), np.int32)


def admission_rows(count: int, slots: int) -> int:
  """Rows one admission prefills: a power of two (a few programs compile, not one per
  count), at most the slots."""
  return min(slots, 1 << max(0, count - 1).bit_length())


def key_data(key) -> np.ndarray:
  """A key's raw uint32 words (new-style typed keys and legacy uint32 keys alike)."""
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  return np.asarray(key, np.uint32)
