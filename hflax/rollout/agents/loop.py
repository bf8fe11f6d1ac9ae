"""The agent loop: multi-turn trajectories on the rollout engine, token in and token out.

Each trajectory is a chain of engine requests. Its first request is the chat prompt; a
model turn ends at a stop token, its text goes to the trajectory's environment on a host
thread (tools run there while the engine decodes other trajectories), and the next turn
continues the trajectory's kept KV cache with only the ids of the messages that follow
(MessageDelta), so no turn is tokenized or prefilled twice. The ids the trainer sees are
the ids sampled, and every model token carries the sampler's log-prob and weight version:
with the trainer's weights and dtype, the rollout is on-policy across turns.

Where the history is not append-only (a template that drops earlier reasoning when it
renders a later turn, an environment that compacts its context), the next turn's context
is the conversation rendered afresh: the trajectory closes its segment there and samples
the next turn from that context in a fresh request, so each segment holds the exact ids
its turns were sampled from (hflax.rollout.agents.segments makes them training rows).
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import time
from typing import Any, Callable, Hashable, Sequence

import numpy as np

from hflax.models.tokenizer import Tokenizer
from hflax.models.transformer import positions_from_mask
from hflax.rollout.agents.chat import MessageDelta
from hflax.rollout.agents.environment import Environment, Observation, Turn
from hflax.rollout.engine import Completion, Request, RolloutEngine

COUNTS = ("tool_calls", "tool_errors", "tool_timeouts", "tool_seconds")


@dataclasses.dataclass
class Trajectory:
  """token_ids: the prompt, then each model turn and the messages after it, in order;
  model_mask: True on the model's own tokens (the loss mask); log_probs and versions: the
  sampler's log-prob and weight version per token (0 and -1 off the model's tokens);
  rewards: each turn's reward where the environment gave one; stop: "done" (the
  environment ended it), "max_turns", "max_tokens" or "context" (the engine's cache
  holds no more); segments: where the history was rewritten, the earlier segments (each a
  Trajectory of the ids its turns were sampled from), in order: this object holds the
  last one (its prompt_len is then that segment's context)."""
  index: Hashable
  token_ids: list[int]
  model_mask: list[bool]
  log_probs: list[float]
  versions: list[int]
  prompt_len: int
  turns: list[str] = dataclasses.field(default_factory=list)
  rewards: list[float] = dataclasses.field(default_factory=list)
  stop: str = ""
  metrics: dict = dataclasses.field(default_factory=dict)
  segments: list["Trajectory"] = dataclasses.field(default_factory=list)

  @property
  def reward(self) -> float:
    return float(sum(self.rewards))

  def append(self, ids: Sequence[int], model: bool, log_probs=None, versions=None):
    self.token_ids += list(ids)
    self.model_mask += [model] * len(ids)
    self.log_probs += list(log_probs) if model else [0.0] * len(ids)
    self.versions += list(versions) if model else [-1] * len(ids)


class AgentLoop:
  """Runs trajectories of `environments` on `engine` (built with max_turn_len > 0).

  max_turns: model turns per trajectory; max_tokens: a trajectory's tokens (default:
  as many as the engine's cache holds); threads: environment steps at once.
  reuse_cache=False prefills each turn's whole context afresh (the same ids, for
  comparison: what a loop without a kept cache pays).
  rewrite_history: after each turn render the whole conversation with the chat template
  (the model's turns as their text) and, where that text is not the kept ids' text plus
  the new messages' (a template that drops earlier reasoning), continue from the
  rendering as a new segment. Off, only an environment's Observation.context starts one.
  lockstep: each environment step runs during one engine step and is waited for after it
  (not taken whenever its thread is done), so which turn samples at which engine step,
  and so with which weights, does not depend on timing (the asynchronous trainer's).
  Without it a run is still reproducible bit for bit with fixed weights: the engine
  prefills each request on its own (RolloutEngine's rows_per_prefill), so the turns that
  a tool's timing admits together do not change each other's tokens or log-probs.
  template_vars: the chat template's switches (tools=[schemas] where it renders tools).

  `run` runs a batch of trajectories to the end. The same state machine, driven step by
  step: `submit` starts a trajectory, `advance` steps the engine once and the environments
  due and returns the trajectories that finished, `abort` ends one unfinished,
  `sampled_versions` reads the versions it has so far (hflax.rollout.agents.streaming).
  """

  def __init__(self, engine: RolloutEngine, tokenizer: Tokenizer, *, max_turns: int = 4,
               max_tokens: int | None = None, threads: int = 16, reuse_cache: bool = True,
               rewrite_history: bool = False, lockstep: bool = False, **template_vars):
    if not engine.max_turn_len:
      raise ValueError("AgentLoop: the engine needs max_turn_len > 0 (turns continue its cache)")
    if max_turns < 1:
      raise ValueError(f"AgentLoop: max_turns must be >= 1, got {max_turns}")
    self.engine, self.tokenizer, self.max_turns = engine, tokenizer, max_turns
    self.max_tokens = max_tokens or engine.context_width
    self.template_vars = template_vars
    self.delta = MessageDelta(tokenizer, **template_vars)
    self.threads, self.reuse_cache, self.rewrite_history = threads, reuse_cache, rewrite_history
    self.lockstep = lockstep
    self._begin()

  # -- the incremental interface (what `run` and hflax.rollout.agents.streaming drive) ----
  def _begin(self):
    """Empties the loop's state: no trajectory in it, the timing at 0."""
    self._trajectories, self._envs, self._messages, self._texts = {}, {}, {}, {}
    self._row, self._key, self._limit, self._request_id = {}, {}, {}, {}
    self._pending, self._older, self._finished = {}, [], []
    self._timing = {"decode_seconds": 0.0, "tool_wait_seconds": 0.0}

  def submit(self, tid: Hashable, environment: Environment, sample: Any, *, row: int,
             key=None, max_tokens: int | None = None) -> Trajectory:
    """Starts trajectory `tid` (its requests' ids are (tid, turn)): the environment's
    first messages as its prompt; turn t samples as row `row + t` with `key` (default:
    the engine's); max_tokens its own limit (default: the loop's)."""
    if tid in self._trajectories:
      raise ValueError(f"AgentLoop.submit: trajectory {tid!r} is already in the loop")
    messages = list(environment.reset(sample))
    self._messages[tid] = messages  # the conversation, re-rendered where it is rewritten
    text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                              **self.template_vars)
    self._texts[tid] = text  # the kept ids' text, to compare with a re-rendering
    prompt = self.tokenizer.encode(text, add_special_tokens=False)  # encode_chat's ids
    trajectory = Trajectory(tid, [], [], [], [], len(prompt))
    trajectory.append(prompt, model=False)
    trajectory.metrics = dict.fromkeys(COUNTS, 0) | {"model_tokens": 0, "tool_tokens": 0}
    self._trajectories[tid], self._envs[tid] = trajectory, environment
    self._row[tid], self._key[tid] = int(row), key
    self._limit[tid] = max_tokens or self.max_tokens
    self.engine.submit(self._request(tid, prompt, turn=0))
    return trajectory

  @property
  def busy(self) -> int:
    """Trajectories started and not finished (decoding, waiting, or in their environment)."""
    return len(self._trajectories)

  def advance(self) -> list[Trajectory]:
    """One engine step (or, with nothing to decode, a wait for an environment), then the
    environment steps that are due; returns the trajectories that finished, in order."""
    self._advance()
    finished, self._finished = self._finished, []
    return finished

  def sampled_versions(self, tid: Hashable) -> list[int]:
    """The versions of the model tokens trajectory `tid` has sampled so far, its turn
    still decoding included: what a staleness bound reads before it finishes."""
    out = model_versions(self._trajectories[tid])
    try:
      return out + self.engine.sampled_versions(self._request_id[tid])
    except KeyError:  # its turn finished (kept): its tokens are in the trajectory already
      return out

  def abort(self, tid: Hashable):
    """Ends trajectory `tid` unfinished: its request stopped, its kept slots released, an
    environment step still running left to end with its result ignored."""
    self._trajectories.pop(tid)
    request = self._request_id.pop(tid)
    try:
      self.engine.abort(request)
    except KeyError:  # not decoding nor waiting: finished and kept, or never admitted
      pass
    for kept in [k for k in self.engine.kept if isinstance(k, tuple) and k[0] == tid]:
      self.engine.release(kept)
    for future in [f for f, (t, _) in self._pending.items() if t == tid]:
      del self._pending[future]
    self._older = [f for f in self._older if f in self._pending]
    for table in (self._envs, self._messages, self._texts, self._row, self._key, self._limit):
      table.pop(tid, None)

  def summary(self, trajectories: Sequence[Trajectory]) -> dict:
    """The loop's metrics over `trajectories`, with its timing since the last summary."""
    out = self._summary(trajectories)
    self._timing = dict.fromkeys(self._timing, 0.0)
    return out

  def close(self):
    """Ends the environment threads (a later submit starts new ones)."""
    pool = getattr(self, "_pool", None)
    if pool is not None:
      pool.shutdown(wait=True)
      self._pool = None

  def run(self, environments: Sequence[Environment], samples: Sequence[Any], *,
          first_row: int = 0) -> tuple[list[Trajectory], dict]:
    """The trajectories (in order) and the loop's metrics. Trajectory i's turn t samples
    as row first_row + i * max_turns + t: reruns with the same key sample the same."""
    if len(environments) != len(samples):
      raise ValueError(f"AgentLoop.run: {len(environments)} environments for {len(samples)} "
                       "samples")
    if self.busy:
      raise RuntimeError(f"AgentLoop.run: {self.busy} trajectories already in the loop")
    self._begin()
    start = time.perf_counter()
    done = {}
    try:
      for i, (env, sample) in enumerate(zip(environments, samples)):
        self.submit(i, env, sample, row=first_row + i * self.max_turns)
      while self.busy:
        done.update((t.index, t) for t in self.advance())
    finally:
      self.close()
    self._timing["seconds"] = time.perf_counter() - start
    trajectories = [done[i] for i in range(len(samples))]
    return trajectories, self._summary(trajectories)

  def _request(self, i: Hashable, ids, turn: int, fresh: bool = False) -> Request:
    row, key = self._row[i] + turn, self._key[i]
    self._request_id[i] = (i, turn)
    if turn and (fresh or not self.reuse_cache):  # the whole context, in a fresh slot
      self.engine.release((i, turn - 1))
      return Request(self._trajectories[i].token_ids, id=(i, turn), keep=True, row=row,
                     key=key)
    return Request(ids, id=(i, turn), keep=True, continues=None if turn == 0 else (i, turn - 1),
                   row=row, key=key)

  def _environment_pool(self):
    if getattr(self, "_pool", None) is None:
      self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, "hflax-env")
    return self._pool

  def _advance(self):
    """One engine step (or, with nothing to decode, a wait for an environment), then the
    environment steps that are ready (_ready)."""
    stepped = self.engine.busy
    if stepped:
      start = time.perf_counter()
      finished = self.engine.step()
      self._timing["decode_seconds"] += time.perf_counter() - start
      for completion in finished:
        self._turn_done(completion)
    for i, turn, obs in self._ready(stepped):
      self._observed(i, turn, obs)

  def _ready(self, stepped: bool) -> list[tuple[Hashable, int, Observation]]:
    """The environment steps to apply now, in order, as (trajectory, turn, observation),
    taken out of those pending: those done (lockstep: those submitted before this engine
    step, waited for, in the order they were submitted). After no engine step (`stepped`
    False) it first waits for one (lockstep: for all of them)."""
    submitted_before = self._older  # _turn_done adds to _pending only, never to _older
    start = time.perf_counter()
    if not stepped:
      if self.lockstep:
        submitted_before = list(self._pending)
      else:
        concurrent.futures.wait(self._pending, return_when=concurrent.futures.FIRST_COMPLETED)
    if self.lockstep:
      concurrent.futures.wait(submitted_before)
      due = [f for f in submitted_before if f in self._pending]
      self._older = [f for f in self._pending if f not in set(due)]
    else:
      due = [f for f in self._pending if f.done()]
    self._timing["tool_wait_seconds"] += time.perf_counter() - start
    return [(*self._pending.pop(future), future.result()) for future in due]

  def _run_environment(self, step: Callable[[], Observation]) -> concurrent.futures.Future:
    """An environment step (`step()`), started on a host thread."""
    return self._environment_pool().submit(step)

  def _turn_done(self, c: Completion):
    i, turn = c.id
    trajectory = self._trajectories[i]
    trajectory.append(c.token_ids, model=True, log_probs=c.log_probs, versions=c.versions)
    trajectory.metrics["model_tokens"] += len(c.token_ids)
    text = self.tokenizer.decode(c.token_ids, skip_special_tokens=True)
    trajectory.turns.append(text)
    self._messages[i].append({"role": "assistant", "content": text})
    self._texts[i] += self.tokenizer.decode(c.token_ids, skip_special_tokens=False)
    future = self._run_environment(functools.partial(self._envs[i].step,
                                                     Turn(text, tuple(c.token_ids), turn)))
    self._pending[future] = (i, turn)

  def _observed(self, i: Hashable, turn: int, obs: Observation):
    trajectory = self._trajectories[i]
    if obs.reward is not None:
      trajectory.rewards.append(float(obs.reward))
    for key, value in obs.counts.items():
      trajectory.metrics[key] = trajectory.metrics.get(key, 0) + value
    text = "" if obs.done else self.delta.text(obs.messages)
    ids = self.tokenizer.encode(text, add_special_tokens=False) if text else []
    context = None if obs.done else self._rewritten(i, obs, text)
    stop = self._stop(trajectory, turn, obs, len(ids), context, self._limit[i])
    if stop:
      trajectory.stop = stop
      self.engine.release((i, turn))
      self._finished.append(trajectory)
      for table in (self._trajectories, self._envs, self._messages, self._texts, self._row,
                    self._key, self._limit, self._request_id):
        del table[i]
      return
    trajectory.metrics["tool_tokens"] += len(ids)
    if context is None:
      trajectory.append(ids, model=False)
    else:  # the segment ends with its last turn; the next samples from the new context
      trajectory.segments.append(Trajectory(i, trajectory.token_ids, trajectory.model_mask,
                                            trajectory.log_probs, trajectory.versions,
                                            trajectory.prompt_len))
      trajectory.token_ids, trajectory.model_mask = [], []
      trajectory.log_probs, trajectory.versions = [], []
      trajectory.prompt_len = len(context)
      trajectory.append(context, model=False)
    self.engine.submit(self._request(i, ids, turn + 1, fresh=context is not None))

  def _rewritten(self, i: Hashable, obs: Observation, text: str) -> list[int] | None:
    """The next turn's context where the history is rewritten (None: the kept ids and the
    new messages' `text` go on, today's append). The conversation is the environment's
    context, else the history with the turn and the new messages; it is rewritten where
    the template's text for it is not the kept ids' text plus `text` (text, not ids:
    the model's turns are kept as sampled even where encoding their text would split it
    into other tokens, so only a change the template makes starts a segment)."""
    messages = self._messages[i]
    messages[:] = list(obs.context) if obs.context is not None else messages + list(obs.messages)
    if obs.context is None and not self.rewrite_history:
      self._texts[i] += text
      return None
    rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                  **self.template_vars)
    if rendered == self._texts[i] + text:
      self._texts[i] = rendered
      return None
    self._texts[i] = rendered
    return self.tokenizer.encode(rendered, add_special_tokens=False)

  def _stop(self, trajectory: Trajectory, turn: int, obs: Observation, ids: int,
            context: list[int] | None = None, max_tokens: int | None = None) -> str:
    """Why the trajectory ends after this turn ("" if it goes on); ids: how many tokens
    the messages after the turn would add; context: a new segment's context, if any;
    max_tokens: the trajectory's limit (default: the loop's)."""
    max_tokens = max_tokens or self.max_tokens
    if obs.done:
      return "done"
    if turn + 1 >= self.max_turns:
      return "max_turns"
    if context is not None:  # a fresh request: its context is the prompt
      if len(context) >= max_tokens:
        return "max_tokens"
      return "context" if len(context) > self.engine.prompt_width else ""
    if len(trajectory.token_ids) + ids >= max_tokens:
      return "max_tokens"
    if not self.reuse_cache:  # the whole context is the next request's prompt
      return "context" if len(trajectory.token_ids) + ids > self.engine.prompt_width else ""
    # The engine's columns: the prompt's padded width, then every later token.
    used = self.engine.prompt_width + len(trajectory.token_ids) - trajectory.prompt_len
    if ids > self.engine.max_turn_len or used + ids >= self.engine.context_width:
      return "context"
    return ""

  def _summary(self, ts: Sequence[Trajectory]) -> dict:
    mean = lambda xs: float(np.mean(xs)) if xs else 0.0  # noqa: E731
    out = {f"agent/{k}/mean": mean([t.metrics.get(k, 0) for t in ts])
           for k in COUNTS + ("model_tokens", "tool_tokens")}
    out["agent/turns/mean"] = mean([len(t.turns) for t in ts])
    out["agent/segments/mean"] = mean([len(t.segments) + 1 for t in ts])
    for reason in ("done", "max_turns", "max_tokens", "context"):
      out[f"agent/stop/{reason}"] = mean([t.stop == reason for t in ts])
    out.update({f"timing_s/agent_{k}": v for k, v in self._timing.items()})
    return out


