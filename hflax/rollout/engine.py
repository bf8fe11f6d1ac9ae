"""The rollout engine: requests in, tokens out, fed and interrupted by the host.

One interface for everything that samples from the policy:

  engine = RolloutEngine(graphdef, state, SamplingParams(...), slots=8, max_prompt_len=64)
  engine.submit(Request([1, 2, 3], id="a"))       # admitted into a free slot at the next step
  for done in engine.step(): ...                   # finished Completions, as they finish
  engine.peek("a")                                 # its tokens so far; it decodes on
  engine.abort("a")                                # its partial tokens, slot freed
  engine.submit(Request([1, 2, 3], partial=done))  # resumes them (a checkpoint's)
  engine.update_weights(new_state, version=3)      # later tokens carry version 3
  engine.run([Request(...), ...])                  # submit all, step until all are done

Requests are decoded continuously in `slots` cache rows (split over the mesh's "data"
axis): each step admits waiting requests into free slots (each prompt prefilled at its
own padded width, in calls of a fixed row count, so its numerics do not depend on which
requests arrived with it), then decodes `steps_per_call` tokens for every busy slot in
one compiled call, and hands finished requests back. The host sees every
slot between calls, so it can admit, abort and swap weights there; a call ends early
when no slot is busy.

Sampling matches the batch sampler (hflax.rollout.sampler.generate): a request carries a
key and a row, and draws its token s with fold_in(fold_in(key, s), row); its log-probs are
those of the sampled token under softmax(logits / temperature), the trainer's. So a
request sampled here gets the tokens the batch sampler gives the same (key, row), and a
trajectory's log-probs are the policy's whatever other requests shared its steps.

The batch sampler stays the fast path for a whole RL batch known up front (`generate`
below: one compiled call, waves or slots on the device); this engine is the path for
work the host feeds while it runs: agent turns, asynchronous rollouts, partial ones.

Laid out by job: this module holds the engine's interface (weights, the batch path,
requests in, completions out); requests.py what a request and a completion are;
slots.py the host's admission into the slot table and release from it;
engine_programs.py the compiled programs (prefill into slots, continuation, decode steps).
"""
from __future__ import annotations

import dataclasses
import itertools
from typing import Hashable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from hflax.rollout import sampler
from hflax.rollout.decoding import SamplingParams
from hflax.rollout.engine_programs import carry_bytes, decode_steps
from hflax.rollout.host import host_values
# Request, Completion and MAX_STOP_IDS are this module's public names as well.
from hflax.rollout.requests import (MAX_STOP_IDS, Completion, Live, Request, completion,
                                    first_live)
from hflax.rollout.slots import SlotTable


