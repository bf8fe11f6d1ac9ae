"""A role's trained state on its mesh and the programs that read and update it.

An UpdateEngine holds the parameters and optimizer state of one role worker (placed in
the training layout) and runs on them: forward passes jitted over rows split by data
(padded, or packed as controller.packing plans them), the mini-batch loops of an update
(padded, or packed micro-batches scanned in one program per mini-batch), and the averaging
of their metrics. The worker keeps the role's settings and passes the ones a call reads.

Methods return immediately with arrays still being computed (JAX dispatch is
asynchronous); nothing here reads an array back to the host.
"""
from __future__ import annotations

import functools
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from hflax.controller.batch import Batch
from hflax.controller.packing import (micro_batch_plans, prompt_groups, response_before,
                                      response_layout, shape_floor, stack)
from hflax.controller.protocol import LIVE_ROWS, replicated
from hflax.controller.training import (UpdateConfig, make_scan_step, make_train_step,
                                       mini_batch_order, train_compiler_options)
from hflax.sharding.layouts import batch_sharding, data_parallel_size
from hflax.sharding.placement import RolePlacement

# A per-row field of every update's mini-batches: 1 in the first mini-batch of an update
# call, whose parameters are still the behaviour policy's, so the actor's loss takes its own
# forward (without gradient) as old_log_probs there. The first mini-batch is then exactly
# on-policy (ppo_kl 0, nothing clipped) whatever the precision and however differently the
# log-prob pass and the training step were compiled (bf16 dots round otherwise in each).
FRESH = "fresh_minibatch"

# The config field that sets a role's forward-pass token budget (hflax.launch.roles).
_FORWARD_BUDGET_FIELD = {"actor": "actor.log_prob_max_token_len_per_gpu",
                         "ref": "actor.log_prob_max_token_len_per_gpu",
                         "critic": "critic.ppo_max_token_len_per_gpu"}


def response_width(batch: Batch) -> int:
  return int(batch["responses"].shape[1])


