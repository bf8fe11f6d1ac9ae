"""The rollout engine's slot table, host side: admitting waiting requests into free slots
(prefills of their prompts, see SlotTable._calls; a prompt that several requests of one
admission share prefilled once, see SlotTable._copy), continuing kept contexts, and
finishing or freeing a slot.

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
from hflax.rollout.engine_programs import (copy_prefill, empty_carry, extend, prefill_into,
                                           resume_into)
from hflax.rollout.host import host_values
from hflax.rollout.requests import (Completion, Held, Request, completion, first_live,
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
    resumed = [i for i, r in enumerate(take) if r.partial is not None]
    if resumed:
      finished += self._resume([take[i] for i in resumed], [free[i] for i in resumed])
      free = [f for i, f in enumerate(free[:len(take)]) if take[i].partial is None]
      take = [r for r in take if r.partial is None]
      if not take:
        return finished
    leaders, copies = self._leaders(take)
    started = []
    widths = [min(sampler.length_bucket(len(take[i].prompt_ids)), self.prompt_width)
              for i in leaders]
    for width, group in self._calls(widths):
      group = [leaders[j] for j in group]  # indices into take
      picks = [take[group[i % len(group)]] for i in range(self.rows_per_prefill)]
      tokens, mask = sampler.left_pad([r.prompt_ids for r in picks], self.sampling.pad_id, width)
      slots = np.full(len(picks), self.slots, np.int32)  # out of range: padding rows write nowhere
      slots[:len(group)] = [free[i] for i in group]
      per_row = {**self._sampling_rows(picks), "tokens": tokens, "mask": mask, "slot": slots}
      self._carry, (first, logp, going), last = prefill_into(
          graphdef, state, self._carry, per_row, params=self.sampling,
          prompt_width=self.prompt_width)
      self._count(group, take, "prefill")
      # Copy before anything reads the leaders' slots again (a first-token finish frees one).
      pairs = [(i, j) for j, lead in enumerate(group) for i in copies.get(lead, ())]
      for c in range(0, len(pairs), self.rows_per_prefill):
        chunk = pairs[c:c + self.rows_per_prefill]
        started += self._copy([take[i] for i, _ in chunk], [free[i] for i, _ in chunk],
                              [free[group[j]] for _, j in chunk], [j for _, j in chunk], last)
        self._count([i for i, _ in chunk], take, "shared")
      started += self._started([take[i] for i in group], slots,
                               [self.prompt_width] * len(group), first, logp, going)
    return finished + _in_order(started, take)

  def _leaders(self, take: list[Request]) -> tuple[list[int], dict[int, list[int]]]:
    """The requests of an admission that are prefilled (indices into take), and for each
    the later ones with the same prompt that copy its cache (with prefix_sharing on)."""
    first: dict[tuple, int] = {}
    leaders, copies = [], {}
    for i, r in enumerate(take):
      lead = first.setdefault(tuple(r.prompt_ids), i) if self.prefix_sharing else i
      if lead == i:
        leaders.append(i)
      else:
        copies.setdefault(lead, []).append(i)
    return leaders, copies

  def _copy(self, requests, slots, sources, rows, last) -> list[Completion]:
    """One compiled call of copy_prefill: requests (at most rows_per_prefill) go to
    `slots` with a copy of slot sources[i], just prefilled, and pick their first tokens
    from last[rows[i]], the hidden states of that prefill call."""
    K = self.rows_per_prefill
    picks = [requests[i % len(requests)] for i in range(K)]  # padding rows repeat real ones
    to = np.full(K, self.slots, np.int32)  # out of range: padding rows write nowhere
    to[:len(requests)] = slots
    per_row = {**self._sampling_rows(picks), "slot": to,
               "from": np.asarray([sources[i % len(requests)] for i in range(K)], np.int32),
               "src": np.asarray([rows[i % len(requests)] for i in range(K)], np.int32)}
    self._carry, (first, logp, going) = copy_prefill(*self.weights, self._carry, last, per_row,
                                                     params=self.sampling)
    return self._started(requests, to, [self.prompt_width] * len(requests), first, logp, going)

  def _count(self, indices, take, kind: str):
    """Adds an admission's prefilled (or copied) requests to the engine's stats."""
    self.stats[f"{kind}_rows"] += len(indices)
    self.stats[f"{kind}_tokens"] += sum(len(take[i].prompt_ids) for i in indices)
    if kind == "prefill":
      self.stats["prefill_calls"] += 1

  def _calls(self, widths: list[int]) -> list[tuple[int, list[int]]]:
    """How one admission's requests (their padded `widths`) are prefilled: (width, their
    indices) per compiled call, rows_per_prefill of one width at a time. Every call has
    the same rows and each request its own width, so its numerics are those of its own
    tokens alone: XLA picks a program's kernels (and their summation order) by its
    shapes, and a request prefilled in a wider or taller batch would round its log-probs
    apart, by which requests happened to arrive with it (an agent's tool timing)."""
    by_width: dict[int, list[int]] = {}
    for i, width in enumerate(widths):
      by_width.setdefault(width, []).append(i)
    K = self.rows_per_prefill
    return [(width, group[j:j + K]) for width, group in sorted(by_width.items())
            for j in range(0, len(group), K)]

  def _started(self, requests, slots, columns, first, logp, going) -> list[Completion]:
    """Marks admitted requests as decoding (their first token picked) and returns those
    that ended at it."""
    first, logp, going = host_values((first, logp, going))
    finished = []
    for i, r in enumerate(requests):
      s = int(slots[i])
      live = self._live[s] = first_live(r)
      live.tokens.append(int(first[i]))
      live.log_probs.append(float(logp[i]))
      live.versions.append(self.version)
      self._next_col[s] = columns[i] - len(live.tokens) + 1
      if not going[i]:
        finished.append(self._finish(s))
    return finished

  def _continue(self, requests: list[Request]) -> list[Completion]:
    """Prefills each continuing request's new tokens after its kept context, in the slot
    that holds it, and picks its first token."""
    if not requests:
      return []
    held = [self._held[r.continues] for r in requests]
    for r in requests:
      del self._held[r.continues]
      self._ids.discard(r.continues)
    widths = [sampler.length_bucket(len(r.prompt_ids) + 1, minimum=1) for r in requests]
    started = []
    for T, group in self._calls(widths):
      started += self._extend([requests[i] for i in group], [held[i] for i in group], T)
    return _in_order(started, requests)

  def _resume(self, requests: list[Request], slots: list[int]) -> list[Completion]:
    """Prefills resumed requests (Request.partial) into free `slots`, each its prompt and
    partial tokens from column 0, and picks each one's next token (see _calls)."""
    lengths = [len(r.prompt_ids) + len(r.partial.token_ids) for r in requests]
    widths = [min(sampler.length_bucket(n), self.cache_width) for n in lengths]
    K, started = self.rows_per_prefill, []
    for T, group in self._calls(widths):
      picks = [group[i % len(group)] for i in range(K)]  # padding rows repeat real ones
      tokens = np.full((K, T), self.sampling.pad_id, np.int32)
      for i, j in enumerate(picks):
        tokens[i, :lengths[j]] = requests[j].prompt_ids + requests[j].partial.token_ids
      to = np.full(K, self.slots, np.int32)  # out of range: padding rows write nowhere
      to[:len(group)] = [slots[j] for j in group]
      per_row = {**self._sampling_rows([requests[j] for j in picks]), "tokens": tokens,
                 "length": np.asarray([lengths[j] for j in picks], np.int32),
                 "start": np.zeros(K, np.int32), "slot": to,
                 "first_step": np.asarray([len(requests[j].partial.token_ids) for j in picks],
                                          np.int32)}
      self._carry, (first, logp, going) = resume_into(*self.weights, self._carry, per_row,
                                                      params=self.sampling)
      started += self._started([requests[j] for j in group], to,
                               [lengths[j] for j in group], first, logp, going)
    return _in_order(started, requests)

  def _extend(self, requests: list[Request], held: list[Held], T: int) -> list[Completion]:
    """One compiled call of `extend` for continuations of T padded columns (see _calls)."""
    K = self.rows_per_prefill
    picks = [requests[i % len(requests)] for i in range(K)]  # padding rows repeat real ones
    kept = [held[i % len(requests)] for i in range(K)]
    tokens = np.full((K, T), self.sampling.pad_id, np.int32)
    for i, (r, h) in enumerate(zip(picks, kept)):
      tokens[i, :len(r.prompt_ids) + 1] = [h.last_token] + r.prompt_ids
    lengths = np.asarray([len(r.prompt_ids) + 1 for r in picks], np.int32)
    starts = np.asarray([h.end for h in kept], np.int32)
    slots = np.full(K, self.slots, np.int32)  # out of range: padding rows write nowhere
    slots[:len(requests)] = [h.slot for h in held]
    # The most tokens a reply can have: the context holds every token, its last included.
    room = self.context_width - (starts + lengths)
    per_row = {**self._sampling_rows(picks), "tokens": tokens, "length": lengths,
               "start": starts, "slot": slots}
    per_row["max_new"] = np.minimum(per_row["max_new"], room).astype(np.int32)
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


def _in_order(finished: list[Completion], requests: list[Request]) -> list[Completion]:
  """Completions of requests that ended at their first token, in the order the requests
  came (the calls took them by width)."""
  order = {r.id: i for i, r in enumerate(requests)}
  return sorted(finished, key=lambda c: order[c.id])
