"""The driver's side of the split placement on the Ray backend (ray_backend.split): the
actor as the algorithm drivers see it, training on its pool and generating on the
rollout pool. trainer.mode = "async"'s stream runs in the rollout pool's processes
(ray_backend.stream.RemoteStream)."""
from __future__ import annotations

from hflax.controller.ray_backend.group import PendingBatch
from hflax.controller.ray_backend.split import ROLE, with_trainer_weights
from hflax.controller.ray_backend.stream import RemoteStream
from hflax.controller.ray_backend.transport import to_wire


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

  def open_stream(self, **settings):
    """trainer.mode = "async": the stream's host in the rollout pool's processes, its
    weight sync from the train pool through the object store."""
    return RemoteStream(self._rollout.group, ROLE, settings, trainer=self._train.group)

  def __repr__(self):
    return f"SplitActor(train={self._train!r}, rollout={self._rollout!r})"
