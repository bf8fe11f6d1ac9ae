"""Role workers: each owns one model's parameters (and optimizer state) on its own mesh and
exposes the HybridFlow methods as jitted SPMD programs with explicit shardings.

Methods return immediately with arrays still being computed (JAX dispatch is
asynchronous), so roles on disjoint pools run concurrently; nothing here calls
`float()` or reads an array back to the host.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import SingleDeviceSharding

from hflax.controller.batch import Batch
from hflax.controller.packing import (micro_batch_plans, prompt_groups, response_before,
                                      response_layout, shape_floor, stack)
from hflax.controller.protocol import LIVE_ROWS, Protocol, replicated, transfer
from hflax.controller.training import (OptimConfig, UpdateConfig, learning_rate, make_optimizer,
                                       make_scan_step, make_train_step, mini_batch_order,
                                       train_compiler_options, trained_part)
from hflax.models.lora import (base_config, merged_kernels, split_adapters, split_for_merge,
                               trainable_filter)
from hflax.models.logprobs import packed_log_probs, sequence_log_probs
from hflax.models.transformer import compute_kernels, create_abstract, forward
from hflax.rewards.scorer import last_token_scores
from hflax.rollout.sampler import SamplingParams, generate_over_rows
from hflax.rollout.waves import generation_slots, generation_waves
from hflax.sharding.hybrid_engine import HybridEngine
from hflax.sharding.layouts import (TRAIN_RULES, batch_sharding, data_parallel_size,
                                    state_shardings)
from hflax.sharding.placement import RolePlacement

# A packed micro-batch costs a fixed time besides its matmuls (gathers, per-row slots, the
# loss, the skipped chunks' conditionals): on the 2-layer toy model (2-core CPU) the second
# micro-batch of packing.FILL_SPLIT cost about 75 ms a step and saved nothing. Finer cuts
# only where each still holds this much compute (a few hundred ms on that CPU; SmolLM2-135M:
# 124 tokens).
MIN_SPLIT_FLOPS = 1e11
# bfloat16 matmuls on a CPU (AMX or AVX512-BF16: 1.0-1.7 TFLOP/s against 0.3-0.35 in
# float32 on that CPU; float16 has no such path) do that compute four times sooner and
# run well below their rate on a few hundred rows, so a micro-batch must hold four times
# as much. SmolLM2-135M, GRPO 8 x 8 x 128, bfloat16, one rollout batch replayed: 4 packed
# micro-batches of about 620 tokens updated in 4.45 s against 5.13 s for 8 of about 340
# (float32: 10.01 against 11.03 s, the same time per computed token).
BF16_CPU_SPLIT_FACTOR = 4


def _packs_forward(worker) -> bool:
  return worker.remove_padding


def _packs_update(worker) -> bool:
  return worker.update_cfg is not None and worker.update_cfg.packed


class RoleWorker:
  """Parameters on a role's mesh in the training layout, plus the plumbing every role uses."""

  prefix = "role"

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
    self.params = jax.tree.map(lambda x: jnp.array(x, copy=True),
                               jax.device_put(state, self.shardings))
    self.home = home or SingleDeviceSharding(placement.pool.devices[0])
    self.rows_sharding = batch_sharding(self.mesh)
    self.update_cfg, self.seed, self.updates, self.optimizer_steps = update, seed, 0, 0
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
    self.opt_state = None  # roles that train get one below
    self.calls = 0  # sampling calls so far (the actor's): a resumed run draws the same keys
    if optim is not None:
      if update is None:
        raise ValueError(f"{placement.role}: an optimizer needs an UpdateConfig")
      self.tx, self.lr_fn = make_optimizer(optim), learning_rate(optim)
      # Eager init keeps each moment estimate in its parameter's sharding (jit would put
      # it on one device); scalars such as step counts are then replicated over the mesh.
      on_mesh = lambda x: (isinstance(x.sharding, jax.sharding.NamedSharding)  # noqa: E731
                           and x.sharding.mesh == self.mesh)
      self.opt_state = jax.tree.map(
          lambda x: x if on_mesh(x) else jax.device_put(x, replicated(self.mesh)),
          self.tx.init(trained_part(self.params, self.trainable)[0]))
    self._steps: dict = {}
    self._shape_floors: dict = {}  # packed (length, slots, micro-batches) per pass (shape_floor)

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

  def _on_mesh(self, fn: Callable) -> Callable:
    """fn traced under this pool's abstract mesh, on which the model pins the layout of
    its activations (transformer.rows_split)."""
    @functools.wraps(fn)
    def traced(*args):
      with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
        return fn(*args)
    return traced

  @functools.cached_property
  def _jit_rows(self):
    """jit(fn)(params, rows) with params in the training layout and rows split over data."""
    def build(fn):
      return jax.jit(self._on_mesh(fn), in_shardings=(self.shardings, self.rows_sharding),
                     out_shardings=self.rows_sharding)
    return functools.lru_cache(maxsize=None)(build)

  def _train(self, name: str, loss_fn: Callable, rows: dict, batch: Batch,
             weight_fn: Callable | None = None, prepare: Callable | None = None) -> Batch:
    """Mini-batch loop over `rows` (arrays on this mesh); metrics (device scalars, averaged
    over mini-batches) come back in meta["metrics"]. prepare: see make_scan_step."""
    cfg = self.update_cfg
    live_rows = batch.meta.get(LIVE_ROWS, len(batch))
    micro = cfg.micro_batch_size or cfg.mini_batch_size
    dp = self.data_parallel_rows
    if micro < dp:
      raise ValueError(f"{self.placement.role}.{name}: micro_batch_size={micro} rows is less than "
                       f"the data-parallel size {dp} of pool {self.placement.pool.name!r}: "
                       "most devices would compute padding")
    if "response_mask" not in rows:
      raise KeyError(f"{self.placement.role}.{name}: updates need the 'response_mask' field")
    # Each micro-batch is padded to a multiple of dp with masked copies of row 0, so a
    # mini-batch the data-parallel size does not divide still splits evenly.
    unit = cfg.mini_batch_size // micro * dp
    if name not in self._steps:
      opt_shardings = jax.tree.map(lambda x: x.sharding, self.opt_state)
      step = make_train_step(loss_fn, self.tx, cfg.mini_batch_size // micro, weight_fn,
                             self.trainable, prepare)
      rows_sharding = self.rows_sharding

      # The mini-batch is cut inside the step: a cut dispatched on its own would make the
      # controller wait (device_put of an unfinished array) behind this role's earlier
      # steps, and on a busy CPU behind other pools' work too.
      def cut_and_step(params, opt_state, all_rows, index, live, fresh):
        mini = jax.tree.map(lambda v: jnp.take(v, index, axis=0), all_rows)
        mask = mini["response_mask"]
        mini["response_mask"] = mask * live[:, None].astype(mask.dtype)
        mini[FRESH] = jnp.broadcast_to(fresh, live.shape)
        return step(params, opt_state, jax.lax.with_sharding_constraint(mini, rows_sharding))

      self._steps[name] = jax.jit(
          self._on_mesh(cut_and_step), donate_argnums=(0, 1),
          in_shardings=(self.shardings, opt_shardings, rows_sharding, replicated(self.mesh),
                        replicated(self.mesh), replicated(self.mesh)),
          out_shardings=(self.shardings, opt_shardings, replicated(self.mesh)),
          compiler_options=train_compiler_options(self.mesh.devices.flat, self.cfg.dtype))
    history = []
    for fresh, index, live in self._mini_batches(live_rows, unit):
      self.params, self.opt_state, metrics = self._steps[name](
          self.params, self.opt_state, rows, index, live, fresh)
      history.append({**metrics, "lr": jnp.float32(self.lr_fn(self.optimizer_steps))})
      self.optimizer_steps += 1
    self.updates += 1
    return self._train_metrics(history)

  def _mini_batches(self, live_rows: int, unit: int):
    """(fresh, row indices, live) of each mini-batch of this update: indices padded to a
    multiple of `unit` with row 0, live 0 there; fresh 1 for the first (see FRESH)."""
    order = mini_batch_order(live_rows, self.update_cfg, self.seed + self.updates)
    for i, index in enumerate(order):
      padded = -len(index) % unit
      live = np.concatenate([np.ones(len(index), np.float32), np.zeros(padded, np.float32)])
      index = np.concatenate([index, np.zeros(padded, index.dtype)]).astype(np.int32)
      yield np.float32(i == 0), index, live

  def _train_packed(self, name: str, loss_fn: Callable, rows: dict, batch: Batch,
                    weight_fn: Callable | None = None, prepare: Callable | None = None) -> Batch:
    """_train on packed micro-batches: loss_fn(params, fields) reads the packed rows
    (fields "packed_tokens", "segment_ids", "response_index", "response_valid") and the
    [slots, width] fields of the micro-batch's sequences, response_mask 0 in empty slots.

    Each mini-batch is balanced over mini/micro micro-batches of dp packed rows, or with
    update.max_token_len (verl's use_dynamic_bsz) over as many as its token budget needs;
    weighted as _train, so the optimizer step is the padded path's (for a loss without
    weight_fn only with the padded path's row groups, which are then kept). The
    micro-batches of a mini-batch share one shape and run in one program (scan, then the
    optimizer step), compiled per (micro-batches, packed length, slots) (controller.packing)."""
    cfg, dp = self.update_cfg, self.data_parallel_rows
    live_rows = batch.meta.get(LIVE_ROWS, len(batch))
    if "response_mask" not in rows:
      raise KeyError(f"{self.placement.role}.{name}: updates need the 'response_mask' field")
    mask = np.asarray(batch["attention_mask"])  # the plan needs the lengths on the host
    width = _response_width(batch)
    prompts = self._prompt_groups(batch, mask)
    step = self._packed_step(name, loss_fn, weight_fn, width, prepare)
    cuts = cfg.mini_batch_size // (cfg.micro_batch_size or cfg.mini_batch_size)
    history = []
    for fresh, index, live in self._mini_batches(live_rows, dp):
      # Without weights micro-batch means count equally: only the padded path's row groups
      # (m, m + cuts, ...) then give its step; with them any cut does.
      groups = (None if weight_fn is not None or cfg.max_token_len else
                [np.arange(m, len(index), cuts) for m in range(cuts)])
      plans = self._floored_plans(
          name, mask[index] * live[:, None].astype(mask.dtype), multiple=dp,
          budget=cfg.max_token_len, micro_batches=cuts, groups=groups,
          field=f"{self.placement.role}.ppo_max_token_len_per_gpu",
          prompts=None if prompts is None else prompts[index], prompt_width=mask.shape[1] - width,
          fill_fewest=weight_fn is not None,
          split_tokens=self._min_split_tokens())
      self.params, self.opt_state, metrics = step(self.params, self.opt_state, rows, index,
                                                  live, fresh, stack(plans))
      used = [p for p in plans if p.member.any()]  # the program skips the empty ones
      tokens, computed = sum(p.tokens for p in used), sum(p.computed for p in used)
      history.append({**metrics, "lr": jnp.float32(self.lr_fn(self.optimizer_steps)),
                      "update_tokens": jnp.float32(tokens),
                      "update_padded_tokens": jnp.float32(computed - tokens),
                      "update_shared_prompt_tokens": jnp.float32(
                          sum(p.shared_prompt_tokens for p in used)),
                      "update_micro_batches": jnp.float32(len(used))})
      self.optimizer_steps += 1
    self.updates += 1
    return self._train_metrics(history)

  def _min_split_tokens(self) -> float:
    """Tokens a packed row must hold on average for fill_fewest to cut finer."""
    bf16_on_cpu = (jnp.dtype(self.cfg.dtype) == jnp.bfloat16 and
                   all(d.platform == "cpu" for d in self.mesh.devices.flat))
    factor = BF16_CPU_SPLIT_FACTOR if bf16_on_cpu else 1
    return factor * MIN_SPLIT_FLOPS / (6 * self.cfg.num_params)

  def _floored_plans(self, key, mask, **kwargs):
    """micro_batch_plans at least as large as this pass's earlier ones (shape_floor)."""
    floor = self._shape_floors.get(key, (0, 0, 0))
    plans = micro_batch_plans(mask, floor=floor, **kwargs)
    self._shape_floors[key] = shape_floor(plans, floor)
    return plans

  def _packed_step(self, name: str, loss_fn: Callable, weight_fn: Callable | None, width: int,
                   prepare: Callable | None = None):
    """The program of one packed mini-batch: its rows cut out, every micro-batch's
    gradients scanned, the optimizer step; params and opt_state donated."""
    key = ("packed", name, width)
    if key not in self._steps:
      rows_sharding, rep = self.rows_sharding, replicated(self.mesh)

      def micro_rows(mini, plan):
        one = jax.tree.map(lambda v: jnp.take(v, plan["seq_rows"], axis=0), mini)
        keep = plan["member"].astype(one["response_mask"].dtype)
        one["response_mask"] = one["response_mask"] * keep[:, None]
        one = jax.lax.with_sharding_constraint(one, rows_sharding)
        return {**one, **_packed_fields(mini["input_ids"], one["attention_mask"], plan, width)}

      # With weights an empty micro-batch (fill_fewest leaves some) weighs 0: skipped.
      empty = None if weight_fn is None else lambda plan: ~jnp.any(plan["member"])
      scanned = make_scan_step(loss_fn, self.tx, micro_rows, weight_fn, self.trainable, empty,
                               prepare)

      def step(params, opt_state, all_rows, index, live, fresh, plans):
        mini = jax.tree.map(lambda v: jnp.take(v, index, axis=0), all_rows)
        mini["response_mask"] = mini["response_mask"] * live[:, None].astype(
            mini["response_mask"].dtype)
        mini[FRESH] = jnp.broadcast_to(fresh, live.shape)
        return scanned(params, opt_state, mini, plans)

      opt_shardings = jax.tree.map(lambda x: x.sharding, self.opt_state)
      self._steps[key] = jax.jit(
          self._on_mesh(step), donate_argnums=(0, 1),
          in_shardings=(self.shardings, opt_shardings, rows_sharding, rep, rep, rep, rep),
          out_shardings=(self.shardings, opt_shardings, rep),
          compiler_options=train_compiler_options(self.mesh.devices.flat, self.cfg.dtype))
    return self._steps[key]

  def _prompt_groups(self, batch: Batch, mask: np.ndarray):
    """prompt_groups of the batch's rows when packed passes share prompts, else None."""
    if not self.share_prompts:
      return None
    return prompt_groups(np.asarray(batch["input_ids"]), mask,
                         mask.shape[1] - _response_width(batch))

  def _train_metrics(self, history: list[dict]) -> Batch:
    first = {f"{k}_first_minibatch": v for k, v in history[0].items() if k in ("ppo_kl", "pg_clipfrac")}
    averaged = jax.tree.map(lambda *xs: jnp.mean(jnp.stack(xs)), *history)
    return Batch(meta={"metrics": {f"{self.prefix}/{k}": v
                                   for k, v in {**averaged, **first}.items()}})

  def _packed_forward(self, fn: Callable, rows: dict, batch: Batch):
    """fn(params, packed fields) -> [slots, W] arrays, scattered back to [B, W] (0 where a
    token is not scored) and summed over the plans of the batch (one, or token-budget
    cuts; all one shape, so one program)."""
    live_rows = batch.meta.get(LIVE_ROWS, len(batch))
    mask = np.asarray(batch["attention_mask"]).copy()
    mask[live_rows:] = 0  # the rows padding the batch to the data-parallel size
    plans = self._floored_plans(
        "forward", mask, multiple=self.data_parallel_rows, budget=self.log_prob_max_token_len,
        field=_FORWARD_BUDGET_FIELD.get(self.placement.role, "log_prob_max_token_len"),
        prompts=self._prompt_groups(batch, mask),
        prompt_width=mask.shape[1] - _response_width(batch))
    program = self._jit_packed(fn, _response_width(batch))
    shared = any(plan.shared_prompt_tokens > 0 for plan in plans)  # one program for all
    total = None
    for plan in plans:
      out = program(self.params, rows, plan.arrays(shared))
      total = out if total is None else jax.tree.map(jnp.add, total, out)
    return total

  @functools.cached_property
  def _jit_packed(self):
    rows_sharding, rep = self.rows_sharding, replicated(self.mesh)

    def build(fn, width):
      def packed(params, rows, plan):
        slot_mask = jnp.take(rows["attention_mask"], plan["seq_rows"], axis=0)
        out = fn(params, _packed_fields(rows["input_ids"], slot_mask, plan, width))
        B = rows["input_ids"].shape[0]
        # An empty slot reads row 0: its values are 0 (not scored), so adding is harmless.
        return jax.tree.map(lambda x: jnp.zeros((B, *x.shape[1:]), x.dtype).at[
            plan["seq_rows"]].add(x), out)
      return jax.jit(self._on_mesh(packed), in_shardings=(self.shardings, rows_sharding, rep),
                     out_shardings=rows_sharding)
    return functools.lru_cache(maxsize=None)(build)


