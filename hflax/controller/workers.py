"""Role workers: each owns one model's parameters (and optimizer state) on its own mesh and
exposes the HybridFlow methods as jitted SPMD programs with explicit shardings.

This module holds RoleWorker (placement, optimizer, checkpoint arrays; its update engine,
controller.update_engine, holds the trained state and runs the programs) and the roles
other than the actor (controller.actor): the reference policy, the critic, a learned
reward model and a reward computed on the host.

Methods return immediately with arrays still being computed (JAX dispatch is
asynchronous), so roles on disjoint pools run concurrently; nothing here calls
`float()` or reads an array back to the host.
"""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from hflax import platforms
from hflax.controller.batch import Batch
from hflax.controller.protocol import Protocol, replicated, transfer
from hflax.controller.training import (OptimConfig, UpdateConfig, learning_rate, make_optimizer,
                                       trained_part)
from hflax.controller.update_engine import UpdateEngine, response_width
from hflax.models.forwards import (log_probs_fn, packed_log_probs_fn, packed_values_fn,
                                   reward_scores_fn, values_fn)
from hflax.models.lora import trainable_filter
from hflax.rewards.scorer import last_token_scores
from hflax.sharding.layouts import TRAIN_RULES, data_parallel_size, state_shardings
from hflax.sharding.placement import RolePlacement

# A packed micro-batch costs a fixed time besides its matmuls (gathers, per-row slots, the
# loss, the skipped chunks' conditionals): on the 2-layer toy model the second micro-batch
# of packing.FILL_SPLIT cost time and saved nothing. Finer cuts only where each still
# holds this much compute (SmolLM2-135M: 124 tokens).
MIN_SPLIT_FLOPS = 1e11
# bfloat16 matmuls on a CPU with AMX or AVX512-BF16 (float16 has no such path) do that
# compute several times sooner than float32 and run well below their rate on a few
# hundred rows, so a micro-batch must hold four times as much: SmolLM2-135M's bf16 update
# ran faster in 4 packed micro-batches than in 8 (float32 took the same time per computed
# token either way).
BF16_CPU_SPLIT_FACTOR = 4


def packs_forward(worker) -> bool:
  """Whether the worker's forward passes run on packed rows."""
  return worker.remove_padding


def packs_update(worker) -> bool:
  """Whether the worker's updates run on packed rows."""
  return worker.update_cfg is not None and worker.update_cfg.packed


def _held_by_engine(name: str) -> property:
  """A worker attribute its update engine holds: the engine's loops replace the arrays and
  advance the counters, and checkpoints and offloading read and set them here."""
  return property(lambda self: getattr(self.update_engine, name),
                  lambda self, value: setattr(self.update_engine, name, value))


