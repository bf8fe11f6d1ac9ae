"""trainer.mode = "async" on the Ray backend: the stream's host
(hflax.controller.stream_host.StreamHost) in the processes of the pool that generates, and
the driver's RemoteStream, which makes AsyncRollouts' calls there.

Where the stream runs:
- the split placement (role "rollout" on a pool of its own): beside the rollout pool's
  replica of the actor (ray_backend.split); each weight sync sends the train pool's
  weights to it through Ray's object store (split.trainer_weights);
- any other placement (the actor generates on its own pool, as on the colocated default):
  beside the actor in its pool's processes (StreamingActor, the driver's handle to it);
  the weight sync is StreamHost.sync, the in-process hand-over of the local colocated
  run, so no weights leave the process.

On a pool of several processes every process runs the stream (each reads the engine's
tokens back with a collective, so all hold the same requests; with agent trajectories
process 0 alone runs the tools: hflax.rollout.agents.shared_tools), and process 0 answers
the driver.
"""
from __future__ import annotations

import time

from hflax.controller.ray_backend.group import PendingBatch, RoleHandle, wait_all
from hflax.controller.ray_backend.member import STREAM
from hflax.controller.ray_backend.split import with_trainer_weights
from hflax.controller.ray_backend.transport import to_wire


class RemoteStream:
  """StreamHost's calls (those AsyncRollouts makes), run by the StreamHost beside worker
  `role` of `pool` (its engine's host state is those processes'). Two differ from the
  local ones: start_decode submits the decode calls and returns, so they run there while
  the driver goes on (finish_decode waits for them); and where `trainer` is given (the
  split's train pool), sync sends its weights to the stream through Ray's object store,
  never through the driver; without it the stream takes the actor's weights in-process."""

  def __init__(self, pool, role: str, settings: dict, trainer=None):
    self._pool, self._trainer = pool, trainer
    pool.broadcast(f"opening the async stream on pool {pool.name!r}", "open_stream", role,
                   settings)
    self._decoding: PendingBatch | None = None

  def _call(self, method: str, *args):
    return self._pool.call(STREAM, method, *args)

  def admit(self, prompts, key) -> int:
    return self._call("admit", prompts, key)

  def take(self, count: int) -> dict:
    return self._call("take", count)

  def start_decode(self, calls: int):
    """Ray runs a process's calls in submission order: on a split placement the decode
    runs beside the train pool's update; where the actor shares the process, before the
    step's next calls there, with the engine's own (pre-update) weights either way."""
    import ray
    payload = ray.put(to_wire(((calls,), {})))
    refs = [m.call.remote(STREAM, "decode", payload) for m in self._pool.members]
    self._decoding = PendingBatch([(self._pool, i, r) for i, r in enumerate(refs)], 0,
                                  f"async decode steps on pool {self._pool.name!r}")

  def finish_decode(self) -> dict:
    """The decode's metrics (StreamHost.finish_decode's); the wait is what the update and
    the driver's work since the take did not hide."""
    decoding, self._decoding = self._decoding, None
    start = time.perf_counter()
    out = {} if decoding is None else dict(decoding.result())
    return {**out, "timing_s/async_decode_wait": time.perf_counter() - start}

  def sync(self) -> dict:
    if self._trainer is None:
      return self._call("sync")
    calls, answer = with_trainer_weights(self._trainer, self._pool, "sync_stream", False)
    return wait_all(calls, f"async weight sync to pool {self._pool.name!r}")[answer]

  def state_dict(self) -> dict:
    return self._call("state_dict")

  def load_state_dict(self, state: dict) -> int:
    return self._call("load_state_dict", state)


class StreamingActor(RoleHandle):
  """The actor's handle where it generates on its own pool (no split): a RoleHandle whose
  async stream runs beside it, in its pool's processes."""

  @classmethod
  def of(cls, handle: RoleHandle) -> "StreamingActor":
    return cls(handle.group, handle._role, handle.group.descriptions[handle._role])

  def open_stream(self, **settings) -> RemoteStream:
    return RemoteStream(self.group, self._role, settings)