class UpdateEngine:
  """params (and opt_state) of one role on placement.mesh, and the programs over them.

  tx, lr_fn and opt_state: the role's optimizer, its learning-rate schedule and state
  (None for a role that does not train); trainable: the filter of the trained weights
  (None: all of them); prefix: the metrics' prefix; seed: of the mini-batch orders.
  """

  def __init__(self, placement: RolePlacement, shardings, params, *, compute_dtype,
               prefix: str, seed: int = 0, tx=None, lr_fn=None, opt_state=None, trainable=None):
    self.placement, self.mesh, self.shardings = placement, placement.mesh, shardings
    self.rows_sharding = batch_sharding(self.mesh)
    self.params, self.opt_state = params, opt_state
    self.tx, self.lr_fn, self.trainable = tx, lr_fn, trainable
    self.compute_dtype, self.prefix, self.seed = compute_dtype, prefix, seed
    self.updates, self.optimizer_steps = 0, 0  # update calls and optimizer steps so far
    self.steps: dict = {}  # the compiled update programs, by loss name (packed: and width)
    self.shape_floors: dict = {}  # packed (length, slots, micro-batches) per pass (shape_floor)

  # -- jit plumbing -------------------------------------------------------------------------
  def on_mesh(self, fn: Callable) -> Callable:
    """fn traced under this pool's abstract mesh, on which the model pins the layout of
    its activations (transformer.rows_split)."""
    @functools.wraps(fn)
    def traced(*args):
      with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh):
        return fn(*args)
    return traced

  @functools.cached_property
  def jit_rows(self):
    """jit(fn)(params, rows) with params in the training layout and rows split over data."""
    def build(fn):
      return jax.jit(self.on_mesh(fn), in_shardings=(self.shardings, self.rows_sharding),
                     out_shardings=self.rows_sharding)
    return functools.lru_cache(maxsize=None)(build)

  @functools.cached_property
  def _jit_packed(self):
    rows_sharding, rep = self.rows_sharding, replicated(self.mesh)

    def build(fn, width):
      def packed(params, rows, plan):
        slot_mask = jnp.take(rows["attention_mask"], plan["seq_rows"], axis=0)
        out = fn(params, packed_fields(rows["input_ids"], slot_mask, plan, width))
        B = rows["input_ids"].shape[0]
        # An empty slot reads row 0: its values are 0 (not scored), so adding is harmless.
        return jax.tree.map(lambda x: jnp.zeros((B, *x.shape[1:]), x.dtype).at[
            plan["seq_rows"]].add(x), out)
      return jax.jit(self.on_mesh(packed), in_shardings=(self.shardings, rows_sharding, rep),
                     out_shardings=rows_sharding)
    return functools.lru_cache(maxsize=None)(build)

  def _compiler_options(self):
    return train_compiler_options(self.mesh.devices.flat, self.compute_dtype)

  # -- forward passes -----------------------------------------------------------------------
  def packed_forward(self, fn: Callable, rows: dict, batch: Batch, *, token_budget: int,
                     share_prompts: bool):
    """fn(params, packed fields) -> [slots, W] arrays, scattered back to [B, W] (0 where a
    token is not scored) and summed over the plans of the batch (one, or cuts of at most
    token_budget tokens per device; all one shape, so one program)."""
    live_rows = batch.meta.get(LIVE_ROWS, len(batch))
    mask = np.asarray(batch["attention_mask"]).copy()
    mask[live_rows:] = 0  # the rows padding the batch to the data-parallel size
    plans = self._floored_plans(
        "forward", mask, multiple=data_parallel_size(self.mesh), budget=token_budget,
        field=_FORWARD_BUDGET_FIELD.get(self.placement.role, "log_prob_max_token_len"),
        prompts=self._prompt_groups(batch, mask, share_prompts),
        prompt_width=mask.shape[1] - response_width(batch))
    program = self._jit_packed(fn, response_width(batch))
    shared = any(plan.shared_prompt_tokens > 0 for plan in plans)  # one program for all
    total = None
    for plan in plans:
      out = program(self.params, rows, plan.arrays(shared))
      total = out if total is None else jax.tree.map(jnp.add, total, out)
    return total

  # -- updates on padded rows -----------------------------------------------------------------
  def train(self, name: str, loss_fn: Callable, rows: dict, batch: Batch, cfg: UpdateConfig,
            weight_fn: Callable | None = None, prepare: Callable | None = None) -> Batch:
    """Mini-batch loop over `rows` (arrays on this mesh); metrics (device scalars, averaged
    over mini-batches) come back in meta["metrics"]. prepare: see make_scan_step."""
    live_rows = batch.meta.get(LIVE_ROWS, len(batch))
    micro = cfg.micro_batch_size or cfg.mini_batch_size
    dp = data_parallel_size(self.mesh)
    if micro < dp:
      raise ValueError(f"{self.placement.role}.{name}: micro_batch_size={micro} rows is less than "
                       f"the data-parallel size {dp} of pool {self.placement.pool.name!r}: "
                       "most devices would compute padding")
    if "response_mask" not in rows:
      raise KeyError(f"{self.placement.role}.{name}: updates need the 'response_mask' field")
    # Each micro-batch is padded to a multiple of dp with masked copies of row 0, so a
    # mini-batch the data-parallel size does not divide still splits evenly.
    unit = cfg.mini_batch_size // micro * dp
    if name not in self.steps:
      opt_shardings = jax.tree.map(lambda x: x.sharding, self.opt_state)
      step = make_train_step(loss_fn, self.tx, cfg.mini_batch_size // micro, weight_fn,
                             self.trainable, prepare)
      rows_sharding, rep = self.rows_sharding, replicated(self.mesh)

      # The mini-batch is cut inside the step: a cut dispatched on its own would make the
      # controller wait (device_put of an unfinished array) behind this role's earlier
      # steps, and on a busy CPU behind other pools' work too.
      def cut_and_step(params, opt_state, all_rows, index, live, fresh):
        mini = jax.tree.map(lambda v: jnp.take(v, index, axis=0), all_rows)
        mask = mini["response_mask"]
        mini["response_mask"] = mask * live[:, None].astype(mask.dtype)
        mini[FRESH] = jnp.broadcast_to(fresh, live.shape)
        return step(params, opt_state, jax.lax.with_sharding_constraint(mini, rows_sharding))

      self.steps[name] = jax.jit(
          self.on_mesh(cut_and_step), donate_argnums=(0, 1),
          in_shardings=(self.shardings, opt_shardings, rows_sharding, rep, rep, rep),
          out_shardings=(self.shardings, opt_shardings, rep),
          compiler_options=self._compiler_options())
    history = []
    for fresh, index, live in self._mini_batches(live_rows, unit, cfg):
      self.params, self.opt_state, metrics = self.steps[name](
          self.params, self.opt_state, rows, index, live, fresh)
      history.append({**metrics, "lr": jnp.float32(self.lr_fn(self.optimizer_steps))})
      self.optimizer_steps += 1
    self.updates += 1
    return self._metrics(history)

  def _mini_batches(self, live_rows: int, unit: int, cfg: UpdateConfig):
    """(fresh, row indices, live) of each mini-batch of this update: indices padded to a
    multiple of `unit` with row 0, live 0 there; fresh 1 for the first (see FRESH)."""
    order = mini_batch_order(live_rows, cfg, self.seed + self.updates)
    for i, index in enumerate(order):
      padded = -len(index) % unit
      live = np.concatenate([np.ones(len(index), np.float32), np.zeros(padded, np.float32)])
      index = np.concatenate([index, np.zeros(padded, index.dtype)]).astype(np.int32)
      yield np.float32(i == 0), index, live

  def _metrics(self, history: list[dict]) -> Batch:
    """The mini-batches' metrics averaged, and the first one's ppo_kl and pg_clipfrac."""
    first = {f"{k}_first_minibatch": v for k, v in history[0].items() if k in ("ppo_kl", "pg_clipfrac")}
    averaged = jax.tree.map(lambda *xs: jnp.mean(jnp.stack(xs)), *history)
    return Batch(meta={"metrics": {f"{self.prefix}/{k}": v
                                   for k, v in {**averaged, **first}.items()}})

  # -- updates on packed rows ---------------------------------------------------------------
  def train_packed(self, name: str, loss_fn: Callable, rows: dict, batch: Batch,
                   cfg: UpdateConfig, weight_fn: Callable | None = None,
                   prepare: Callable | None = None, *, share_prompts: bool,
                   split_tokens: float) -> Batch:
    """train on packed micro-batches: loss_fn(params, fields) reads the packed rows
    (fields "packed_tokens", "segment_ids", "response_index", "response_valid") and the
    [slots, width] fields of the micro-batch's sequences, response_mask 0 in empty slots.

    Each mini-batch is balanced over mini/micro micro-batches of dp packed rows, or with
    update.max_token_len (verl's use_dynamic_bsz) over as many as its token budget needs;
    weighted as train, so the optimizer step is the padded path's (for a loss without
    weight_fn only with the padded path's row groups, which are then kept). The
    micro-batches of a mini-batch share one shape and run in one program (scan, then the
    optimizer step), compiled per (micro-batches, packed length, slots) (controller.packing).
    split_tokens: the tokens a packed row must hold on average for fill_fewest to cut finer."""
    dp = data_parallel_size(self.mesh)
    live_rows = batch.meta.get(LIVE_ROWS, len(batch))
    if "response_mask" not in rows:
      raise KeyError(f"{self.placement.role}.{name}: updates need the 'response_mask' field")
    mask = np.asarray(batch["attention_mask"])  # the plan needs the lengths on the host
    width = response_width(batch)
    prompts = self._prompt_groups(batch, mask, share_prompts)
    step = self._packed_step(name, loss_fn, weight_fn, width, prepare)
    cuts = cfg.mini_batch_size // (cfg.micro_batch_size or cfg.mini_batch_size)
    history = []
    for fresh, index, live in self._mini_batches(live_rows, dp, cfg):
      # Without weights micro-batch means count equally: only the padded path's row groups
      # (m, m + cuts, ...) then give its step; with them any cut does.
      groups = (None if weight_fn is not None or cfg.max_token_len else
                [np.arange(m, len(index), cuts) for m in range(cuts)])
      plans = self._floored_plans(
          name, mask[index] * live[:, None].astype(mask.dtype), multiple=dp,
          budget=cfg.max_token_len, micro_batches=cuts, groups=groups,
          field=f"{self.placement.role}.ppo_max_token_len_per_gpu",
          prompts=None if prompts is None else prompts[index], prompt_width=mask.shape[1] - width,
          fill_fewest=weight_fn is not None, split_tokens=split_tokens)
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
    return self._metrics(history)

  def _floored_plans(self, key, mask, **kwargs):
    """micro_batch_plans at least as large as this pass's earlier ones (shape_floor)."""
    floor = self.shape_floors.get(key, (0, 0, 0))
    plans = micro_batch_plans(mask, floor=floor, **kwargs)
    self.shape_floors[key] = shape_floor(plans, floor)
    return plans

  def _packed_step(self, name: str, loss_fn: Callable, weight_fn: Callable | None, width: int,
                   prepare: Callable | None = None):
    """The program of one packed mini-batch: its rows cut out, every micro-batch's
    gradients scanned, the optimizer step; params and opt_state donated."""
    key = ("packed", name, width)
    if key not in self.steps:
      rows_sharding, rep = self.rows_sharding, replicated(self.mesh)

      def micro_rows(mini, plan):
        one = jax.tree.map(lambda v: jnp.take(v, plan["seq_rows"], axis=0), mini)
        keep = plan["member"].astype(one["response_mask"].dtype)
        one["response_mask"] = one["response_mask"] * keep[:, None]
        one = jax.lax.with_sharding_constraint(one, rows_sharding)
        return {**one, **packed_fields(mini["input_ids"], one["attention_mask"], plan, width)}

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
      self.steps[key] = jax.jit(
          self.on_mesh(step), donate_argnums=(0, 1),
          in_shardings=(self.shardings, opt_shardings, rows_sharding, rep, rep, rep, rep),
          out_shardings=(self.shardings, opt_shardings, rep),
          compiler_options=self._compiler_options())
    return self.steps[key]

  @staticmethod
  def _prompt_groups(batch: Batch, mask: np.ndarray, share_prompts: bool):
    """prompt_groups of the batch's rows when packed passes share prompts, else None."""
    if not share_prompts:
      return None
    return prompt_groups(np.asarray(batch["input_ids"]), mask,
                         mask.shape[1] - response_width(batch))


def packed_fields(input_ids_BxT, slot_mask_SxT, plan: dict, width: int) -> dict:
  """The packed rows of a plan (controller.packing) gathered from the batch's input_ids,
  and where each response token of the plan's slots (attention mask slot_mask) sits in
  them."""
  tokens = jnp.take(input_ids_BxT.reshape(-1), plan["token_index"])
  index, valid = response_layout(slot_mask_SxT, width, plan["seq_start"], plan["member"])
  shared = {k: plan[k] for k in ("prefix_ids", "positions") if k in plan}  # prompts shared
  return {"packed_tokens": jnp.where(plan["segment_ids"] > 0, tokens, 0),
          "segment_ids": plan["segment_ids"], "response_index": index, "response_valid": valid,
          "response_before": response_before(index, plan["prompt_last"], valid), **shared}