class RoleWorker:
  """Parameters on a role's mesh in the training layout, plus the plumbing every role uses."""

  prefix = "role"
  params = _held_by_engine("params")
  opt_state = _held_by_engine("opt_state")
  updates = _held_by_engine("updates")
  optimizer_steps = _held_by_engine("optimizer_steps")
  _steps = _held_by_engine("steps")  # the compiled update programs
  _shape_floors = _held_by_engine("shape_floors")  # packed (length, slots, micro-batches) per pass

  def __init__(self, placement: RolePlacement, graphdef, state, *, home=None,
               optim: OptimConfig | None = None, update: UpdateConfig | None = None,
               seed: int = 0, remove_padding: bool = False, log_prob_max_token_len: int = 0,
               share_prompts: bool = True):
    self.placement, self.mesh, self.graphdef = placement, placement.mesh, graphdef
    model = nnx.merge(graphdef, jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state))
    self.cfg = model.cfg
    self.shardings = state_shardings(state, self.mesh, TRAIN_RULES)
    # A private copy: updates donate their buffers, which other roles must not share
    # (device_put may hand back the caller's buffers, e.g. for replicated leaves).
    params = jax.tree.map(lambda x: jnp.array(x, copy=True),
                          jax.device_put(state, self.shardings))
    self.home = home or SingleDeviceSharding(placement.pool.devices[0])
    self.update_cfg, self.seed = update, seed
    # Forward passes on packed rows (verl's use_remove_padding), cut by tokens per device
    # when log_prob_max_token_len is set (verl's log_prob_max_token_len_per_gpu).
    # A role that trains takes them from its UpdateConfig unless given here.
    if update is not None:
      remove_padding = remove_padding or update.remove_padding
      log_prob_max_token_len = log_prob_max_token_len or update.log_prob_max_token_len
    self.remove_padding = remove_padding or log_prob_max_token_len > 0
    self.log_prob_max_token_len = log_prob_max_token_len
    self.share_prompts = share_prompts and (update is None or update.share_prompts)
    # With LoRA adapters only they are trained (and have optimizer state).
    self.trainable = trainable_filter(self.cfg, model.head)
    self.calls = 0  # sampling calls so far (the actor's): a resumed run draws the same keys
    tx = lr_fn = opt_state = None  # roles that train get them below
    if optim is not None:
      if update is None:
        raise ValueError(f"{placement.role}: an optimizer needs an UpdateConfig")
      tx, lr_fn = make_optimizer(optim), learning_rate(optim)
      # Eager init keeps each moment estimate in its parameter's sharding (jit would put
      # it on one device); scalars such as step counts are then replicated over the mesh.
      on_mesh = lambda x: (isinstance(x.sharding, jax.sharding.NamedSharding)  # noqa: E731
                           and x.sharding.mesh == self.mesh)
      opt_state = jax.tree.map(
          lambda x: x if on_mesh(x) else jax.device_put(x, replicated(self.mesh)),
          tx.init(trained_part(params, self.trainable)[0]))
    self.update_engine = UpdateEngine(
        placement, self.shardings, params, compute_dtype=self.cfg.dtype, prefix=self.prefix,
        seed=seed, tx=tx, lr_fn=lr_fn, opt_state=opt_state, trainable=self.trainable)
    self.rows_sharding = self.update_engine.rows_sharding

  # -- checkpoints --------------------------------------------------------------------------
  def checkpoint_arrays(self) -> dict:
    """What a checkpoint keeps of this role: the trained parameters and their optimizer
    state. With LoRA that is the adapters alone: the frozen base is rebuilt from its
    source (model.path, the warm-up's cache, the seed) when a run resumes."""
    return {"params": trained_part(self.params, self.trainable)[0], "opt_state": self.opt_state}

  def checkpoint_counters(self) -> dict:
    """The host values a checkpoint keeps beside the arrays: update counts, the sampler's
    call count (so a resumed run draws what the uninterrupted one would), the packed
    passes' shape floors (so it packs, and rounds, as the uninterrupted one would) and the
    frozen base's checksum."""
    return {"updates": self.updates, "optimizer_steps": self.optimizer_steps,
            "calls": self.calls, "frozen_checksum": self.frozen_checksum(),
            "shape_floors": {k: list(v) for k, v in self._shape_floors.items()}}

  def frozen_checksum(self) -> float | None:
    """Sum of |w| over the frozen weights (None: every weight trains): a resumed run checks
    that the base it rebuilt is the one the checkpoint was saved with."""
    frozen = trained_part(self.params, self.trainable)[1]
    if frozen is None:
      return None
    return float(sum(jnp.sum(jnp.abs(x.astype(jnp.float32))) for x in jax.tree.leaves(frozen)))

  def restore_checkpoint(self, arrays: dict, counters: dict, step: int):
    """Takes back what checkpoint_arrays and checkpoint_counters saved at `step`."""
    saved, now = counters.get("frozen_checksum"), self.frozen_checksum()
    if saved is not None and not np.isclose(now, saved, rtol=1e-5):
      raise ValueError(
          f"{self.placement.role}: the frozen base weights (sum |w| = {now:.6g}) are not the "
          f"ones checkpoint step {step} was trained on ({saved:.6g}): model.path, or the "
          "warm-up's cached checkpoint, changed since. Restore them, or start a new run_dir")
    frozen = trained_part(self.params, self.trainable)[1]
    self.params = arrays["params"] if frozen is None else nnx.merge_state(frozen, arrays["params"])
    self.opt_state = arrays["opt_state"]
    self.updates, self.optimizer_steps = counters["updates"], counters["optimizer_steps"]
    self.calls = counters["calls"]
    self._shape_floors = {k: tuple(v) for k, v in counters.get("shape_floors", {}).items()}

  # -- plumbing -----------------------------------------------------------------------------
  def input_sharding(self, protocol: Protocol):
    return self.rows_sharding if protocol is Protocol.DATA_PARALLEL else replicated(self.mesh)

  @property
  def data_parallel_rows(self) -> int:
    """How many ways a batch's rows are split (a padded batch divides by it)."""
    return data_parallel_size(self.mesh)

  def _min_split_tokens(self) -> float:
    """Tokens a packed row must hold on average for fill_fewest to cut finer."""
    bf16_on_cpu = (jnp.dtype(self.cfg.dtype) == jnp.bfloat16 and
                   platforms.all_cpu(self.mesh.devices.flat))
    factor = BF16_CPU_SPLIT_FACTOR if bf16_on_cpu else 1
    return factor * MIN_SPLIT_FLOPS / (6 * self.cfg.num_params)

  # -- the update engine's passes, with this role's settings -------------------------------
  def _train(self, name: str, loss_fn: Callable, rows: dict, batch: Batch,
             weight_fn: Callable | None = None, prepare: Callable | None = None) -> Batch:
    return self.update_engine.train(name, loss_fn, rows, batch, self.update_cfg, weight_fn,
                                    prepare)

  def _train_packed(self, name: str, loss_fn: Callable, rows: dict, batch: Batch,
                    weight_fn: Callable | None = None, prepare: Callable | None = None) -> Batch:
    return self.update_engine.train_packed(
        name, loss_fn, rows, batch, self.update_cfg, weight_fn, prepare,
        share_prompts=self.share_prompts, split_tokens=self._min_split_tokens())

  def _packed_forward(self, fn: Callable, rows: dict, batch: Batch):
    return self.update_engine.packed_forward(fn, rows, batch,
                                             token_budget=self.log_prob_max_token_len,
                                             share_prompts=self.share_prompts)


