"""The rollout engine's slot table, host side: admitting waiting requests into free slots
(one prefill of their prompts), continuing kept contexts, and finishing or freeing a slot.

RolloutEngine (hflax.rollout.engine) takes these as a base class: they read and write
its slot records (_live, _held, _next_col, _waiting) and its carry, and call the
compiled programs (engine_programs) with its weights.
"""
from __future__ import annotations

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from hflax.rollout import sampler
from hflax.rollout.engine_programs import empty_carry, extend, prefill_into
from hflax.rollout.requests import (Completion, Held, Live, Request, admission_rows, completion,
                                    key_data, stop_row)


class SlotTable:
  """The admission and release half of RolloutEngine (see the module docstring)."""

  def _admit(self) -> list[Completion]:
    graphdef, state = self.weights
    if self._carry is None:
      self._carry = self._place(empty_carry(nnx.merge(graphdef, state).cfg, self.slots,
                                            self.cache_width))
    finished = self._continue([r for r in self._waiting if r.continues is not None])
    self._waiting = [r for r in self._waiting if r.continues is None]
    held = {h.slot for h in self._held.values()}
    free = [s for s, live in enumerate(self._live) if live is None and s not in held]
    take = self._waiting[:len(free)]
    if not take:
      return finished
    del self._waiting[:len(take)]
    K = admission_rows(len(take), self.slots)
    picks = [take[i % len(take)] for i in range(K)]  # padding rows repeat real ones
    width = min(sampler.length_bucket(max(len(r.prompt_ids) for r in take)), self.prompt_width)
    tokens, mask = sampler.left_pad([r.prompt_ids for r in picks], self.sampling.pad_id, width)
    slots = np.full(K, self.slots, np.int32)  # out of range: padding rows write nowhere
    slots[:len(take)] = free[:len(take)]
    per_row = {**self._sampling_rows(picks), "tokens": tokens, "mask": mask, "slot": slots}
    self._carry, (first, logp, going) = prefill_into(
        graphdef, state, self._carry, per_row, params=self.sampling,
        prompt_width=self.prompt_width)
    return finished + self._started(take, slots, [self.prompt_width] * len(take),
                                    first, logp, going)

  def _started(self, requests, slots, columns, first, logp, going) -> list[Completion]:
    """Marks admitted requests as decoding (their first token picked) and returns those
    that ended at it."""
    first, logp, going = jax.device_get((first, logp, going))
    finished = []
    for i, r in enumerate(requests):
      s = int(slots[i])
      self._live[s] = Live(r, [int(first[i])], [float(logp[i])], [self.version])
      self._next_col[s] = columns[i]
      if not going[i]:
        finished.append(self._finish(s))
    return finished

  def _continue(self, requests: list[Request]) -> list[Completion]:
    """Prefills each continuing request's new tokens after its kept context, in the slot
    that holds it, and picks its first token."""
    if not requests:
      return []
    K = admission_rows(len(requests), self.slots)
    picks = [requests[i % len(requests)] for i in range(K)]
    held = [self._held[r.continues] for r in picks]
    T = sampler.length_bucket(max(len(r.prompt_ids) for r in requests) + 1, minimum=1)
    tokens = np.full((K, T), self.sampling.pad_id, np.int32)
    for i, (r, h) in enumerate(zip(picks, held)):
      tokens[i, :len(r.prompt_ids) + 1] = [h.last_token] + r.prompt_ids
    lengths = np.asarray([len(r.prompt_ids) + 1 for r in picks], np.int32)
    starts = np.asarray([h.end for h in held], np.int32)
    slots = np.full(K, self.slots, np.int32)
    slots[:len(requests)] = [h.slot for h in held[:len(requests)]]
    # The most tokens a reply can have: the context holds every token, its last included.
    room = self.context_width - (starts + lengths)
    per_row = {**self._sampling_rows(picks), "tokens": tokens, "length": lengths,
               "start": starts, "slot": slots}
    per_row["max_new"] = np.minimum(per_row["max_new"], room).astype(np.int32)
    for r in requests:
      del self._held[r.continues]
      self._ids.discard(r.continues)
    self._carry, (first, logp, going) = extend(*self.weights, self._carry, per_row,
                                               params=self.sampling)
    return self._started(requests, slots, (starts + lengths)[:len(requests)].tolist(),
                         first, logp, going)

  def _sampling_rows(self, picks) -> dict:
    keys = [r.key if r.key is not None else self.key for r in picks]
    return {"key": np.stack([key_data(k) for k in keys]),
            "row": np.asarray([r.row for r in picks], np.int32),
            "max_new": np.asarray([r.max_new_tokens or self.sampling.max_new_tokens
                                   for r in picks], np.int32),
            "stops": np.stack([stop_row(r.stop_ids, self.sampling.eos_ids) for r in picks])}

  def _finish(self, s: int) -> Completion:
    live = self._live[s]
    r = live.request
    stops = set(r.stop_ids) | set(self.sampling.eos_ids)
    reason = "stop" if live.tokens and live.tokens[-1] in stops else "length"
    self._free(s, keep=r.keep)
    return completion(live, reason)

  def _free(self, s: int, keep: bool = False):
    """Ends slot s's request; with keep its context stays for a continuation."""
    live = self._live[s]
    if keep:  # the last token's keys and values are not written yet: its column is next
      self._held[live.request.id] = Held(s, live.tokens[-1],
                                          self._next_col[s] + len(live.tokens) - 1)
    else:
      self._ids.discard(live.request.id)
    self._live[s] = None
    self._carry = {**self._carry, "active": self._carry["active"].at[s].set(False)}

  def _place(self, carry: dict) -> dict:
    if self.mesh is None:
      return carry
    rows = NamedSharding(self.mesh, PartitionSpec("data"))
    return jax.device_put(carry, jax.tree.map(lambda _: rows, carry))
