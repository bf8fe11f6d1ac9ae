"""The driver's side of the split placement on the Ray backend (ray_backend.split): the
actor as the algorithm drivers see it, training on its pool and generating on the
rollout pool, a generation submitted there and not yet waited for, and trainer.mode =
"async"'s stream in the rollout pool's process (RemoteStream)."""
from __future__ import annotations

import time

from hflax.controller.ray_backend.group import wait_all
from hflax.controller.ray_backend.split import ROLE, STREAM
from hflax.controller.ray_backend.transport import to_wire


class PendingBatch:
  """A generation submitted to the rollout pool: `result()` waits for it (and for the
  weights' calls), raising as a role call would; calls[answer] is the one whose result
  is the batch (the rollout pool's process 0)."""

  def __init__(self, calls: list, answer: int, what: str):
    self._calls, self._answer, self._what, self._batch = calls, answer, what, None

  def result(self):
    if self._calls is not None:
      self._batch = wait_all(self._calls, self._what)[self._answer]
      self._calls = None
    return self._batch


def with_trainer_weights(train, rollout, method: str, draw_key: bool, *args):
  """Submits the train pool's weights (split.trainer_weights, with a drawn sampling key
  where draw_key) and the rollout pool's `method`(its replica, those weights, *args) on
  every member; the weights' ref goes from pool to pool without the driver. Returns the
  calls (as wait_all takes them) and the index of the rollout pool's process 0's."""
  sent = [m.trainer_weights.remote("actor", draw_key) for m in train.members]
  made = [getattr(m, method).remote(ROLE, sent[0], *args) for m in rollout.members]
  calls = [(train, i, r) for i, r in enumerate(sent)] + [(rollout, i, r)
                                                        for i, r in enumerate(made)]
  return calls, len(sent)


class SplitActor:
  """The actor on a split placement, as the driver sees it: `train` (the actor's handle on
  its pool) for everything but generation, which runs on `rollout` (the replica's)."""

  def __init__(self, train, rollout):
    self._train, self._rollout = train, rollout
    self.sampling = rollout.sampling
    self.generate_mesh_shape = rollout.generate_mesh_shape

  def __getattr__(self, name):
    if name.startswith("__") or name in ("_train", "_rollout"):
      raise AttributeError(name)
    return getattr(self._train, name)

  def start_generation(self, prompts, sampling=None, rng=None) -> PendingBatch:
    """Submits the weight sync and the generation and returns at once: the weights' ref goes
    from the train pool to the rollout pool without the driver, and Ray runs each
    process's calls in submission order, so they are the weights before any later call."""
    import ray
    payload = ray.put(to_wire(((prompts,), {"sampling": sampling, "rng": rng})))
    calls, answer = with_trainer_weights(self._train.group, self._rollout.group,
                                         "generate_with", rng is None, payload)
    return PendingBatch(calls, answer, "actor.generate_sequences (weight sync and "
                        f"generation on pool {self._rollout.group.name!r})")

  def generate_sequences(self, prompts, sampling=None, rng=None):
    return self.start_generation(prompts, sampling, rng).result()

  def open_stream(self, **settings) -> "RemoteStream":
    """trainer.mode = "async": the stream's host in the rollout pool's process."""
    return RemoteStream(self._train.group, self._rollout.group, settings)

  def __repr__(self):
    return f"SplitActor(train={self._train!r}, rollout={self._rollout!r})"


class RemoteStream:
  """hflax.controller.stream_host.StreamHost's calls (those AsyncRollouts makes), run by
  the StreamHost in the rollout pool's process (one process: its engine's host state is
  that process's). Two differ from the local ones: start_decode submits the decode calls
  and returns, so they run there while the driver goes on to the train pool's update
  (finish_decode waits for them), and sync sends the train pool's weights to it through
  Ray's object store (trainer_weights), never through the driver."""

  def __init__(self, train, rollout, settings: dict):
    self._train, self._rollout = train, rollout
    rollout.broadcast(f"opening the async stream on pool {rollout.name!r}", "open_stream",
                      ROLE, settings)
    self._decoding: PendingBatch | None = None

  def _call(self, method: str, *args):
    return self._rollout.call(STREAM, method, *args)

  def admit(self, prompts, key) -> int:
    return self._call("admit", prompts, key)

  def take(self, count: int) -> dict:
    return self._call("take", count)

  def start_decode(self, calls: int):
    import ray
    payload = ray.put(to_wire(((calls,), {})))
    refs = [m.call.remote(STREAM, "decode", payload) for m in self._rollout.members]
    self._decoding = PendingBatch([(self._rollout, i, r) for i, r in enumerate(refs)], 0,
                                  f"async decode steps on pool {self._rollout.name!r}")

  def finish_decode(self) -> dict:
    """The decode's metrics (StreamHost.finish_decode's); the wait is what the update and
    the driver's work since the take did not hide."""
    decoding, self._decoding = self._decoding, None
    start = time.perf_counter()
    out = {} if decoding is None else dict(decoding.result())
    return {**out, "timing_s/async_decode_wait": time.perf_counter() - start}

  def sync(self) -> dict:
    calls, answer = with_trainer_weights(self._train, self._rollout, "sync_stream", False)
    return wait_all(calls, f"async weight sync to pool {self._rollout.name!r}")[answer]

  def state_dict(self) -> dict:
    return self._call("state_dict")

  def load_state_dict(self, state: dict) -> int:
    return self._call("load_state_dict", state)