class RolloutEngine(SlotTable):
  """Continuous batching that the host drives (module docstring).

  graphdef, state: an hflax causal LM. sampling: the temperature, top-k and top-p every
  request samples with (compiled in), the eos ids, pad id and the longest response
  (max_new_tokens: the cache holds max_prompt_len + max_new_tokens slots a row); n must be
  1 (submit n requests for n samples). mesh: where the slots live, split over its "data"
  axis, with `state` already placed on it (the hybrid engine's generation layout); or
  devices: a mesh of these with the weights replicated on each; default the state's
  devices. version: the weights' version. key: the default sampling key of requests.
  max_turn_len: the most new tokens a continuing request brings (0: no continuations).
  max_context_len: the most tokens a trajectory's context holds, prompt padding
  included (default and least: max_prompt_len + max_new_tokens); a slot's cache has that
  many columns, and max_turn_len more where continuations are on, so that a
  continuation's prefill writes whole columns inside it.
  rows_per_prefill: the rows of every admission's compiled call (0: up to 8). Each
  request is prefilled at its own padded width in calls of this many rows, so its
  log-probs are bit for bit the same whichever requests it was admitted with
  (hflax.rollout.slots, SlotTable._calls).
  prefix_sharing: requests admitted at one step with identical prompts (a group's n
  samples) are prefilled once, the others copying that prefill's cache into their slots
  and picking their first tokens from its last hidden state with their own keys: the
  same tokens and log-probs bit for bit, fewer prefill calls. Fresh requests only
  (continuations bring tokens of their own). `stats` counts prefill calls, the rows and
  tokens prefilled and those shared (copied instead).
  """

  def __init__(self, graphdef, state, sampling: SamplingParams, *, slots: int = 8,
               max_prompt_len: int = 256, steps_per_call: int = 8, mesh: Mesh | None = None,
               devices: Sequence | None = None, version: int = 0, key: jax.Array | None = None,
               max_turn_len: int = 0, max_context_len: int = 0, rows_per_prefill: int = 0,
               prefix_sharing: bool = True):
    if len(sampling.eos_ids) > MAX_STOP_IDS:
      raise ValueError(f"RolloutEngine: at most {MAX_STOP_IDS} eos ids, got {sampling.eos_ids}")
    for name, value in (("slots", slots), ("max_prompt_len", max_prompt_len),
                        ("steps_per_call", steps_per_call)):
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"RolloutEngine: {name} must be an integer >= 1, got {value!r}")
    if not isinstance(rows_per_prefill, (int, np.integer)) or rows_per_prefill < 0:
      raise ValueError(f"RolloutEngine: rows_per_prefill must be an integer >= 0, got "
                       f"{rows_per_prefill!r}")
    if not isinstance(prefix_sharing, bool):
      raise ValueError(f"RolloutEngine: prefix_sharing must be True or False, got "
                       f"{prefix_sharing!r}")
    if mesh is not None and devices is not None:
      raise ValueError("RolloutEngine: pass mesh (weights placed on it) or devices, not both")
    self.devices = None if devices is None else list(devices)
    if self.devices is not None and len(self.devices) > 1:
      mesh = sampler._rows_mesh(self.devices)
    if mesh is not None and slots % mesh.shape.get("data", 1):
      raise ValueError(f"RolloutEngine: {slots} slots do not split over the mesh's "
                       f"{mesh.shape['data']} data devices")
    self.sampling, self.slots, self.steps_per_call = sampling, int(slots), int(steps_per_call)
    # Eight: on the CPU, calls of one row cost the kept cache its saving (bench/agents.py:
    # 54 s against 41 s for eight, 39-40 s before rows were fixed); padding rows cost less.
    self.rows_per_prefill = int(rows_per_prefill) or min(self.slots, 8)
    self.prefix_sharing = prefix_sharing
    # Fresh requests' prompts: compiled prefill calls, rows and tokens prefilled, and the
    # rows and tokens a request of the same admission's prefill gave instead (shared).
    self.stats = dict.fromkeys(("prefill_calls", "prefill_rows", "prefill_tokens",
                                "shared_rows", "shared_tokens"), 0)
    self.prompt_width = int(max_prompt_len)
    if not isinstance(max_turn_len, (int, np.integer)) or max_turn_len < 0:
      raise ValueError(f"RolloutEngine: max_turn_len must be an integer >= 0, got "
                       f"{max_turn_len!r}")
    self.max_turn_len = int(max_turn_len)
    self.context_width = max(int(max_context_len), self.prompt_width + sampling.max_new_tokens)
    self._slack = sampler.length_bucket(self.max_turn_len + 1) if self.max_turn_len else 0
    self.mesh = mesh
    self.key = jax.random.key(0) if key is None else key
    # The model's graphdef, and the (graphdef, state) decoded with: the platform's decoding
    # copy of the weights where it has one.
    self.model_graphdef, self._graphdef, self._state = graphdef, graphdef, None
    self.version = version
    if state is not None:
      self.update_weights(state, version)
    self._waiting: list[Request] = []
    self._live: list[Live | None] = [None] * self.slots
    self._rows = itertools.count()
    self._ids = set()
    self._held: dict[Hashable, Held] = {}  # kept requests: their slot and context
    self._next_col = [0] * self.slots  # per decoding slot: its first token's cache column
    self._carry = None  # the slots' cache and counters, made at the first admission

  # -- weights ---------------------------------------------------------------------------
  def update_weights(self, state, version: int | None = None, *, graphdef=None):
    """New weights (same shapes), used from the next step; every token sampled afterwards
    carries `version` (default: the current one plus 1). Requests in flight keep their
    cache: their earlier tokens' keys and values are the old weights' (a partial rollout;
    abort and resubmit prompt + tokens to recompute them with the new ones)."""
    self.model_graphdef = graphdef = graphdef or self.model_graphdef
    if self.devices is not None:
      state = (sampler.replicate(state, self.devices) if self.mesh is not None else
               sampler.placed(state, jax.sharding.SingleDeviceSharding(self.devices[0])))
    self._graphdef, self._state = sampler.for_decoding(graphdef, state)
    self.version = self.version + 1 if version is None else int(version)

  def release_weights(self):
    """Drops the engine's hold on its weights (and the slots' cache): a colocated actor
    frees the generation copy this way before it trains. Refused while requests are in."""
    if self.busy:
      raise RuntimeError(f"RolloutEngine: {self.busy} requests still in; abort them first")
    self._state, self._carry = None, None

  @property
  def cache_width(self) -> int:
    """Columns of a slot's cache: the longest context, plus a continuation's room."""
    return self.context_width + self._slack

  def cache_bytes(self, cfg) -> int:
    """Bytes the slots' cache and counters take for a model of config `cfg`, all slots
    over all the engine's devices; allocated at the first admission, kept until
    release_weights."""
    return carry_bytes(cfg, self.slots, self.cache_width)

  @property
  def weights(self):
    """(graphdef, state) the engine samples with: the platform's decoding copy where it
    makes one, on the engine's devices."""
    if self._state is None:
      raise RuntimeError("RolloutEngine has no weights: call update_weights(state, version)")
    return self._graphdef, self._state

  # -- the batch path -------------------------------------------------------------------
  def generate(self, prompts, params: SamplingParams | None = None, *, rng=None,
               wave_rows: int = 0, slots: int = 0, collect=None) -> dict:
    """A whole batch in one compiled call per wave (hflax.rollout.sampler): prompts a list
    of token lists or a left-padded (tokens, mask) pair; params default to the engine's
    (n samples a prompt allowed here). wave_rows, slots, collect: generate_over_rows',
    on a mesh. Returns the sampler's fields plus "rollout_version" [rows], the weights'
    version every token of the batch carries."""
    graphdef, state = self.weights
    params = params or self.sampling
    if self.mesh is None or (self.devices is not None and not (wave_rows or collect)):
      out = sampler.generate(graphdef, state, prompts, params, rng=rng, devices=self.devices,
                             slots=slots)
    else:
      if not isinstance(prompts, tuple):
        prompts = sampler.left_pad(prompts, params.pad_id)
      if rng is None and params.greedy:
        rng = jax.random.key(0)
      out = sampler.generate_over_rows(graphdef, state, prompts[0], prompts[1], rng, params,
                                       self.mesh, wave_rows=wave_rows, collect=collect,
                                       slots=slots)
    rows = out["responses"].shape[0]
    out["rollout_version"] = jax.device_put(jnp.full((rows,), self.version, jnp.int32),
                                            out["responses"].sharding)
    return out

  # -- requests --------------------------------------------------------------------------
  def submit(self, request: Request) -> Hashable:
    """Queues a request (admitted at the next step); returns its id (default: a counter)."""
    if self.sampling.n != 1:
      raise ValueError(f"RolloutEngine.submit: the engine's sampling.n must be 1 (submit one "
                       f"request per sample), got {self.sampling.n}")
    request = dataclasses.replace(request, prompt_ids=[int(t) for t in request.prompt_ids],
                                  stop_ids=tuple(int(t) for t in request.stop_ids))
    if (p := request.partial) is not None:
      request.partial = dataclasses.replace(
          p, token_ids=[int(t) for t in p.token_ids], log_probs=[float(x) for x in p.log_probs],
          versions=[int(v) for v in p.versions])
    if request.row is None:
      request.row = next(self._rows)
    if request.id is None:
      request.id = request.row
    self._check(request)
    self._ids.add(request.id)
    self._waiting.append(request)
    return request.id

  def _check(self, r: Request):
    where = f"request {r.id!r}"
    if r.id in self._ids:
      raise ValueError(f"{where}: that id is already in the engine")
    if r.continues is not None:
      self._check_continuation(r, where)
      if r.partial is not None:
        raise ValueError(f"{where}: a continuation cannot also resume partial tokens")
    elif not r.prompt_ids:
      raise ValueError(f"{where}: empty prompt")
    elif len(r.prompt_ids) > self.prompt_width:
      raise ValueError(f"{where}: {len(r.prompt_ids)} prompt tokens, the engine holds at most "
                       f"max_prompt_len={self.prompt_width}")
    cap = self.sampling.max_new_tokens
    if r.max_new_tokens is not None and not 1 <= r.max_new_tokens <= cap:
      raise ValueError(f"{where}: max_new_tokens must be in [1, {cap}] (the engine's), got "
                       f"{r.max_new_tokens}")
    if len(set(r.stop_ids) | set(self.sampling.eos_ids)) > MAX_STOP_IDS:
      raise ValueError(f"{where}: at most {MAX_STOP_IDS} stop and eos ids together")
    if r.partial is not None:
      self._check_partial(r, where)
    if r.key is None and not self.sampling.greedy:
      r.key = self.key

  def _check_partial(self, r: Request, where: str):
    p, cap = r.partial, r.max_new_tokens or self.sampling.max_new_tokens
    if not len(p.token_ids) == len(p.log_probs) == len(p.versions):
      raise ValueError(f"{where}: partial has {len(p.token_ids)} tokens, {len(p.log_probs)} "
                       f"log-probs and {len(p.versions)} versions")
    if len(p.token_ids) >= cap:
      raise ValueError(f"{where}: partial has {len(p.token_ids)} tokens, nothing left of "
                       f"max_new_tokens={cap}")
    if set(p.token_ids) & (set(r.stop_ids) | set(self.sampling.eos_ids)):
      raise ValueError(f"{where}: partial tokens hold a stop or eos id: it had finished")

  def _check_continuation(self, r: Request, where: str):
    if not self.max_turn_len:
      raise ValueError(f"{where}: continues {r.continues!r}, but the engine was built with "
                       "max_turn_len=0 (no continuations)")
    held = self._held.get(r.continues)
    if held is None or any(w.continues == r.continues for w in self._waiting):
      raise ValueError(f"{where}: continues {r.continues!r}, which is not a finished request "
                       "kept with keep=True (or another request continues it already)")
    if len(r.prompt_ids) > self.max_turn_len:
      raise ValueError(f"{where}: {len(r.prompt_ids)} new tokens, a continuation brings at "
                       f"most max_turn_len={self.max_turn_len}")
    if held.end + 1 + len(r.prompt_ids) >= self.context_width:
      raise ValueError(f"{where}: the context of {r.continues!r} is full ({held.end} of "
                       f"{self.context_width} columns): no room for {len(r.prompt_ids)} more "
                       "tokens and a reply")

  def release(self, request_id: Hashable):
    """Frees the slot a kept request holds (its trajectory ends)."""
    held = self._held.pop(request_id, None)
    if held is None:
      raise KeyError(f"release: no kept request {request_id!r}")
    self._ids.discard(request_id)

  @property
  def kept(self) -> tuple:
    """The ids of finished requests whose slots keep their context."""
    return tuple(self._held)

  def abort(self, request_id: Hashable) -> Completion:
    """Stops a request: a waiting one returns with no tokens, a decoding one with those
    it has sampled; its slot is free for the next admission."""
    for i, r in enumerate(self._waiting):
      if r.id == request_id:
        del self._waiting[i]
        self._ids.discard(request_id)
        return completion(first_live(r), "abort")
    for s, live in enumerate(self._live):
      if live is not None and live.request.id == request_id:
        self._free(s)
        return completion(live, "abort")
    raise KeyError(f"abort: no request {request_id!r} in the engine")

  def sampled_versions(self, request_id: Hashable) -> list[int]:
    """The weight versions of the tokens a decoding request has sampled so far (a waiting
    one: its partial tokens'): what a staleness bound reads before the request finishes."""
    return self.peek(request_id).versions

  def peek(self, request_id: Hashable) -> Completion:
    """What a waiting or decoding request has sampled so far (tokens, log-probs, versions;
    finish_reason "partial"), a copy; the request goes on untouched. A checkpoint saves
    it, and Request(partial=...) resumes from it."""
    found = [live for live in self._live if live is not None and live.request.id == request_id]
    found += [first_live(r) for r in self._waiting if r.id == request_id]
    if found:
      live = found[0]
      return Completion(live.request.id, list(live.request.prompt_ids), list(live.tokens),
                        list(live.log_probs), list(live.versions), "partial")
    raise KeyError(f"peek: no request {request_id!r} waiting or decoding")

  @property
  def busy(self) -> int:
    """Requests waiting or decoding (kept ones are not)."""
    return len(self._waiting) + sum(live is not None for live in self._live)

  def step(self) -> list[Completion]:
    """Admits waiting requests into free slots, decodes up to steps_per_call tokens for
    every busy slot, and returns the requests that finished (in slot order)."""
    finished = self._admit()
    if any(live is not None for live in self._live):
      self._carry, out = decode_steps(*self.weights, self._carry,
                                      params=self.sampling, steps=self.steps_per_call)
      tokens, logps, emitted, active = host_values(
          (out["tokens"], out["log_probs"], out["emitted"], self._carry["active"]))
      for s, live in enumerate(self._live):
        if live is None:
          continue
        count = int(emitted[s].sum())
        live.tokens += tokens[s, :count].tolist()
        live.log_probs += logps[s, :count].tolist()
        live.versions += [self.version] * count
        if not active[s]:
          finished.append(self._finish(s))
    return finished

  def run(self, requests: Iterable[Request]) -> list[Completion]:
    """Submits `requests`, steps until they are done, and returns their completions in
    the order given (other requests in the engine go on with them)."""
    ids = [self.submit(r) for r in requests]
    wanted, done = set(ids), {}
    while wanted - done.keys():
      for c in self.step():
        done[c.id] = c
    return [done[i] for i in ids]
