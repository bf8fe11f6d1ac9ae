"""trainer.mode = "async": rollouts stream through a rollout engine of the actor's own
(hflax.rollout.stream) while the trainer trains, with partial rollouts and a staleness
bound of trainer.max_staleness weight versions.

A step, as the controller runs it:
  1. admission: while fewer than max_staleness + 1 batches of groups are submitted and
     untrained, the loader's next batch of prompts goes in (each prompt as a group of n
     requests, drawing with the key of the actor's next sampling call, sample j of prompt
     i as row i * n + j: the batch sampler's draw);
  2. the engine steps until train_batch_size groups are ready, and the step takes them,
     oldest first (their prompts re-read from the dataset by row);
  3. the algorithm's step runs on them (rewards, old log-probs recomputed by the actor for
     rows older than its weights, rollout correction against the per-token log-probs the
     engine recorded, the update);
  4. the engine decodes trainer.async_decode_steps more tokens in every busy slot with the
     pre-update weights, while the update is computed;
  5. the weight sync: the updated weights, resharded to the generation layout, go to the
     engine as the next version; requests in flight decode on with them (partial
     rollouts), and groups now past the bound are dropped; then admission again.

What overlaps. JAX dispatch is asynchronous: step 4's decode programs are queued while the
update's are still running. On a split placement (the generation mesh on devices apart
from the training ones) they run at the same time, so the engine works through the
update; the engine reads each call's tokens back to the host, which holds the controller
for that call only. On a colocated placement (the default: the hybrid engine's generation
mesh on the training devices) a device runs its programs in order, so step 4 runs after
the update and only host work overlaps; there async still differs from sync in what it
trains on (trajectories started by older weights, finished by newer ones) and in what it
wastes (a long response no longer holds the whole batch back). Alternating the engine and
the trainer in one thread, for a fixed number of decode steps, keeps the schedule
independent of timing: a run is reproducible, and its tests are.

max_staleness = 0 admits one batch per version, after the weight sync, and nothing is in
flight during an update: the sync schedule, on this code path.

Multi-turn (rollout.multi_turn.enable): each sample is an agent trajectory
(hflax.rollout.agents.streaming), its engine built and its rows made as multi_turn_rollout
builds and makes them (the same trajectory_fields and actor.trajectory_batch, segments
included); an engine step of the stream is the agent loop's advance, its environment
steps in lockstep with the engine so the schedule stays independent of timing. A turn in
flight at a weight sync decodes on with the new weights and later turns sample with them;
a trajectory's age is its oldest model token's version.

Checkpoints hold the stream's state (hflax.rollout.stream: finished-but-untrained samples
whole, unfinished ones regenerated on resume by the weights then current) next to the
loader position past every submitted prompt, so a resumed run loses no finished
trajectory and trains on none past the bound.
"""
from __future__ import annotations

import time

import jax
import numpy as np

from hflax.controller.batch import Batch
from hflax.launch.modes import ServedOnce
from hflax.models.transformer import positions_from_mask
from hflax.rollout.agents.loop import AgentLoop, model_versions
from hflax.rollout.agents.rollout import environments, trajectory_fields
from hflax.rollout.agents.streaming import Trajectories, tools_overhead
from hflax.rollout.sampler import length_bucket
from hflax.rollout.stream import RolloutStream, response_fields

STEPS_PER_CALL = 8  # decode steps one engine call runs (the host admits between calls)


