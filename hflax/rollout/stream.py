"""Asynchronous rollouts: prompt groups (a prompt's n samples) streaming through a
RolloutEngine while the trainer trains, every token tagged with the weight version that
sampled it, and no trajectory handed to the trainer whose oldest token lags more than
`max_staleness` versions.

Partial rollouts. At a weight update the requests in flight keep their slots and decode
on with the new weights (RolloutEngine.update_weights), so one trajectory's tokens may
carry several versions; each token's log-prob is the one its own version gave, which is
the behaviour policy rollout correction needs. The cache keeps the keys and values the
older weights wrote, as verl's and AReaL's partial rollouts do when they resume a request
without re-prefilling it.

The bound. A group's age is its oldest token's version. When the weights move to version
v, a group (finished or not) whose oldest token is older than v - max_staleness can never
be trained on: it is dropped (its requests still decoding are aborted, so their slots go
to fresh prompts) and counted. Dropping, not aborting and resubmitting the prompt with its
tokens kept: the kept tokens are the stale part, so a resubmitted trajectory would stay
past the bound; verl's fully asynchronous trainer and AReaL likewise never resample a
stale trajectory. What keeps drops rare is admission (the caller's, see
hflax.launch.async_mode): as AReaL, it keeps at most (max_staleness + 1) batches of groups
submitted and untrained, so a group waits at most that many updates unless it decodes far
longer than the others.

Order. `take` hands over ready groups oldest first (then in submission order), so the
groups nearest the bound are trained before they expire; everything here follows the
engine's steps and the calls made, not timing, so a run is reproducible.

The host state (`state_dict`) holds every untrained group: finished samples whole (tokens,
log-probs, versions), unfinished ones as their prompt and sampling stream plus, for single
responses, the tokens sampled so far with their log-probs and versions (read without
stopping the requests: the run saving it goes on as if it had not). On load an unfinished
response is resubmitted as a partial rollout (Request.partial): prompt and saved tokens
prefilled by the weights then current, sampling going on at the stream position it had
reached, its saved tokens keeping their versions, so its age and the bound are what they
were. A multi-turn trajectory's unfinished turns are not saved: it starts again from its
prompt. A state without partial tokens (older checkpoints) resubmits from the prompts.

What a sample is. By default one engine request (`Responses`: a single response); a
stream built with another `samples` (hflax.rollout.agents.streaming.Trajectories: a
multi-turn agent trajectory, a chain of requests with environment steps between) runs
the same groups, bound, order and checkpoints over it. A sample's age is then its oldest
model token's version, across all its turns.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Hashable, Sequence

import jax
import numpy as np

from hflax.rollout.engine import Completion, Request, RolloutEngine


@dataclasses.dataclass
class Group:
  """One prompt's n samples. index: submission order (and the requests' id prefix); key:
  the raw words of the sampling key; sample j draws as row first_row + j (the batch
  sampler's row of that sample, so a group samples what the batch sampler would);
  context: what else a sample needs to start (a trajectory's messages; host values)."""
  index: int
  row_index: int
  prompt_ids: list[int]
  key: np.ndarray
  first_row: int
  done: list  # per sample: its Completion (or Trajectory) once finished, else None
  context: Any = None

  @property
  def finished(self) -> bool:
    return all(c is not None for c in self.done)


class Responses:
  """A group's sample as one engine request, id (group index, j): a single response."""

  def __init__(self, engine: RolloutEngine):
    self.engine = engine

  @property
  def busy(self) -> int:
    return self.engine.busy

  def submit(self, group: Group, j: int, partial: Completion | None = None):
    self.engine.submit(Request(group.prompt_ids, id=(group.index, j),
                               key=jax.random.wrap_key_data(group.key), row=group.first_row + j,
                               partial=partial))

  def in_flight(self, sample_id: Hashable) -> Completion | None:
    """What an unfinished sample has sampled so far, its request untouched (None: nothing)."""
    c = self.engine.peek(sample_id)
    return c if c.token_ids else None

  def step(self) -> list[tuple[Hashable, Completion]]:
    return [(c.id, c) for c in self.engine.step()]

  def versions(self, sample: Completion) -> list[int]:
    return list(sample.versions)

  def sampled_versions(self, sample_id: Hashable) -> list[int]:
    return self.engine.sampled_versions(sample_id)

  def abort(self, sample_id: Hashable):
    self.engine.abort(sample_id)

  def to_state(self, c: Completion) -> dict:
    return {"token_ids": list(c.token_ids), "log_probs": np.asarray(c.log_probs, np.float32),
            "versions": list(c.versions), "finish_reason": c.finish_reason}

  def from_state(self, sample_id: Hashable, group: Group, d: dict) -> Completion:
    return Completion(sample_id, list(group.prompt_ids), [int(t) for t in d["token_ids"]],
                      [float(x) for x in np.asarray(d["log_probs"])],
                      [int(v) for v in d["versions"]], d["finish_reason"])


class RolloutStream:
  """Groups submitted to `engine` (whose sampling.n is 1), stepped, aged and taken (module
  docstring). n: samples per prompt; max_staleness: the versions a trained token may lag;
  samples: what a sample is (default: Responses(engine), one request each)."""

  def __init__(self, engine: RolloutEngine, n: int, max_staleness: int, samples=None):
    if not isinstance(max_staleness, int) or max_staleness < 0:
      raise ValueError(f"RolloutStream: max_staleness must be an integer >= 0, got "
                       f"{max_staleness!r}")
    self.engine, self.n, self.max_staleness = engine, int(n), max_staleness
    self.samples = Responses(engine) if samples is None else samples
    self.groups: dict[int, Group] = {}  # submitted and neither taken nor dropped
    self._next = 0
    self.dropped = 0  # groups dropped past the bound over the run
    self.decode_calls = 0  # engine.step() calls over the run

  # -- feeding and stepping ---------------------------------------------------------------
  def submit(self, row_index: int, prompt_ids: Sequence[int], key, first_row: int,
             context: Any = None) -> Group:
    """Queues a prompt's n samples drawing with `key` (a typed key or its raw words) as
    rows first_row .. first_row + n - 1; context: the group's (Group.context)."""
    key = np.asarray(jax.random.key_data(key) if _typed(key) else key, np.uint32)
    group = Group(self._next, int(row_index), [int(t) for t in prompt_ids], key,
                  int(first_row), [None] * self.n, context)
    self._next += 1
    self.groups[group.index] = group
    for j in range(self.n):
      self.samples.submit(group, j)
    return group

  def step(self, calls: int) -> int:
    """Up to `calls` engine steps (fewer once nothing is in flight); returns those made."""
    made = 0
    while made < calls and self.samples.busy:
      for (index, j), sample in self.samples.step():
        self.groups[index].done[j] = sample
      made += 1
    self.decode_calls += made
    return made

  def fill(self, count: int) -> int:
    """Steps until `count` groups are ready; returns the engine steps it took."""
    made = 0
    while len(self.ready()) < count:
      if not self.samples.busy:
        raise RuntimeError(f"RolloutStream.fill: {len(self.ready())} groups ready and nothing "
                           f"in flight, {count} wanted: submit more prompts first")
      made += self.step(1)
    return made

  # -- age --------------------------------------------------------------------------------
  @property
  def oldest_allowed(self) -> int:
    """The oldest version a trained token may have now."""
    return self.engine.version - self.max_staleness

  def oldest(self, group: Group) -> int | None:
    """The version of the group's oldest token so far (None: nothing sampled yet)."""
    versions = []
    for j, c in enumerate(group.done):
      versions += (self.samples.versions(c) if c is not None else
                   self.samples.sampled_versions((group.index, j)))
    return min(versions) if versions else None

  def set_weights(self, state, version: int, graphdef=None) -> int:
    """New weights for the requests in flight and those to come (a partial rollout for the
    former), then drops the groups now past the bound; returns how many it dropped."""
    self.engine.update_weights(state, version, graphdef=graphdef)
    return self.drop_stale()

  def drop_stale(self) -> int:
    stale = [g for g in self.groups.values()
             if (o := self.oldest(g)) is not None and o < self.oldest_allowed]
    for g in stale:
      for j, c in enumerate(g.done):
        if c is None:
          self.samples.abort((g.index, j))
      del self.groups[g.index]
    self.dropped += len(stale)
    return len(stale)

  # -- taking -----------------------------------------------------------------------------
  def ready(self) -> list[Group]:
    """Finished groups within the bound, oldest first, then in submission order."""
    ready = [(self.oldest(g), g.index, g) for g in self.groups.values() if g.finished]
    return [g for o, _, g in sorted(ready, key=lambda t: t[:2]) if o >= self.oldest_allowed]

  def take(self, count: int) -> list[Group]:
    """The first `count` ready groups (module docstring), no longer the stream's."""
    groups = self.ready()[:count]
    if len(groups) < count:
      raise RuntimeError(f"RolloutStream.take: {len(groups)} groups ready, {count} wanted")
    for g in groups:
      del self.groups[g.index]
    return groups

  # -- checkpoints ------------------------------------------------------------------------
  def state_dict(self) -> dict:
    """Every untrained group as host values (finished samples whole), and the counters."""
    def sample(c):
      return None if c is None else self.samples.to_state(c)

    def partial(g, j):  # an unfinished sample's tokens so far, where samples can resume them
      in_flight = getattr(self.samples, "in_flight", None)
      return None if g.done[j] is not None or in_flight is None else sample(
          in_flight((g.index, j)))
    return {"next": self._next, "dropped": self.dropped, "decode_calls": self.decode_calls,
            "groups": [{"index": g.index, "row_index": g.row_index, "prompt_ids": g.prompt_ids,
                        "key": g.key, "first_row": g.first_row, "context": g.context,
                        "done": [sample(c) for c in g.done],
                        "partial": [partial(g, j) for j in range(len(g.done))]}
                       for g in self.groups.values()]}

  def load_state_dict(self, state: dict):
    """Restores `state_dict`'s groups into an engine with nothing in flight: finished
    samples kept as they were, unfinished ones resubmitted with their saved tokens (a
    partial rollout), or from their prompts where none were saved."""
    if self.samples.busy or self.groups:
      raise RuntimeError("RolloutStream.load_state_dict: the stream must be empty")
    self._next, self.dropped = int(state["next"]), int(state["dropped"])
    self.decode_calls = int(state["decode_calls"])
    for s in state["groups"]:
      group = Group(int(s["index"]), int(s["row_index"]), [int(t) for t in s["prompt_ids"]],
                    np.asarray(s["key"], np.uint32), int(s["first_row"]), [None] * len(s["done"]),
                    s.get("context"))
      group.done = [None if d is None else self.samples.from_state((group.index, j), group, d)
                    for j, d in enumerate(s["done"])]
      self.groups[group.index] = group
      partial = s.get("partial") or [None] * len(group.done)
      for j, c in enumerate(group.done):
        if c is None and partial[j] is not None:
          self.samples.submit(group, j, self.samples.from_state((group.index, j), group,
                                                                partial[j]))
        elif c is None:
          self.samples.submit(group, j)


def response_fields(groups: Sequence[Group], width: int, pad_id: int,
                    current_version: int) -> dict:
  """The sampler's response fields for the groups' samples, group-major (sample j of group
  i in row i * n + j): responses, response_mask (every sampled token, the end one too),
  rollout_log_probs, response_length, rollout_versions [rows, width] (-1 off the
  response), rollout_version [rows] (each row's oldest token's version: its staleness),
  and versions_per_row [rows] (how many versions sampled it) and token_staleness (the mean
  lag of the response tokens behind current_version)."""
  samples = [c for g in groups for c in g.done]
  B = len(samples)
  tokens, mask = np.full((B, width), pad_id, np.int32), np.zeros((B, width), bool)
  logps, versions = np.zeros((B, width), np.float32), np.full((B, width), -1, np.int32)
  for b, c in enumerate(samples):
    k = len(c.token_ids)
    if k > width:
      raise ValueError(f"sample {c.id}: {k} tokens, wider than the response width {width}")
    tokens[b, :k], mask[b, :k] = c.token_ids, True
    logps[b, :k], versions[b, :k] = c.log_probs, c.versions
  lag = (current_version - versions)[mask]
  return {"responses": tokens, "response_mask": mask, "rollout_log_probs": logps,
          "response_length": mask.sum(axis=1).astype(np.int32), "rollout_versions": versions,
          "rollout_version": np.where(mask, versions, np.iinfo(np.int32).max).min(axis=1)
          .astype(np.int32),
          "versions_per_row": np.asarray([len(set(c.versions)) for c in samples], np.int32),
          "token_staleness": float(lag.mean()) if lag.size else 0.0}


def _typed(key) -> bool:
  return hasattr(key, "dtype") and jax.dtypes.issubdtype(key.dtype, jax.dtypes.prng_key)
