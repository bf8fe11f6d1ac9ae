"""The host side of trainer.mode = "async" (hflax.launch.async_mode): the actor's streaming
RolloutEngine and the RolloutStream over it, with what the driver's AsyncRollouts asks of
them as calls taking and returning host values.

It lives beside the actor's generation: in the controller's process on the local backend
(AsyncRollouts calls it directly); on the Ray backend in the processes of the pool that
generates (hflax.controller.ray_backend.stream.RemoteStream calls it there): the rollout
pool's on a split placement, where the engine decodes while the train pool updates, else
the actor's own, where `sync` hands the actor's weights over in-process as locally.
Either way the calls and their order are the same, so the runs sample the same tokens. A
pool of several processes runs a StreamHost in each, making the same calls; agent
trajectories' tools then run in process 0 alone (hflax.rollout.agents.shared_tools).
"""
from __future__ import annotations

import time

import jax
import numpy as np

from hflax import platforms
from hflax.rollout.agents.loop import model_versions
from hflax.rollout.agents.rollout import chat_prompts, engine_widths, trajectory_fields
from hflax.rollout.agents.shared_tools import agent_loop
from hflax.rollout.agents.streaming import Trajectories, tools_overhead
from hflax.rollout.sampler import length_bucket
from hflax.rollout.stream import RolloutStream, response_fields


def stream_slots(batch_rows: int, max_staleness: int, asked: int = 0, fits: int = 0) -> int:
  """Decode slots of an async stream's engine. The stream keeps max_staleness + 1 batches
  of `batch_rows` samples submitted, so more slots than that would idle. asked
  (rollout.max_num_seqs; 0: the default): that many. By default, where a decode step
  costs about the same whatever its rows (accelerators), all the submitted samples decode
  at once; where its time grows with its rows (the CPU), slots past one batch would add
  cache memory and no tokens per second, so one batch's. fits (the placement's KV budget,
  0: none): at most that many."""
  most = (max_staleness + 1) * batch_rows
  if asked:
    slots = min(asked, most)
  else:
    slots = batch_rows if platforms.step_time_follows_rows() else most
  return min(slots, fits) if fits else slots