def model_versions(trajectory: Trajectory) -> list[int]:
  """The weight versions of a trajectory's model tokens, its earlier segments' first."""
  return [v for s in list(trajectory.segments) + [trajectory]
          for v, m in zip(s.versions, s.model_mask) if m]


def to_batch_fields(trajectories: Sequence[Trajectory], pad_id: int,
                    prompt_width: int | None = None, response_width: int | None = None) -> dict:
  """The sampler's fields for trajectories, one row each, so the trainer takes them as it
  takes single-turn rollouts: "prompts" the first prompt (left-padded), "responses" every
  later token (model turns and observations), "response_mask" the model's tokens only (the
  loss mask), "attention_mask" every real token, "rollout_log_probs" the sampler's."""
  P = prompt_width or max(t.prompt_len for t in trajectories)
  R = response_width or max(len(t.token_ids) - t.prompt_len for t in trajectories)
  B = len(trajectories)
  prompts, prompt_mask = np.full((B, P), pad_id, np.int32), np.zeros((B, P), bool)
  responses, real = np.full((B, R), pad_id, np.int32), np.zeros((B, R), bool)
  loss_mask, log_probs = np.zeros((B, R), bool), np.zeros((B, R), np.float32)
  versions = np.full((B, R), -1, np.int32)
  for b, t in enumerate(trajectories):
    n, rest = t.prompt_len, len(t.token_ids) - t.prompt_len
    if n > P or rest > R:
      raise ValueError(f"trajectory {t.index}: {n} prompt and {rest} later tokens do not fit "
                       f"[{P}, {R}]")
    prompts[b, P - n:], prompt_mask[b, P - n:] = t.token_ids[:n], True
    responses[b, :rest], real[b, :rest] = t.token_ids[n:], True
    loss_mask[b, :rest] = t.model_mask[n:]
    log_probs[b, :rest] = t.log_probs[n:]
    versions[b, :rest] = t.versions[n:]
  attention_mask = np.concatenate([prompt_mask, real], axis=1)
  positions = np.asarray(positions_from_mask(attention_mask), np.int32)
  return {"prompts": prompts, "prompt_mask": prompt_mask, "responses": responses,
          "response_mask": loss_mask, "input_ids": np.concatenate([prompts, responses], axis=1),
          "attention_mask": attention_mask, "position_ids": positions,
          "rollout_log_probs": log_probs, "rollout_versions": versions,
          "response_length": real.sum(axis=1).astype(np.int32)}