# The config field that sets a role's forward-pass token budget (hflax.launch.roles).
_FORWARD_BUDGET_FIELD = {"actor": "actor.log_prob_max_token_len_per_gpu",
                         "ref": "actor.log_prob_max_token_len_per_gpu",
                         "critic": "critic.ppo_max_token_len_per_gpu"}


def _packed_fields(input_ids_BxT, slot_mask_SxT, plan: dict, width: int) -> dict:
  """The packed rows of a plan (controller.packing) gathered from the batch's input_ids,
  and where each response token of the plan's slots (attention mask slot_mask) sits in
  them."""
  tokens = jnp.take(input_ids_BxT.reshape(-1), plan["token_index"])
  index, valid = response_layout(slot_mask_SxT, width, plan["seq_start"], plan["member"])
  shared = {k: plan[k] for k in ("prefix_ids", "positions") if k in plan}  # prompts shared
  return {"packed_tokens": jnp.where(plan["segment_ids"] > 0, tokens, 0),
          "segment_ids": plan["segment_ids"], "response_index": index, "response_valid": valid,
          "response_before": response_before(index, plan["prompt_last"], valid), **shared}


def _response_width(batch: Batch) -> int:
  return int(batch["responses"].shape[1])


class ActorRolloutWorker(RoleWorker):
  """The policy: generates in the generate layout (hybrid engine), trains in the train layout."""

  prefix = "actor"

  def __init__(self, placement, graphdef, state, *, sampling: SamplingParams,
               loss_fn: Callable | None = None, generate_dtype: str | None = None,
               recompute_log_prob: bool = False, loss_fields: tuple[str, ...] = (),
               optimizer_offload: bool = False, max_num_seqs: int = 0,
               continuous_batching: bool = False, old_log_probs_in_reward: bool = False, **kw):
    super().__init__(placement, graphdef, state, **kw)
    self.sampling, self.loss_fn, self.loss_fields = sampling, loss_fn, tuple(loss_fields)
    # Sequences one generation replica holds at once (0: all of its rows): the tighter of
    # the config's rollout.max_num_seqs and the placement's (the KV cache the plan fits).
    self.max_num_seqs = min((c for c in (max_num_seqs, placement.max_num_seqs) if c), default=0)
    # Continuous batching: that many decode slots per replica instead of waves of prompts.
    self.continuous_batching = continuous_batching
    # Optimizer state in host memory from generation until the next update, so the KV
    # cache and the generation copy of the weights have the accelerator to themselves.
    self.optimizer_offload = optimizer_offload and self.opt_state is not None
    self._opt_on_device = None  # the device shardings while the state is offloaded
    # In float32 the sampler's log-probs are the trainer's to float precision. Generation
    # in another dtype, or low-precision compute (where the KV-cache decode and the
    # teacher-forced pass round differently, ~1e-3 in bfloat16), needs the separate
    # forward pass that makes the first mini-batch exactly on-policy, as verl always runs.
    self.recompute_log_prob = (recompute_log_prob or self.cfg.dtype != "float32" or
                               generate_dtype not in (None, self.cfg.param_dtype))
    # That pass is skipped where nothing reads its result: one optimizer step per batch
    # (whose loss takes the update's own forward as the behaviour policy, see FRESH) and no
    # KL penalty in the reward (which reads the old log-probs), unless asked for.
    self.recompute_requested = recompute_log_prob
    self.old_log_probs_in_reward = old_log_probs_in_reward
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
    self.base_graphdef, shardings = graphdef, self.shardings
    if self.trainable is not None:
      # Generation runs the merged weights (W + scale A B) on the base model's graph: no
      # adapter matmuls in the decode loop, and the engine reshards base-shaped weights.
      self.base_graphdef = create_abstract(base_config(self.cfg))[0]
      # Only the adapted kernels are computed (and copied); the other weights pass through.
      kernels = split_for_merge(abstract)[0]
      self._merge = jax.jit(functools.partial(merged_kernels, self.cfg),
                            out_shardings=state_shardings(kernels, self.mesh, TRAIN_RULES))
      abstract = split_adapters(abstract)[1]
      shardings = state_shardings(abstract, self.mesh, TRAIN_RULES)
    self.engine = HybridEngine(self.mesh, abstract, shardings, placement.generate_tensor,
                               generate_dtype, placement.generate_strided, self.base_graphdef)
    self.temperature = sampling.temperature or 1.0
    self._rng = jax.random.key(self.seed)

  def generate_sequences(self, prompts: Batch, sampling: SamplingParams | None = None,
                         rng=None) -> Batch:
    """prompts: fields "prompts" [B, P] and "prompt_mask" (left-padded). Returns B * n rows.

    Without `rng`, call i of the run samples with fold_in(seed key, i), so a resumed run
    (which restores the call count) draws exactly what the uninterrupted run would have.
    """
    params = sampling or self.sampling
    for key in ("prompts", "prompt_mask"):
      if key not in prompts:
        raise KeyError(f"actor.generate_sequences needs field {key!r}; batch has {prompts.keys()}")
    count = len(prompts)
    # Generation replicas split the prompts, in waves when max_num_seqs caps them.
    replicas = self.engine.mesh.shape["data"]
    if self.continuous_batching:
      wave, slots = 0, generation_slots(count, replicas, params.n, self.max_num_seqs)
    else:
      wave = replicas * generation_waves(count, replicas, params.n, self.max_num_seqs)[1]
      slots = 0
    gen_state, metrics = self.engine.to_generate(self._generation_weights())
    if self.optimizer_offload:
      metrics.update(self._offload_optimizer())
    if rng is None:
      rng = jax.random.fold_in(self._rng, self.calls)
      self.calls += 1
    out = generate_over_rows(self.engine.graphdef, gen_state, prompts["prompts"],
                             prompts["prompt_mask"], rng, params, self.engine.mesh,
                             wave_rows=wave, slots=slots,
                             collect=lambda x: jax.device_put(x, self.home))
    del gen_state  # the generation copy is freed once the programs have consumed it
    metrics["rollout/waves"] = float(-(-count // wave)) if wave else 1.0
    # samples of prompt i are rows i*n .. i*n + n - 1
    out["group_ids"] = jax.device_put(
        jnp.repeat(jnp.arange(count, dtype=jnp.int32), params.n), self.home)
    return Batch(out, prompts.repeat(params.n).objects, {"metrics": metrics})

  def old_log_probs(self, batch: Batch) -> Batch:
    """The behaviour policy's log-probs: the rollout's own, or recomputed when they differ."""
    if self.recompute_log_prob and not self._update_reads_only_its_own(len(batch)):
      return self.compute_log_prob(batch)
    return Batch({"old_log_probs": batch["rollout_log_probs"]})

  def _update_reads_only_its_own(self, rows: int) -> bool:
    """Whether nothing but the update's first (FRESH) mini-batch would read recomputed
    old log-probs of `rows` rows: then the separate pass is skipped, as TRL does."""
    cfg = self.update_cfg
    return (cfg is not None and cfg.epochs == 1 and rows <= cfg.mini_batch_size
            and not self.recompute_requested and not self.old_log_probs_in_reward)

  @transfer(Protocol.DATA_PARALLEL, inputs=("input_ids", "attention_mask"), packs=_packs_forward)
  def compute_log_prob(self, rows, batch):
    if self.remove_padding:
      logp, entropy = self._packed_forward(_packed_log_probs_fn(self.graphdef, self.temperature),
                                           rows, batch)
      return {"old_log_probs": logp, "entropy": entropy}
    fn = self._jit_rows(_log_probs_fn(self.graphdef, _response_width(batch), self.temperature))
    logp, entropy = fn(self.params, rows)
    return {"old_log_probs": logp, "entropy": entropy}

  def _generation_weights(self):
    """The training-layout weights generation reshards: with LoRA, the merged ones."""
    if self.trainable is None:
      return self.params
    kernels, adapters, rest = split_for_merge(self.params)
    return nnx.merge_state(rest, self._merge(kernels, adapters))

  @transfer(Protocol.DATA_PARALLEL, inputs=("input_ids", "attention_mask"), packs=_packs_forward)
  def compute_ref_log_prob(self, rows, batch):
    """With LoRA, the reference policy is the base model beneath the adapters (verl's
    ref_in_actor): the log-probs of the frozen weights, with no copy of them elsewhere."""
    if self.trainable is None:
      raise ValueError("actor.compute_ref_log_prob needs LoRA adapters (model.lora_rank > 0); "
                       "without them the reference policy is a role of its own")
    if self.remove_padding:
      logp, _ = self._packed_forward(
          _base_packed_log_probs_fn(self.base_graphdef, self.temperature), rows, batch)
      return {"ref_log_prob": logp}
    fn = self._jit_rows(_base_log_probs_fn(self.base_graphdef, _response_width(batch),
                                           self.temperature))
    logp, _ = fn(self.params, rows)
    return {"ref_log_prob": logp}

  def _offload_optimizer(self) -> dict:
    """The optimizer state to host memory, each leaf keeping its sharding; its size is
    reported on every generation it is off the device (validation may have moved it)."""
    if self._opt_on_device is None:
      self._opt_on_device = jax.tree.map(lambda x: x.sharding, self.opt_state)
      # Not waited for: the copy overlaps generation, and the device memory is freed when
      # it completes.
      self.opt_state = jax.device_put(self.opt_state, jax.tree.map(
          lambda s: s.with_memory_kind("pinned_host"), self._opt_on_device))
    return {"offload/optimizer_bytes": float(sum(x.nbytes for x in jax.tree.leaves(self.opt_state)))}

  def _reload_optimizer(self):
    if self._opt_on_device is not None:
      self.opt_state = jax.device_put(self.opt_state, self._opt_on_device)
      self._opt_on_device = None

  @transfer(Protocol.DATA_PARALLEL, inputs=("input_ids", "attention_mask", "response_mask",
                                            "old_log_probs", "advantages"), packs=_packs_update)
  def update_actor(self, rows, batch):
    if self.loss_fn is None:
      raise ValueError("actor has no loss_fn; pass one (e.g. from hflax.algorithms)")
    self._reload_optimizer()
    for k in self.loss_fields:  # e.g. ref_log_prob for a KL loss
      rows[k] = jax.device_put(batch[k], self.rows_sharding)
    width, temperature, graphdef, loss = _response_width(batch), self.temperature, self.graphdef, self.loss_fn
    weight_fn = getattr(loss, "micro_batch_weight", None)
    # The kernels in the compute dtype, cast once per optimizer step for all its micro-batches.
    prepare = functools.partial(compute_kernels, graphdef)
    if self.update_cfg.packed:
      packed = _packed_log_probs_fn(graphdef, temperature)

      def packed_loss(params, fields, kernels):
        logp, entropy = packed(params, fields, kernels)
        return loss(logp, entropy, _fresh_behaviour(logp, fields))
      return self._train_packed("update_actor", packed_loss, rows, batch, weight_fn, prepare)

    def loss_fn(params, fields, kernels):
      logp, entropy = sequence_log_probs(graphdef, params, fields["input_ids"],
                                         fields["attention_mask"], temperature=temperature,
                                         last=width, compute_kernels=kernels)
      return loss(logp, entropy, _fresh_behaviour(logp, fields))

    return self._train("update_actor", loss_fn, rows, batch, weight_fn, prepare)


# A per-row field of every update's mini-batches: 1 in the first mini-batch of an update
# call, whose parameters are still the behaviour policy's, so the actor's loss takes its own
# forward (without gradient) as old_log_probs there. The first mini-batch is then exactly
# on-policy (ppo_kl 0, nothing clipped) whatever the precision and however differently the
# log-prob pass and the training step were compiled (bf16 dots round otherwise in each).
FRESH = "fresh_minibatch"


def _fresh_behaviour(logp, fields):
  fresh = fields[FRESH][:, None] > 0
  return {**fields, "old_log_probs": jnp.where(fresh, jax.lax.stop_gradient(logp),
                                               fields["old_log_probs"])}


class ReferenceWorker(RoleWorker):
  prefix = "ref"

  def __init__(self, placement, graphdef, state, *, temperature: float = 1.0, **kw):
    super().__init__(placement, graphdef, state, **kw)
    self.temperature = temperature

  @transfer(Protocol.DATA_PARALLEL, inputs=("input_ids", "attention_mask"), packs=_packs_forward)
  def compute_ref_log_prob(self, rows, batch):
    if self.remove_padding:
      logp, _ = self._packed_forward(_packed_log_probs_fn(self.graphdef, self.temperature),
                                     rows, batch)
      return {"ref_log_prob": logp}
    fn = self._jit_rows(_log_probs_fn(self.graphdef, _response_width(batch), self.temperature))
    logp, _ = fn(self.params, rows)
    return {"ref_log_prob": logp}


class CriticWorker(RoleWorker):
  prefix = "critic"

  def __init__(self, placement, graphdef, state, *, loss_fn: Callable | None = None, **kw):
    super().__init__(placement, graphdef, state, **kw)
    self.loss_fn = loss_fn

  @transfer(Protocol.DATA_PARALLEL, inputs=("input_ids", "attention_mask"), packs=_packs_forward)
  def compute_values(self, rows, batch):
    if self.remove_padding:
      return {"values": self._packed_forward(_packed_values_fn(self.graphdef), rows, batch)}
    return {"values": self._jit_rows(_values_fn(self.graphdef, _response_width(batch)))(
        self.params, rows)}

  @transfer(Protocol.DATA_PARALLEL, inputs=("input_ids", "attention_mask", "response_mask",
                                            "values", "returns"), packs=_packs_update)
  def update_critic(self, rows, batch):
    values_of, loss = _values_fn(self.graphdef, _response_width(batch)), self.loss_fn
    if self.update_cfg.packed:
      packed = _packed_values_fn(self.graphdef)
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
    scores = self._jit_rows(_score_fn(self.graphdef))(self.params, rows)
    return {self.output: scores}


@functools.lru_cache(maxsize=None)
def _log_probs_fn(graphdef, width: int, temperature: float):
  def fn(params, rows):
    return sequence_log_probs(graphdef, params, rows["input_ids"], rows["attention_mask"],
                              temperature=temperature, last=width)
  return fn


@functools.lru_cache(maxsize=None)
def _packed_log_probs_fn(graphdef, temperature: float):
  def fn(params, fields, compute_kernels=None):
    return packed_log_probs(graphdef, params, fields["packed_tokens"], fields["segment_ids"],
                            fields["response_index"], fields["response_valid"],
                            temperature=temperature, positions_RxL=fields.get("positions"),
                            prefix_ids_RxL=fields.get("prefix_ids"),
                            before_index_BxW=fields["response_before"],
                            compute_kernels=compute_kernels)
  return fn


@functools.lru_cache(maxsize=None)
def _base_packed_log_probs_fn(base_graphdef, temperature: float):
  inner = _packed_log_probs_fn(base_graphdef, temperature)
  return lambda params, fields: inner(split_adapters(params)[1], fields)


@functools.lru_cache(maxsize=None)
def _base_log_probs_fn(base_graphdef, width: int, temperature: float):
  """_log_probs_fn of the base weights of a state that holds LoRA adapters."""
  inner = _log_probs_fn(base_graphdef, width, temperature)
  return lambda params, rows: inner(split_adapters(params)[1], rows)


@functools.lru_cache(maxsize=None)
def _values_fn(graphdef, width: int):
  def fn(params, rows):
    model, hidden = forward(graphdef, params, rows["input_ids"], rows["attention_mask"])
    # The value of a response token is read at the position that predicts it.
    return model.values(hidden)[:, -width - 1:-1]
  return fn


@functools.lru_cache(maxsize=None)
def _packed_values_fn(graphdef):
  """_values_fn on packed rows: [B, W], 0 where a response token is not scored."""
  def fn(params, fields):
    segments = fields["segment_ids"]
    model, hidden = forward(graphdef, params, fields["packed_tokens"], segments > 0,
                            segment_ids_BxT=segments, positions_BxT=fields.get("positions"),
                            prefix_ids_BxT=fields.get("prefix_ids"))
    values = jnp.take(model.values(hidden).reshape(-1), fields["response_before"])
    return jnp.where(fields["response_valid"], values, 0.0)
  return fn


@functools.lru_cache(maxsize=None)
def _score_fn(graphdef):
  def fn(params, rows):
    model, hidden = forward(graphdef, params, rows["input_ids"], rows["attention_mask"])
    values = model.values(hidden)
    response_mask = rows["response_mask"]
    width = response_mask.shape[1]
    length = response_mask.sum(axis=1).astype(jnp.int32)
    last = values.shape[1] - width + jnp.maximum(length, 1) - 1
    score = jnp.take_along_axis(values, last[:, None], axis=1)[:, 0]
    at_end = jnp.arange(width)[None, :] == (jnp.maximum(length, 1) - 1)[:, None]
    return jnp.where(at_end, score[:, None], 0.0)
  return fn


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
