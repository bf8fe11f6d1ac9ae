"""Optimizer steps for role workers: mini-batches, micro-batch gradient accumulation, epochs.

A mini-batch is one optimizer step; it is cut into micro-batches whose gradients are
summed inside one compiled step (lax.scan), so memory is bounded by the micro-batch.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

# Compiler options are the platform's choice; imported here under their first names.
from hflax import platforms
from hflax.platforms import train_compiler_options  # noqa: F401

BF16_FAST_MATH = platforms.bf16_fast_math_options()  # XLA:CPU's, for a bfloat16 step


@dataclasses.dataclass(frozen=True)
class OptimConfig:
  lr: float = 1e-6
  weight_decay: float = 0.0
  b1: float = 0.9
  b2: float = 0.999
  grad_clip: float = 1.0
  warmup_steps: int = 0
  schedule: str = "constant"  # one of SCHEDULES
  total_steps: int = 0  # needed by "cosine"
  min_lr_ratio: float = 0.0


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
  mini_batch_size: int  # rows per optimizer step
  micro_batch_size: int | None = None  # rows per gradient-accumulation unit (None: no split)
  epochs: int = 1
  shuffle: bool = False
  # Packed passes (verl's use_remove_padding): sequences laid end to end, no padding.
  remove_padding: bool = False
  # Tokens per device per micro-batch (verl's ppo_max_token_len_per_gpu, with
  # use_dynamic_bsz): micro-batches cut by tokens instead of rows; packs the update.
  max_token_len: int = 0
  # Tokens per device of the role's forward passes (log-probs, values) on packed rows
  # (verl's log_prob_max_token_len_per_gpu); 0: one pass, rows at most the padded width.
  log_prob_max_token_len: int = 0
  # Packed passes lay a prompt shared by several rows of a micro-batch (GRPO's n samples)
  # once, its responses attending to it (model.share_prompts; hflax.controller.packing).
  share_prompts: bool = True

  @property
  def packed(self) -> bool:
    return self.remove_padding or self.max_token_len > 0


SCHEDULES = ("constant", "cosine")


def learning_rate(cfg: OptimConfig):
  if cfg.schedule == "constant":
    after = optax.constant_schedule(cfg.lr)
  elif cfg.schedule == "cosine":
    if cfg.total_steps <= cfg.warmup_steps:
      raise ValueError("optim.total_steps must exceed optim.warmup_steps for a cosine schedule")
    after = optax.cosine_decay_schedule(cfg.lr, cfg.total_steps - cfg.warmup_steps,
                                        alpha=cfg.min_lr_ratio)
  else:
    raise ValueError(f"optim.schedule: {cfg.schedule!r} is not one of {SCHEDULES}")
  if not cfg.warmup_steps:
    return after
  warmup = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
  return optax.join_schedules([warmup, after], [cfg.warmup_steps])


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
  chain = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
  chain.append(optax.adamw(learning_rate(cfg), b1=cfg.b1, b2=cfg.b2,
                           weight_decay=cfg.weight_decay))
  return optax.chain(*chain)


def trained_part(params, trainable=None):
  """(what the optimizer updates, what stays frozen): `trainable` is an nnx filter (e.g.
  nnx.LoRAParam) of an nnx.State, None for every parameter."""
  if trainable is None:
    return params, None
  return nnx.split_state(params, trainable, ...)


def _weighted_grads(loss_fn: Callable, weight_fn: Callable | None, trainable):
  """grads(params, rows, *once) -> (w * gradient of the trained part, w * metrics, w);
  `once` (what make_scan_step's prepare made) goes to loss_fn as it is, not differentiated."""

  def grads(params, rows, *once):
    trained, frozen = trained_part(params, trainable)
    whole = (lambda t: t) if frozen is None else (lambda t: nnx.merge_state(frozen, t))
    (_, metrics), g = jax.value_and_grad(lambda t: loss_fn(whole(t), rows, *once),
                                         has_aux=True)(trained)
    w = jnp.float32(1.0) if weight_fn is None else jnp.asarray(weight_fn(rows), jnp.float32)
    scale = lambda tree: jax.tree.map(lambda x: w * x, tree)  # noqa: E731
    return scale(g), scale(metrics), w

  return grads


def _apply(tx, trainable):
  """apply(params, opt_state, (weighted gradient sums, weighted metric sums, total weight))."""

  def apply(params, opt_state, sums):
    grads, metrics, total = sums
    trained, frozen = trained_part(params, trainable)
    total = jnp.where(total > 0, total, 1.0)  # nothing to learn from: the gradients are 0
    grads = jax.tree.map(lambda g: g / total, grads)
    metrics = jax.tree.map(lambda m: m / total, metrics)
    metrics["grad_norm"] = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, opt_state, trained)
    trained = optax.apply_updates(trained, updates)
    return (trained if frozen is None else nnx.merge_state(frozen, trained)), opt_state, metrics

  return apply


