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

Where the stream runs. Its engine and host state (hflax.controller.stream_host.StreamHost)
sit beside the actor's generation: in the controller's process on the local backend; on
the Ray backend in the processes of the pool that generates (the actor's open_stream,
hflax.controller.ray_backend.stream), where step 4's decode calls are submitted as the
step takes its batch. On a split placement they run in the rollout pool's process while
the train pool computes the update, and the weight sync goes from the train pool through
Ray's object store; elsewhere the stream sits beside the actor in its own pool's
processes, and the weight sync is the in-process hand-over of the local colocated run.
This class drives each through the same calls, in the same order, so all sample alike.

Checkpoints hold the stream's state (hflax.rollout.stream: finished-but-untrained samples
whole; unfinished single responses with the tokens sampled so far, continued on resume by
the weights then current; unfinished trajectories started again) next to the loader
position past every submitted prompt, so a resumed run loses no finished trajectory, no
response's sampled tokens, and trains on none past the bound.
"""
from __future__ import annotations

import time

import jax
import numpy as np

from hflax.controller.batch import Batch
from hflax.controller.stream_host import StreamHost
from hflax.launch.modes import ServedOnce
from hflax.models.transformer import positions_from_mask

STEPS_PER_CALL = 8  # decode steps one engine call runs (the host admits between calls)


def open_stream(actor, **settings):
  """The stream's host beside the actor's generation: the actor's own (on Ray, a
  RemoteStream in the processes of the pool that generates) or a StreamHost in this
  process."""
  opener = getattr(actor, "open_stream", None)
  return opener(**settings) if opener is not None else StreamHost(actor, **settings)


class AsyncRollouts:
  """trainer.mode = "async" (module docstring). actor: the actor as the driver sees it;
  collate: the loader's rows -> prompt fields; groups: prompts a step trains on."""

  def __init__(self, actor, collate, *, groups: int, n: int, max_staleness: int,
               decode_steps: int, max_prompt_len: int, max_num_seqs: int = 0):
    self.worker, self.collate, self.groups, self.n = actor, collate, groups, n
    self.max_staleness = max_staleness
    steps = min(STEPS_PER_CALL, max(decode_steps, 1))
    self.decode_calls = -(-decode_steps // steps)  # the engine calls beside each update
    self.host = open_stream(actor, n=n, max_staleness=max_staleness, batch_rows=groups * n,
                            steps=steps, max_prompt_len=max_prompt_len,
                            max_num_seqs=max_num_seqs)
    self.stream = getattr(self.host, "stream", None)  # in this process: for inspection
    self._untrained = 0  # groups submitted and neither trained nor dropped
    self._synced = False  # whether the engine holds the actor's current weights
    self._sync_metrics: dict = {}
    self._dropped_before = 0
    self.batch: Batch | None = None  # this step's generated rows, served to the driver

  # -- the trainer's schedule interface (as hflax.launch.modes.OneStepOff's) ---------------
  def step_prompts(self, prompt_iter) -> Batch:
    """Admits prompts, steps the engine until a batch of groups is ready and takes it;
    returns its prompts (the driver's generate_sequences then returns its rows)."""
    if not self._synced:
      self._sync()
    self._admit(prompt_iter)
    began = time.perf_counter()
    taken = self.host.take(self.groups)
    waited = time.perf_counter() - began
    self._untrained = taken["untrained"]
    # On Ray these decode calls run in the rollout process from now on, beside the update.
    self.host.start_decode(self.decode_calls)
    prompts = Batch.from_dict(self.collate(np.asarray(taken["rows"])))
    self.batch = self._rows(taken, prompts, {"timing_s/rollout_wait": waited,
                                             "async/fill_decode_calls": float(taken["calls"])})
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
    decoded = self.host.finish_decode()
    self._sync()
    self._sync_metrics.update(decoded)  # reported with the next step, as the sync is
    self._admit(prompt_iter)

  def _sync(self):
    out = self.host.sync()
    self._sync_metrics, self._untrained, self._synced = out["metrics"], out["untrained"], True

  def _admit(self, prompt_iter):
    capacity = (self.max_staleness + 1) * self.groups
    while self._untrained + self.groups <= capacity:
      prompts = next(prompt_iter)
      self._untrained = self.host.admit(prompts, self.worker.next_sampling_key())

  def _place(self, x):
    """On the actor's home device in this process; host values where the actor is in
    other processes (the Ray backend's batches are host values on the driver)."""
    home = getattr(self.worker, "home", None)
    return x if home is None else jax.device_put(x, home)

  def _rows(self, taken: dict, prompts: Batch, metrics: dict) -> Batch:
    """The taken groups as the sampler's fields on the actor's devices, with the step's
    asynchronous metrics."""
    metrics = self._async_metrics(metrics, taken)
    if "infos" in taken:  # rollout.multi_turn: each sample an agent trajectory
      return self._trajectory_rows(taken, prompts, metrics)
    fields = dict(taken["fields"])
    prompt_rows = prompts.repeat(self.n)
    fields["prompts"] = np.asarray(prompt_rows["prompts"], np.int32)
    fields["prompt_mask"] = np.asarray(prompt_rows["prompt_mask"], bool)
    fields["input_ids"] = np.concatenate([fields["prompts"], fields["responses"]], axis=1)
    fields["attention_mask"] = np.concatenate([fields["prompt_mask"], fields["response_mask"]],
                                              axis=1)
    fields["position_ids"] = positions_from_mask(fields["attention_mask"])
    fields["group_ids"] = np.repeat(np.arange(len(taken["rows"]), dtype=np.int32), self.n)
    # Each row's prompt's dataset row: which trajectories a step trained on, in its dumps.
    fields["row_index"] = np.repeat(np.asarray(taken["rows"], np.int32), self.n)
    return Batch(self._place(fields), prompt_rows.objects, {"metrics": metrics})

  def _trajectory_rows(self, taken: dict, prompts: Batch, metrics: dict) -> Batch:
    """The taken groups' trajectories as multi_turn_rollout's rows (trajectory_fields,
    the actor's trajectory_batch: segments included), every token's version kept, with
    the asynchronous metrics and the agent loop's over these trajectories."""
    extra = [x for x in prompts["extra_info"] for _ in range(self.n)]
    infos = [{**(e or {}), **info} for e, info in zip(extra, taken["infos"], strict=True)]
    batch = self.worker.trajectory_batch(taken["fields"], infos, prompts, self.n,
                                         {**metrics, **taken["summary"]}, token_versions=True)
    # Each row's prompt's dataset row: which trajectories a step trained on, in its dumps.
    rows = np.asarray(taken["rows"], np.int32)
    row_index = self._place(rows[np.asarray(batch["group_ids"])])
    return Batch({**batch.arrays, "row_index": row_index}, batch.objects, batch.meta)

  def _async_metrics(self, metrics: dict, taken: dict) -> dict:
    """The weight sync's and the stream's: groups dropped past the bound (this step, over
    the run), groups untrained, weight versions per trajectory, the mean token lag."""
    dropped = taken["dropped"] - self._dropped_before
    self._dropped_before = taken["dropped"]
    per_row = np.asarray(taken["per_row"])
    return {**self._sync_metrics, **metrics,
            "async/dropped_groups": float(dropped),
            "async/dropped_groups_total": float(taken["dropped"]),
            "async/untrained_groups": float(taken["untrained"]),
            "async/versions_per_trajectory_mean": float(per_row.mean()),
            "async/versions_per_trajectory_max": float(per_row.max()),
            "async/token_staleness_mean": float(taken["token_staleness"])}

  # -- checkpoints ------------------------------------------------------------------------
  def state_dict(self) -> dict:
    return {"stream": self.host.state_dict(), "dropped_before": self._dropped_before}

  def load_state_dict(self, state: dict | None, collate=None):
    """The stream as saved; its unfinished samples are resubmitted (single responses with
    their saved tokens), and the engine gets the restored weights before the next step."""
    if state is None:
      return
    self._untrained = self.host.load_state_dict(state["stream"])
    self._dropped_before = int(state["dropped_before"])
    self._synced = False