class ReferenceWorker(RoleWorker):
  prefix = "ref"

  def __init__(self, placement, graphdef, state, *, temperature: float = 1.0, **kw):
    super().__init__(placement, graphdef, state, **kw)
    self.temperature = temperature

  @transfer(Protocol.DATA_PARALLEL, inputs=("input_ids", "attention_mask"), packs=packs_forward)
  def compute_ref_log_prob(self, rows, batch):
    return {"ref_log_prob": self._log_probs(rows, batch)}

  def _log_probs(self, rows, batch):
    """The responses' per-token log-probs under this worker's weights."""
    if self.remove_padding:
      logp, _ = self._packed_forward(packed_log_probs_fn(self.graphdef, self.temperature),
                                     rows, batch)
      return logp
    fn = self.update_engine.jit_rows(
        log_probs_fn(self.graphdef, response_width(batch), self.temperature))
    logp, _ = fn(self.params, rows)
    return logp


class TeacherWorker(ReferenceWorker):
  """On-policy distillation's teacher: the reference's forward on the teacher's weights
  (any checkpoint hflax loads), writing teacher_log_prob."""

  prefix = "teacher"

  @transfer(Protocol.DATA_PARALLEL, inputs=("input_ids", "attention_mask"), packs=packs_forward)
  def compute_teacher_log_prob(self, rows, batch):
    return {"teacher_log_prob": self._log_probs(rows, batch)}


class CriticWorker(RoleWorker):
  prefix = "critic"

  def __init__(self, placement, graphdef, state, *, loss_fn: Callable | None = None, **kw):
    super().__init__(placement, graphdef, state, **kw)
    self.loss_fn = loss_fn

  @transfer(Protocol.DATA_PARALLEL, inputs=("input_ids", "attention_mask"), packs=packs_forward)
  def compute_values(self, rows, batch):
    if self.remove_padding:
      return {"values": self._packed_forward(packed_values_fn(self.graphdef), rows, batch)}
    values = self.update_engine.jit_rows(values_fn(self.graphdef, response_width(batch)))
    return {"values": values(self.params, rows)}

  @transfer(Protocol.DATA_PARALLEL, inputs=("input_ids", "attention_mask", "response_mask",
                                            "values", "returns"), packs=packs_update)
  def update_critic(self, rows, batch):
    values_of, loss = values_fn(self.graphdef, response_width(batch)), self.loss_fn
    if self.update_cfg.packed:
      packed = packed_values_fn(self.graphdef)
      return self._train_packed("update_critic", lambda p, f: loss(packed(p, f), f), rows, batch,
                                getattr(loss, "micro_batch_weight", None))
    return self._train("update_critic", lambda p, f: loss(values_of(p, f), f), rows, batch,
                       getattr(loss, "micro_batch_weight", None))


class RewardModelWorker(RoleWorker):
  """A learned scalar reward (or cost) model: the score head read at the last real token."""

  prefix = "reward"

  def __init__(self, placement, graphdef, state, *, output: str = "token_level_scores", **kw):
    super().__init__(placement, graphdef, state, **kw)
    self.output = output

  @transfer(Protocol.DATA_PARALLEL, inputs=("input_ids", "attention_mask", "response_mask"))
  def compute_reward(self, rows, batch):
    scores = self.update_engine.jit_rows(reward_scores_fn(self.graphdef))(self.params, rows)
    return {self.output: scores}


class FunctionRewardWorker:
  """Rewards a Python function computes on the host (rule-based and custom rewards).

  score_fn(batch) -> [B] scores, given the Batch with its arrays on the host; each score
  is placed on the last real token of its response.
  """

  def __init__(self, score_fn: Callable, *, home=None, output: str = "token_level_scores"):
    self.score_fn, self.output = score_fn, output
    self.home = home or SingleDeviceSharding(jax.devices()[0])

  def compute_reward(self, batch: Batch) -> Batch:
    scores = np.asarray(self.score_fn(batch.to_host()), np.float32)
    if scores.shape != (len(batch),):
      raise ValueError(f"reward function returned shape {scores.shape}, expected ({len(batch)},)")
    token_level = last_token_scores(scores, np.asarray(batch["response_mask"]))
    return Batch({self.output: jax.device_put(token_level, self.home)})