def make_train_step(loss_fn: Callable, tx: optax.GradientTransformation, micro_batches: int,
                    weight_fn: Callable | None = None, trainable=None,
                    prepare: Callable | None = None):
  """step(params, opt_state, rows) -> (params, opt_state, metrics).

  loss_fn(params, rows) -> (loss, metrics) sees one micro-batch. weight_fn(rows) is what
  that micro-batch's mean loss averages over (its valid tokens for a token-mean loss, its
  sequences for a sequence mean): gradients and metrics are averaged with these weights,
  so the mini-batch's loss does not depend on how it is cut into micro-batches. Without
  it every micro-batch counts equally. With `trainable` (see trained_part) only that part
  has gradients and optimizer state (`tx.init` of it); the rest passes through as is.
  prepare: see make_scan_step.
  """
  scanned = make_scan_step(loss_fn, tx, lambda _, one: one, weight_fn, trainable,
                           prepare=prepare)

  def step(params, opt_state, rows):
    # Micro-batch m takes rows m, m + k, m + 2k, ...: every device keeps its own rows.
    micro = jax.tree.map(
        lambda x: x.reshape(-1, micro_batches, *x.shape[1:]).swapaxes(0, 1), rows)
    return scanned(params, opt_state, None, micro)

  return step


def make_scan_step(loss_fn: Callable, tx: optax.GradientTransformation,
                   micro_rows: Callable, weight_fn: Callable | None = None, trainable=None,
                   empty: Callable | None = None, prepare: Callable | None = None):
  """step(params, opt_state, shared, stacked) -> (params, opt_state, metrics): one
  program that scans over the micro-batches stacked on stacked's leading axis, micro-batch
  m seeing micro_rows(shared, stacked[m]) (e.g. a packed plan applied to the mini-batch's
  rows), and applies the optimizer step, weighted as make_train_step.

  empty(stacked[m]) -> bool (needs weight_fn, for which such a micro-batch weighs 0):
  micro-batches it flags are skipped at run time, so one compiled program serves
  mini-batches that fill fewer of its micro-batches.

  prepare(params) -> once: what every micro-batch's loss reads that depends on the
  parameters alone (transformer.compute_kernels), made once before the loop (XLA does not
  hoist it out) and passed as loss_fn(params, rows, once), as a constant of the gradient."""
  if empty is not None and weight_fn is None:
    raise ValueError("make_scan_step: skipping empty micro-batches needs weight_fn (without "
                     "it every micro-batch counts, empty or not)")
  grads_of, apply = _weighted_grads(loss_fn, weight_fn, trainable), _apply(tx, trainable)

  def step(params, opt_state, shared, stacked):
    once = () if prepare is None else (prepare(params),)
    grads_one = lambda one: grads_of(params, micro_rows(shared, one), *once)  # noqa: E731
    first = jax.tree.map(lambda x: x[0], stacked)
    zeros = jax.tree.map(jnp.zeros_like, jax.eval_shape(grads_one, first))

    def accumulate(sums, one):
      if empty is None:
        return add_sums(sums, grads_one(one)), None
      return jax.lax.cond(empty(one), lambda s, _: s,
                          lambda s, o: add_sums(s, grads_one(o)), sums, one), None

    sums, _ = jax.lax.scan(accumulate, zeros, stacked)
    return apply(params, opt_state, sums)

  return step


def add_sums(a, b):
  return jax.tree.map(jnp.add, a, b)


def mini_batch_order(rows: int, cfg: UpdateConfig, seed: int) -> list[np.ndarray]:
  """Row indices of every mini-batch, for every epoch (validated, shuffled if asked)."""
  if rows % cfg.mini_batch_size:
    raise ValueError(f"mini_batch_size={cfg.mini_batch_size} does not divide the {rows} rows "
                     "of the update batch")
  micro = cfg.micro_batch_size or cfg.mini_batch_size
  if cfg.mini_batch_size % micro:
    raise ValueError(f"micro_batch_size={micro} does not divide "
                     f"mini_batch_size={cfg.mini_batch_size}")
  order = []
  rng = np.random.default_rng(seed)
  for _ in range(cfg.epochs):
    perm = rng.permutation(rows) if cfg.shuffle else np.arange(rows)
    order += [perm[i:i + cfg.mini_batch_size] for i in range(0, rows, cfg.mini_batch_size)]
  return order
