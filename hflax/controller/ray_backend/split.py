"""The split placement on the Ray backend: placement role "rollout" on a pool apart from
the actor's, so the actor trains in the train pool's processes and generates in the
rollout pool's.

- The rollout pool's processes hold a `RolloutReplica`: the actor's model, sampler and
  hybrid engine (its generate_tensor, generate_strided and max_num_seqs laid over that
  pool, as the local split lays them over the rollout devices), with no optimizer.
- Before each generation the train pool's processes send the weights through Ray's object
  store (`trainer_weights`: host numpy of the actor's parameters, or of its LoRA adapters
  alone, the replica keeping the frozen base it was built with), with the actor's update
  count (the rows' rollout_version) and the sampling key of its next call, which the
  actor draws as the local one does (so its call count stays in its checkpoints).
- The driver sees `SplitActor` (ray_backend.split_actor): every method is the train
  pool's actor but generation.
  `start_generation` only submits the two calls (the weights' ref goes from the train
  pool straight to the rollout pool, never through the driver) and returns a
  `PendingBatch`; Ray runs an actor's calls in the order they were submitted, so the
  weights sent are those before any update submitted after. one_step_off's schedule
  (hflax.launch.modes) takes the next batch this way, so the rollout pool generates
  step k + 1's batch while the train pool runs step k.

- trainer.mode = "async": the replica also holds the stream (open_stream: a
  hflax.controller.stream_host.StreamHost over its actor, which the driver's
  ray_backend.stream.RemoteStream calls); its weight sync (sync_stream) loads
  trainer_weights' payload into the actor and hands the engine the next version.

The metrics are the local split's: `timing_s/weight_sync` (the trainer's copy to host,
the replica's copy onto its devices and its reshard to the generation layout; Ray's
transfer between the two, shared memory on one host, is not timed) and
`rollout/weight_sync_bytes` (the bytes sent).
"""
from __future__ import annotations

import dataclasses
import time

import jax
from flax import nnx

from hflax.controller.build import build_roles
from hflax.controller.ray_backend.transport import to_host, to_wire
from hflax.controller.roles import Role
from hflax.controller.training import trained_part
from hflax.sharding import placement

ROLE = "rollout"  # the replica's name among a pool's workers (placement role "rollout")


def rollout_pool(spec: dict) -> str | None:
  """The pool of placement role "rollout" where it is apart from the actor's, else None
  (checked from the spec alone, as build_placement checks it)."""
  return placement.rollout_pool(spec, "config.placement")


def replica_plan(plan, pool: str, size: int):
  """The run's plan as the rollout pool builds its replica: the actor alone on that pool
  (FSDP over it for the weights it receives, as the local split's rollout mesh), with the
  actor's generation layout and no optimizer."""
  actor = plan.placement["roles"]["actor"]
  layout = {k: actor[k] for k in ("generate_tensor", "generate_strided", "max_num_seqs")
            if k in actor}
  spec = {"pools": {pool: size},
          "roles": {"actor": {"pool": pool, "mesh": {"fsdp": size}, **layout}}}
  train = dataclasses.replace(plan.actor.train, optim=None, update=None)
  return dataclasses.replace(plan, placed_roles=(Role.ACTOR,), placement=spec,
                             actor=dataclasses.replace(plan.actor, train=train),
                             reference_in_actor=False)


def build_replica(devices, plan, policy) -> "RolloutReplica":
  """Runs in every member of the rollout pool (plan: `replica_plan`'s)."""
  return RolloutReplica(build_roles(plan, policy, devices=devices).actor)


def trainer_weights(actor, draw_key: bool) -> dict:
  """Runs in every member of the train pool (gathering a sharded leaf is a collective):
  what the replica needs for one generation, as host values."""
  start = time.perf_counter()
  sent = to_host(trained_part(actor.params, actor.trainable)[0])
  out = {"params": sent, "version": int(actor.updates),
         "bytes": float(sum(x.nbytes for x in jax.tree.leaves(sent))),
         "key": to_wire(actor.next_sampling_key()) if draw_key else None}
  out["pack_s"] = time.perf_counter() - start
  return out


class RolloutReplica:
  """The actor's generation side on the rollout pool: an actor worker without optimizer,
  whose weights are replaced by the trainer's before each generation."""

  def __init__(self, actor):
    self.actor = actor
    self.sampling, self.engine = actor.sampling, actor.engine  # described to the driver

  @property
  def home(self):
    return self.actor.home

  @home.setter
  def home(self, sharding):  # the pool member collects results there
    self.actor.home = sharding

  def load(self, weights: dict) -> float:
    """The trainer's `weights` (trainer_weights') as the actor's; returns the seconds."""
    actor, start = self.actor, time.perf_counter()
    own, frozen = trained_part(actor.params, actor.trainable)
    placed = jax.tree.map(lambda new, old: jax.device_put(new, old.sharding),
                          weights["params"], own)
    actor.params = placed if frozen is None else nnx.merge_state(frozen, placed)
    actor.updates = weights["version"]  # the rows' rollout_version
    jax.block_until_ready(actor.params)
    return time.perf_counter() - start

  def generate_with(self, weights: dict, prompts, sampling=None, rng=None):
    """The actor's generate_sequences with the trainer's `weights` (trainer_weights'),
    sampling with its drawn key unless `rng` is given; the sync's time and bytes added."""
    actor, loaded = self.actor, self.load(weights)
    key = rng if rng is not None else weights["key"].to_key()
    out = actor.generate_sequences(prompts, sampling=sampling, rng=key)
    metrics = out.meta["metrics"]
    metrics["timing_s/weight_sync"] = (weights["pack_s"] + loaded +
                                       metrics.get("timing_s/reshard", 0.0))
    metrics["rollout/weight_sync_bytes"] = weights["bytes"]
    return out

  # -- trainer.mode = "async": the stream's host (controller.stream_host) beside the actor --
  def open_stream(self, settings: dict):
    """The async stream's engine and host state in this process (StreamHost's settings)."""
    from hflax.controller.stream_host import StreamHost
    self.stream = StreamHost(self.actor, **settings)
    return self.stream

  def sync_stream(self, weights: dict) -> dict:
    """The stream's weight sync from the trainer's `weights` (trainer_weights', no key):
    StreamHost.sync's answer, its time and bytes those of the sync through the store."""
    loaded = self.load(weights)
    out = self.stream.sync()
    metrics = out["metrics"]
    metrics["timing_s/weight_sync"] += weights["pack_s"] + loaded
    metrics["rollout/weight_sync_bytes"] = weights["bytes"]
    return out


def with_trainer_weights(train, rollout, method: str, draw_key: bool, *args):
  """The driver's side of a weight sync. Submits the train pool's weights
  (trainer_weights, with a drawn sampling key where draw_key) and the rollout pool's
  `method`(its replica, those weights, *args) on every member; the weights' ref goes
  from pool to pool without the driver. Returns the calls (as wait_all takes them) and
  the index of the rollout pool's process 0's."""
  sent = [m.trainer_weights.remote("actor", draw_key) for m in train.members]
  made = [getattr(m, method).remote(ROLE, sent[0], *args) for m in rollout.members]
  calls = [(train, i, r) for i, r in enumerate(sent)] + [(rollout, i, r)
                                                        for i, r in enumerate(made)]
  return calls, len(sent)
