"""The driver's side of the split placement on the Ray backend (ray_backend.split): the
actor as the algorithm drivers see it, training on its pool and generating on the
rollout pool, and a generation submitted there and not yet waited for."""
from __future__ import annotations

from hflax.controller.ray_backend.group import wait_all
from hflax.controller.ray_backend.split import ROLE
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
    train, rollout = self._train.group, self._rollout.group
    sent = [m.trainer_weights.remote("actor", rng is None) for m in train.members]
    payload = ray.put(to_wire(((prompts,), {"sampling": sampling, "rng": rng})))
    made = [m.generate_with.remote(ROLE, sent[0], payload) for m in rollout.members]
    calls = [(train, i, r) for i, r in enumerate(sent)] + [(rollout, i, r)
                                                          for i, r in enumerate(made)]
    return PendingBatch(calls, len(sent), "actor.generate_sequences (weight sync and "
                        f"generation on pool {rollout.name!r})")

  def generate_sequences(self, prompts, sampling=None, rng=None):
    return self.start_generation(prompts, sampling, rng).result()

  def __repr__(self):
    return f"SplitActor(train={self._train!r}, rollout={self._rollout!r})"