class StreamHost:
  """A RolloutStream of n samples a prompt on a streaming engine of `actor`'s (its
  streaming_engine; multi-turn trajectories where actor.multi_turn is set). batch_rows:
  the samples of one step's batch; max_num_seqs: the decode slots asked for (0: the
  default; stream_slots), the actor's own cap (its placement's) applying too; steps:
  decode steps one engine call runs."""

  def __init__(self, actor, *, n: int, max_staleness: int, batch_rows: int, steps: int,
               max_prompt_len: int, max_num_seqs: int = 0):
    self.actor, self.n, self.agent = actor, n, actor.multi_turn
    slots = stream_slots(batch_rows, max_staleness, max_num_seqs, actor.max_num_seqs)
    if self.agent is None:
      engine, samples = actor.streaming_engine(slots=slots, max_prompt_len=max_prompt_len,
                                               steps_per_call=steps), None
    else:
      engine, samples = self._agent_engine(slots, max_prompt_len, steps)
    self.cache_metrics = _check_cache(engine, actor.cfg)
    self.stream = RolloutStream(engine, n, max_staleness, samples)
    self._decode_calls = 0  # start_decode's, run by finish_decode

  def _agent_engine(self, slots: int, max_prompt_len: int, steps: int):
    """The engine and samples of multi-turn trajectories, as multi_turn_rollout builds
    them, with a prompt width for any prompt the loader passes plus the tools' message."""
    mt, actor = self.agent, self.actor
    self.tokenizer, response = actor.agent_tokenizer(), actor.sampling.max_new_tokens
    self.prompt_width = length_bucket(max_prompt_len + tools_overhead(mt, self.tokenizer))
    engine = actor.streaming_engine(slots=slots, steps_per_call=steps,
                                    **engine_widths(mt, self.prompt_width, response))
    # Over several processes (a Ray rollout pool's), process 0 runs the tools for all.
    loop = agent_loop(engine, self.tokenizer, max_turns=mt.max_turns,
                      rewrite_history=mt.rewrite_history, lockstep=True)
    return engine, Trajectories(loop, mt)

  @property
  def untrained(self) -> int:
    return len(self.stream.groups)

  # -- admission ----------------------------------------------------------------------------
  def admit(self, prompts, key) -> int:
    """A batch of prompts (the loader's fields) as groups drawing with `key`, sample j of
    prompt i as row i * n + j; returns the groups untrained now."""
    rows = np.asarray(prompts["row_index"])
    if self.agent is not None:
      self._admit_trajectories(prompts, rows, key)
      return self.untrained
    tokens, mask = np.asarray(prompts["prompts"]), np.asarray(prompts["prompt_mask"], bool)
    for i in range(len(rows)):
      self.stream.submit(int(rows[i]), tokens[i][mask[i]].tolist(), key, first_row=i * self.n)
    return self.untrained

  def _admit_trajectories(self, prompts, rows, key):
    """A batch's prompts as groups of agent trajectories: each prompt rendered with its
    tools, and every trajectory's token limit the batch's prompt width plus the response
    length, as multi_turn_rollout sets them for the batch."""
    raw, sources = list(prompts["raw_prompt"]), list(prompts["data_source"])
    _, ids = chat_prompts(self.agent, self.tokenizer, raw, sources)
    longest = max(len(x) for x in ids)
    if longest > self.prompt_width:
      raise ValueError(f"data.max_prompt_length: a prompt with its tools is {longest} tokens, "
                       f"more than the stream's engine holds ({self.prompt_width}); raise it")
    limit = length_bucket(longest) + self.actor.sampling.max_new_tokens
    for i in range(len(rows)):
      context = {"raw_prompt": list(raw[i]), "data_source": str(sources[i]), "max_tokens": limit}
      self.stream.submit(int(rows[i]), ids[i], key, first_row=i * self.n, context=context)

  # -- a step's batch -----------------------------------------------------------------------
  def take(self, count: int) -> dict:
    """Steps the engine until `count` groups are ready and takes them (oldest first). Host
    values: rows (each group's dataset row), calls (engine calls it waited for), the
    sampler's fields of the samples (single responses: response_fields'; trajectories:
    trajectory_fields' with their infos, whose extra_info the driver adds), per_row
    (versions that sampled each row), token_staleness, dropped (over the run), untrained."""
    calls = self.stream.fill(count)
    taken = self.stream.take(count)
    version = self.stream.engine.version
    out = {"rows": [g.row_index for g in taken], "calls": calls,
           "dropped": self.stream.dropped, "untrained": self.untrained}
    if self.agent is None:
      fields = response_fields(taken, self.actor.sampling.max_new_tokens,
                               self.actor.sampling.pad_id, version)
      out["per_row"], out["token_staleness"] = (fields.pop("versions_per_row"),
                                                fields.pop("token_staleness"))
      return {**out, "fields": fields}
    trajectories = [t for g in taken for t in g.done]
    fields, infos = trajectory_fields(
        trajectories, [None] * len(trajectories), pad_id=self.tokenizer.pad_id,
        prompt_width=length_bucket(max(len(g.prompt_ids) for g in taken)),
        response_width=self.actor.sampling.max_new_tokens)
    versions = [model_versions(t) for t in trajectories]
    lag = [version - v for vs in versions for v in vs]
    return {**out, "fields": fields, "infos": infos,
            "per_row": np.asarray([len(set(vs)) for vs in versions], np.int32),
            "token_staleness": float(np.mean(lag)) if lag else 0.0,
            "summary": self.stream.samples.loop.summary(trajectories)}

  def decode(self, calls: int) -> dict:
    """Up to `calls` engine calls; the seconds they took (timing_s/async_decode)."""
    start = time.perf_counter()
    self.stream.step(calls)
    return {"timing_s/async_decode": time.perf_counter() - start}

  # The overlap with the update, as the controller's process runs it: JAX dispatch is
  # asynchronous, so decode calls made after the update's programs are queued run beside
  # them on a split placement. RemoteStream instead submits them at the take.
  def start_decode(self, calls: int):
    self._decode_calls = calls

  def finish_decode(self) -> dict:
    """The decode's metrics; timing_s/async_decode_wait: the seconds the controller spent
    on it after the update was dispatched (here all of it)."""
    calls, self._decode_calls = self._decode_calls, 0
    out = self.decode(calls)
    return {**out, "timing_s/async_decode_wait": out["timing_s/async_decode"]}

  # -- weights ------------------------------------------------------------------------------
  def sync(self) -> dict:
    """The actor's current weights in the generation layout become the engine's next
    version (requests in flight decode on with them); groups past the bound are dropped.
    Returns the sync's metrics and the groups untrained."""
    graphdef, state, version, metrics = self.actor.generation_weights()
    self.stream.set_weights(state, version, graphdef=graphdef)
    return {"metrics": {**metrics, **self.cache_metrics}, "untrained": self.untrained}

  # -- checkpoints --------------------------------------------------------------------------
  def state_dict(self) -> dict:
    return self.stream.state_dict()

  def load_state_dict(self, state: dict) -> int:
    self.stream.load_state_dict(state)
    return self.untrained


def _check_cache(engine, cfg) -> dict:
  """Refuses, before anything is allocated, an engine whose slots' cache alone exceeds
  the free memory of this process's devices (the cache has no paging: each slot reserves
  its whole width for the run); returns the engine's size, all processes', as metrics."""
  devices = [d for d in engine.mesh.devices.flat if d.process_index == jax.process_index()]
  total = engine.cache_bytes(cfg)
  need = total * len(devices) // engine.mesh.devices.size  # this process's share
  free = platforms.free_memory(devices)
  if need > free:
    raise ValueError(
        f"trainer.mode=async: the rollout engine's {engine.slots} slots x "
        f"{engine.cache_width} columns need {need / 2**30:.1f} GiB of KV cache, more than "
        f"the {free / 2**30:.1f} GiB free on its devices; lower rollout.max_num_seqs "
        f"({need // engine.slots / 2**20:.0f} MiB a slot) or the response length")
  return {"async/engine_slots": float(engine.slots), "async/kv_cache_bytes": float(total)}
