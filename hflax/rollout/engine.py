"""The rollout engine: requests in, tokens out, fed and interrupted by the host.

One interface for everything that samples from the policy:

  engine = RolloutEngine(graphdef, state, SamplingParams(...), slots=8, max_prompt_len=64)
  engine.submit(Request([1, 2, 3], id="a"))       # admitted into a free slot at the next step
  for done in engine.step(): ...                   # finished Completions, as they finish
  engine.abort("a")                                # its partial tokens, slot freed
  engine.update_weights(new_state, version=3)      # later tokens carry version 3
  engine.run([Request(...), ...])                  # submit all, step until all are done

Requests are decoded continuously in `slots` cache rows (split over the mesh's "data"
axis): each step admits waiting requests into free slots (one prefill of the admitted
prompts, left-padded to a common width), then decodes `steps_per_call` tokens for every
busy slot in one compiled call, and hands finished requests back. The host sees every
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
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
from typing import Hashable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hflax.models.transformer import init_cache, positions_from_mask
from hflax.rollout import sampler
from hflax.rollout.decoding import SamplingParams, pick_with_keys, prefill

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
  context is never tokenized or prefilled again."""
  prompt_ids: Sequence[int]
  id: Hashable = None
  max_new_tokens: int | None = None
  stop_ids: tuple[int, ...] = ()
  key: jax.Array | None = None
  row: int | None = None
  keep: bool = False
  continues: Hashable = None


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
class _Held:
  slot: int
  last_token: int
  end: int  # the column the last token goes to: the context holds columns 0..end-1


@dataclasses.dataclass
class _Live:
  request: Request
  tokens: list
  log_probs: list
  versions: list