class AsyncRollouts:
  """trainer.mode = "async" (module docstring). actor: the local actor worker; collate:
  the loader's rows -> prompt fields; groups: prompts a step trains on."""

  def __init__(self, actor, collate, *, groups: int, n: int, max_staleness: int,
               decode_steps: int, max_prompt_len: int, max_num_seqs: int = 0):
    self.worker, self.collate, self.groups, self.n = actor, collate, groups, n
    self.max_staleness, self.decode_steps = max_staleness, decode_steps
    # Every request admission allows decodes at once, unless max_num_seqs caps them.
    slots = (max_staleness + 1) * groups * n
    slots = min(slots, max_num_seqs) if max_num_seqs else slots
    steps = min(STEPS_PER_CALL, max(decode_steps, 1))
    self.agent = actor.multi_turn  # rollout.multi_turn: each sample an agent trajectory
    if self.agent is None:
      engine, samples = actor.streaming_engine(slots=slots, max_prompt_len=max_prompt_len,
                                               steps_per_call=steps), None
    else:
      engine, samples = self._agent_engine(slots, max_prompt_len, steps)
    self.stream = RolloutStream(engine, n, max_staleness, samples)
    self._synced = False  # whether the engine holds the actor's current weights
    self._sync_metrics: dict = {}
    self._dropped_before = 0
    self.batch: Batch | None = None  # this step's generated rows, served to the driver

  def _agent_engine(self, slots: int, max_prompt_len: int, steps: int):
    """The engine and samples of multi-turn trajectories, as multi_turn_rollout builds
    them, with a prompt width for any prompt the loader passes plus the tools' message."""
    mt, worker = self.agent, self.worker
    self.tokenizer, response = worker.agent_tokenizer(), worker.sampling.max_new_tokens
    self.prompt_width = length_bucket(max_prompt_len + tools_overhead(mt, self.tokenizer))
    # A new segment's context is a fresh request's prompt: as long as a whole trajectory.
    width = self.prompt_width + response if mt.rewrite_history else self.prompt_width
    engine = worker.streaming_engine(
        slots=slots, max_prompt_len=width, steps_per_call=steps, max_turn_len=mt.max_turn_len,
        max_new_tokens=min(mt.turn_tokens or response, response), max_context_len=width + response)
    loop = AgentLoop(engine, self.tokenizer, max_turns=mt.max_turns,
                     rewrite_history=mt.rewrite_history, lockstep=True)
    return engine, Trajectories(loop, mt)

  # -- the trainer's schedule interface (as hflax.launch.modes.OneStepOff's) ---------------
  def step_prompts(self, prompt_iter) -> Batch:
    """Admits prompts, steps the engine until a batch of groups is ready and takes it;
    returns its prompts (the driver's generate_sequences then returns its rows)."""
    if not self._synced:
      self._sync()
    self._admit(prompt_iter)
    began = time.perf_counter()
    calls = self.stream.fill(self.groups)
    waited = time.perf_counter() - began
    taken = self.stream.take(self.groups)
    prompts = Batch.from_dict(self.collate(np.asarray([g.row_index for g in taken])))
    self.batch = self._rows(taken, prompts, {"timing_s/rollout_wait": waited,
                                             "async/fill_decode_calls": float(calls)})
    return prompts

  def actor(self, actor, prompt_iter):
    """The actor as this step's driver sees it: its first sampling call returns the rows
    the stream handed over."""
    return ServedOnce(actor, lambda prompts: self._hand_over())

  def _hand_over(self) -> Batch:
    batch, self.batch = self.batch, None
    return batch

  def after_update(self, actor, prompt_iter):
    """Decodes on with the pre-update weights (overlapping the update), then the weight
    sync and admission."""
    self.stream.step(-(-self.decode_steps // self.stream.engine.steps_per_call))
    self._sync()
    self._admit(prompt_iter)

  def _sync(self):
    graphdef, state, version, metrics = self.worker.generation_weights()
    self.stream.set_weights(state, version, graphdef=graphdef)
    self._sync_metrics, self._synced = metrics, True

  def _admit(self, prompt_iter):
    capacity = (self.max_staleness + 1) * self.groups
    while len(self.stream.groups) + self.groups <= capacity:
      prompts = next(prompt_iter)
      key = self.worker.next_sampling_key()
      rows = np.asarray(prompts["row_index"])
      if self.agent is not None:
        self._admit_trajectories(prompts, rows, key)
        continue
      tokens, mask = np.asarray(prompts["prompts"]), np.asarray(prompts["prompt_mask"], bool)
      for i in range(len(prompts)):
        self.stream.submit(int(rows[i]), tokens[i][mask[i]].tolist(), key, first_row=i * self.n)

  def _admit_trajectories(self, prompts, rows, key):
    """A batch's prompts as groups of agent trajectories: each prompt rendered with its
    tools, and every trajectory's token limit the batch's prompt width plus the response
    length, as multi_turn_rollout sets them for the batch."""
    raw, sources = list(prompts["raw_prompt"]), list(prompts["data_source"])
    envs = environments(self.agent, sources)
    ids = [self.tokenizer.encode_chat(env.reset({"prompt": list(r)}), add_generation_prompt=True)
           for env, r in zip(envs, raw)]
    longest = max(len(x) for x in ids)
    if longest > self.prompt_width:
      raise ValueError(f"data.max_prompt_length: a prompt with its tools is {longest} tokens, "
                       f"more than the stream's engine holds ({self.prompt_width}); raise it")
    limit = length_bucket(longest) + self.worker.sampling.max_new_tokens
    for i in range(len(prompts)):
      context = {"raw_prompt": list(raw[i]), "data_source": str(sources[i]), "max_tokens": limit}
      self.stream.submit(int(rows[i]), ids[i], key, first_row=i * self.n, context=context)

  def _rows(self, taken, prompts: Batch, metrics: dict) -> Batch:
    """The taken groups as the sampler's fields on the actor's devices, with the step's
    asynchronous metrics."""
    if self.agent is not None:
      return self._trajectory_rows(taken, prompts, metrics)
    version = self.stream.engine.version
    fields = response_fields(taken, self.worker.sampling.max_new_tokens,
                             self.worker.sampling.pad_id, version)
    per_row, token_staleness = fields.pop("versions_per_row"), fields.pop("token_staleness")
    prompt_rows = prompts.repeat(self.n)
    fields["prompts"] = np.asarray(prompt_rows["prompts"], np.int32)
    fields["prompt_mask"] = np.asarray(prompt_rows["prompt_mask"], bool)
    fields["input_ids"] = np.concatenate([fields["prompts"], fields["responses"]], axis=1)
    fields["attention_mask"] = np.concatenate([fields["prompt_mask"], fields["response_mask"]],
                                              axis=1)
    fields["position_ids"] = positions_from_mask(fields["attention_mask"])
    fields["group_ids"] = np.repeat(np.arange(len(taken), dtype=np.int32), self.n)
    # Each row's prompt's dataset row: which trajectories a step trained on, in its dumps.
    fields["row_index"] = np.repeat(np.asarray([g.row_index for g in taken], np.int32), self.n)
    arrays = jax.device_put(fields, self.worker.home)
    metrics = self._async_metrics(metrics, per_row, token_staleness)
    return Batch(arrays, prompt_rows.objects, {"metrics": metrics})

  def _trajectory_rows(self, taken, prompts: Batch, metrics: dict) -> Batch:
    """The taken groups' trajectories as multi_turn_rollout's rows (trajectory_fields,
    the actor's trajectory_batch: segments included), every token's version kept, with
    the asynchronous metrics and the agent loop's over these trajectories."""
    trajectories = [t for g in taken for t in g.done]
    extra = [x for x in prompts["extra_info"] for _ in range(self.n)]
    fields, infos = trajectory_fields(
        trajectories, extra, pad_id=self.tokenizer.pad_id,
        prompt_width=length_bucket(max(len(g.prompt_ids) for g in taken)),
        response_width=self.worker.sampling.max_new_tokens)
    versions = [model_versions(t) for t in trajectories]
    lag = [self.stream.engine.version - v for vs in versions for v in vs]
    per_row = np.asarray([len(set(vs)) for vs in versions], np.int32)
    metrics = {**self._async_metrics(metrics, per_row, float(np.mean(lag)) if lag else 0.0),
               **self.stream.samples.loop.summary(trajectories)}
    batch = self.worker.trajectory_batch(fields, infos, prompts, self.n, metrics,
                                         token_versions=True)
    # Each row's prompt's dataset row: which trajectories a step trained on, in its dumps.
    rows = np.asarray([g.row_index for g in taken], np.int32)
    row_index = jax.device_put(rows[np.asarray(batch["group_ids"])], self.worker.home)
    return Batch({**batch.arrays, "row_index": row_index}, batch.objects, batch.meta)

  def _async_metrics(self, metrics: dict, per_row: np.ndarray, token_staleness: float) -> dict:
    """The weight sync's and the stream's: groups dropped past the bound (this step, over
    the run), groups untrained, weight versions per trajectory, the mean token lag."""
    dropped = self.stream.dropped - self._dropped_before
    self._dropped_before = self.stream.dropped
    return {**self._sync_metrics, **metrics,
            "async/dropped_groups": float(dropped),
            "async/dropped_groups_total": float(self.stream.dropped),
            "async/untrained_groups": float(len(self.stream.groups)),
            "async/versions_per_trajectory_mean": float(per_row.mean()),
            "async/versions_per_trajectory_max": float(per_row.max()),
            "async/token_staleness_mean": token_staleness}

  # -- checkpoints ------------------------------------------------------------------------
  def state_dict(self) -> dict:
    return {"stream": self.stream.state_dict(), "dropped_before": self._dropped_before}

  def load_state_dict(self, state: dict | None, collate=None):
    """The stream as saved; its unfinished samples are resubmitted, and the engine gets
    the restored weights before the next step."""
    if state is None:
      return
    self.stream.load_state_dict(state["stream"])
    self._dropped_before = int(state["dropped_before"])
    self._synced = False