class RolloutEngine:
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
  """

  def __init__(self, graphdef, state, sampling: SamplingParams, *, slots: int = 8,
               max_prompt_len: int = 256, steps_per_call: int = 8, mesh: Mesh | None = None,
               devices: Sequence | None = None, version: int = 0, key: jax.Array | None = None,
               max_turn_len: int = 0, max_context_len: int = 0):
    if len(sampling.eos_ids) > MAX_STOP_IDS:
      raise ValueError(f"RolloutEngine: at most {MAX_STOP_IDS} eos ids, got {sampling.eos_ids}")
    for name, value in (("slots", slots), ("max_prompt_len", max_prompt_len),
                        ("steps_per_call", steps_per_call)):
      if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"RolloutEngine: {name} must be an integer >= 1, got {value!r}")
    if mesh is not None and devices is not None:
      raise ValueError("RolloutEngine: pass mesh (weights placed on it) or devices, not both")
    self.devices = None if devices is None else list(devices)
    if self.devices is not None and len(self.devices) > 1:
      mesh = sampler._rows_mesh(self.devices)
    if mesh is not None and slots % mesh.shape.get("data", 1):
      raise ValueError(f"RolloutEngine: {slots} slots do not split over the mesh's "
                       f"{mesh.shape['data']} data devices")
    self.sampling, self.slots, self.steps_per_call = sampling, int(slots), int(steps_per_call)
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
    self._live: list[_Live | None] = [None] * self.slots
    self._rows = itertools.count()
    self._ids = set()
    self._held: dict[Hashable, _Held] = {}  # kept requests: their slot and context
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
    if r.key is None and not self.sampling.greedy:
      r.key = self.key

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
        return _completion(_Live(r, [], [], []), "abort")
    for s, live in enumerate(self._live):
      if live is not None and live.request.id == request_id:
        self._free(s)
        return _completion(live, "abort")
    raise KeyError(f"abort: no request {request_id!r} in the engine")

  def sampled_versions(self, request_id: Hashable) -> list[int]:
    """The weight versions of the tokens a decoding request has sampled so far (empty for
    a waiting one): what a staleness bound reads before the request finishes."""
    for live in self._live:
      if live is not None and live.request.id == request_id:
        return list(live.versions)
    if any(r.id == request_id for r in self._waiting):
      return []
    raise KeyError(f"sampled_versions: no request {request_id!r} waiting or decoding")

  @property
  def busy(self) -> int:
    """Requests waiting or decoding (kept ones are not)."""
    return len(self._waiting) + sum(live is not None for live in self._live)

  def step(self) -> list[Completion]:
    """Admits waiting requests into free slots, decodes up to steps_per_call tokens for
    every busy slot, and returns the requests that finished (in slot order)."""
    finished = self._admit()
    if any(live is not None for live in self._live):
      self._carry, out = _decode(*self.weights, self._carry,
                                 params=self.sampling, steps=self.steps_per_call)
      tokens, logps, emitted, active = jax.device_get(
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

  # -- slots ----------------------------------------------------------------------------
  def _admit(self) -> list[Completion]:
    graphdef, state = self.weights
    if self._carry is None:
      self._carry = self._place(_empty_carry(nnx.merge(graphdef, state).cfg, self.slots,
                                             self.context_width + self._slack))
    finished = self._continue([r for r in self._waiting if r.continues is not None])
    self._waiting = [r for r in self._waiting if r.continues is None]
    held = {h.slot for h in self._held.values()}
    free = [s for s, live in enumerate(self._live) if live is None and s not in held]
    take = self._waiting[:len(free)]
    if not take:
      return finished
    del self._waiting[:len(take)]
    K = _admission_rows(len(take), self.slots)
    picks = [take[i % len(take)] for i in range(K)]  # padding rows repeat real ones
    width = min(sampler.length_bucket(max(len(r.prompt_ids) for r in take)), self.prompt_width)
    tokens, mask = sampler.left_pad([r.prompt_ids for r in picks], self.sampling.pad_id, width)
    slots = np.full(K, self.slots, np.int32)  # out of range: padding rows write nowhere
    slots[:len(take)] = free[:len(take)]
    per_row = {**self._sampling_rows(picks), "tokens": tokens, "mask": mask, "slot": slots}
    self._carry, (first, logp, going) = _prefill_into(
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
      self._live[s] = _Live(r, [int(first[i])], [float(logp[i])], [self.version])
      self._next_col[s] = columns[i]
      if not going[i]:
        finished.append(self._finish(s))
    return finished

  def _continue(self, requests: list[Request]) -> list[Completion]:
    """Prefills each continuing request's new tokens after its kept context, in the slot
    that holds it, and picks its first token."""
    if not requests:
      return []
    K = _admission_rows(len(requests), self.slots)
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
    self._carry, (first, logp, going) = _extend(*self.weights, self._carry, per_row,
                                                params=self.sampling)
    return self._started(requests, slots, (starts + lengths)[:len(requests)].tolist(),
                         first, logp, going)

  def _sampling_rows(self, picks) -> dict:
    keys = [r.key if r.key is not None else self.key for r in picks]
    return {"key": np.stack([_key_data(k) for k in keys]),
            "row": np.asarray([r.row for r in picks], np.int32),
            "max_new": np.asarray([r.max_new_tokens or self.sampling.max_new_tokens
                                   for r in picks], np.int32),
            "stops": np.stack([_stop_row(r.stop_ids, self.sampling.eos_ids) for r in picks])}

  def _finish(self, s: int) -> Completion:
    live = self._live[s]
    r = live.request
    stops = set(r.stop_ids) | set(self.sampling.eos_ids)
    reason = "stop" if live.tokens and live.tokens[-1] in stops else "length"
    self._free(s, keep=r.keep)
    return _completion(live, reason)

  def _free(self, s: int, keep: bool = False):
    """Ends slot s's request; with keep its context stays for a continuation."""
    live = self._live[s]
    if keep:  # the last token's keys and values are not written yet: its column is next
      self._held[live.request.id] = _Held(s, live.tokens[-1],
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


def _completion(live: _Live, reason: str) -> Completion:
  return Completion(live.request.id, list(live.request.prompt_ids), live.tokens,
                    live.log_probs, live.versions, reason)


def _stop_row(stop_ids, eos_ids) -> np.ndarray:
  ids = sorted(set(stop_ids) | set(eos_ids))
  return np.asarray(ids + [-1] * (MAX_STOP_IDS - len(ids)), np.int32)


def _admission_rows(count: int, slots: int) -> int:
  """Rows one admission prefills: a power of two (a few programs compile, not one per
  count), at most the slots."""
  return min(slots, 1 << max(0, count - 1).bit_length())


def _empty_carry(cfg, slots: int, width: int) -> dict:
  S, W = slots, width
  key_shape = jax.random.key_data(jax.random.key(0)).shape
  return {"cache": init_cache(cfg, S, W), "kv_valid": jnp.zeros((S, W), bool),
          "tok": jnp.zeros((S,), jnp.int32), "pos": jnp.zeros((S,), jnp.int32),
          "step": jnp.ones((S,), jnp.int32), "col": jnp.zeros((S,), jnp.int32),
          "active": jnp.zeros((S,), bool),
          "key": jnp.zeros((S,) + key_shape, jnp.uint32), "row": jnp.zeros((S,), jnp.int32),
          "max_new": jnp.ones((S,), jnp.int32),
          "stops": jnp.full((S, MAX_STOP_IDS), -1, jnp.int32)}


def _key_data(key) -> np.ndarray:
  """A key's raw uint32 words (new-style typed keys and legacy uint32 keys alike)."""
  if jnp.issubdtype(key.dtype, jax.dtypes.prng_key):
    key = jax.random.key_data(key)
  return np.asarray(key, np.uint32)


def _keys(key_data, steps, rows):
  """Each slot's key for its token `steps`: fold_in(fold_in(key, step), row)."""
  def fold(k, s, r):
    return jax.random.fold_in(jax.random.fold_in(jax.random.wrap_key_data(k), s), r)
  return jax.vmap(fold)(key_data, steps, rows)


@functools.partial(jax.jit, static_argnames=("graphdef", "params", "prompt_width"),
                   donate_argnames=("carry",))
def _prefill_into(graphdef, state, carry, rows, *, params: SamplingParams, prompt_width: int):
  """Prefills the admitted prompts (rows: their left-padded tokens and mask, the slot each
  goes to, keys, rows, limits, stop ids) and writes each one's cache into its slot,
  right-aligned in the slot's first prompt_width columns; picks each first token (step 0).
  Returns the carry and (first tokens, their log-probs, whether each goes on)."""
  model = nnx.merge(graphdef, state)
  tokens, mask = rows["tokens"], rows["mask"]
  K, p = tokens.shape
  last, cache, kv_valid = prefill(model, tokens, mask)
  keys = None if params.greedy else _keys(rows["key"], jnp.zeros((K,), jnp.int32), rows["row"])
  first, logp = pick_with_keys(model.step_logits(last), keys, params)
  going = ~jnp.any(first[:, None] == rows["stops"], axis=1) & (rows["max_new"] > 1)
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
  return carry, (first, logp, going)


@functools.partial(jax.jit, static_argnames=("graphdef", "params", "steps"),
                   donate_argnames=("carry",))
def _decode(graphdef, state, carry, *, params: SamplingParams, steps: int):
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
    keys = None if params.greedy else _keys(c["key"], step, c["row"])
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
def _extend(graphdef, state, carry, rows, *, params: SamplingParams):
  """Continuations: row i's tokens (its kept context's last token, then the new ones,
  right-padded) are prefilled into slot rows["slot"][i] at columns start.., against the
  context already there, and its first token picked (step 0). Padding columns are
  written but never marked valid; the next decode step overwrites the first of them."""
  model = nnx.merge(graphdef, state)
  tokens, length, start, at = rows["tokens"], rows["length"], rows["start"], rows["slot"]
  K, T = tokens.shape
  S, W = carry["kv_valid"].shape
  take = lambda x: x[jnp.minimum(at, S - 1)]  # noqa: E731  padding rows read a slot, write none
  real_KxT = jnp.arange(T)[None] < length[:, None]
  columns_KxT = start[:, None] + jnp.arange(T)
  kv_valid = take(carry["kv_valid"]).at[jnp.arange(K)[:, None], columns_KxT].set(
      real_KxT, mode="drop")
  positions = take(carry["pos"])[:, None] + jnp.arange(T)
  hidden, cache = model(tokens, positions, kv_valid,
                        cache=[{"k": take(c["k"]), "v": take(c["v"])} for c in carry["cache"]],
                        slot0=start)
  last = jnp.take_along_axis(hidden, (length - 1)[:, None, None], axis=1)[:, 0]
  keys = None if params.greedy else _keys(rows["key"], jnp.zeros((K,), jnp.int32), rows["row"])
  first, logp = pick_with_keys(model.step_logits(last), keys, params)
  going = ~jnp.any(first[:, None] == rows["stops"], axis=1) & (rows["max_new"] > 1)
  put = lambda old, new: old.at[at].set(new, mode="drop")  # noqa: E731
  carry = {**carry,
           "cache": [{"k": put(o["k"], n["k"]), "v": put(o["v"], n["v"])}
                     for o, n in zip(carry["cache"], cache)],
           "kv_valid": put(carry["kv_valid"], kv_valid), "tok": put(carry["tok"], first),
           "pos": put(carry["pos"], positions[jnp.arange(K), length - 1] + 1),
           "step": put(carry["step"], jnp.ones((K,), jnp.int32)),
           "col": put(carry["col"], start + length), "active": put(carry["active"], going),
           "key": put(carry["key"], rows["key"]), "row": put(carry["row"], rows["row"]),
           "max_new": put(carry["max_new"], rows["max_new"]),
           "stops": put(carry["stops"], rows["stops"])}
  return carry, (first, logp, going)
