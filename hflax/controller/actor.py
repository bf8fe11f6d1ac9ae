"""The actor role: the policy that generates rollouts and is trained on them.

It generates in the generation layout (through the hybrid engine, with LoRA adapters
merged into the weights it hands over), scores log-probs with the trainer's weights,
moves its optimizer state to host memory while it generates, and trains through the
role worker's update engine.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hflax.algorithms.correction import staleness_histogram

from hflax.controller.actor_objective import packed_loss, padded_loss
from hflax.controller.batch import Batch
from hflax.controller.protocol import LIVE_ROWS, Protocol, transfer
from hflax.controller.update_engine import response_width
from hflax.controller.workers import RoleWorker, packs_forward, packs_update
from hflax.models.forwards import (base_log_probs_fn, base_packed_log_probs_fn, log_probs_fn,
                                   packed_log_probs_fn)
from hflax.models.lora import base_config, merged_kernels, split_adapters, split_for_merge
from hflax.models.transformer import compute_kernels, create_abstract
from hflax.rollout import routes
from hflax.rollout.agents.rollout import MultiTurn, multi_turn_rollout, segment_fields
from hflax.rollout.engine import RolloutEngine
from hflax.rollout.sampler import SamplingParams
from hflax.rollout.waves import generation_slots, generation_waves
from hflax.sharding.hybrid_engine import HybridEngine
from hflax.sharding.layouts import TRAIN_RULES, state_shardings


class ActorRolloutWorker(RoleWorker):
  """The policy: generates in the generate layout (hybrid engine), trains in the train layout."""

  prefix = "actor"

  def __init__(self, placement, graphdef, state, *, sampling: SamplingParams,
               loss_fn: Callable | None = None, generate_dtype: str | None = None,
               recompute_log_prob: bool = False, loss_fields: tuple[str, ...] = (),
               optimizer_offload: bool = False, max_num_seqs: int = 0,
               continuous_batching: bool = False, multi_turn: MultiTurn | None = None,
               tokenizer: str = "", old_log_probs_in_reward: bool = False, **kw):
    super().__init__(placement, graphdef, state, **kw)
    self.sampling, self.loss_fn, self.loss_fields = sampling, loss_fn, tuple(loss_fields)
    # Sequences one generation replica holds at once (0: all of its rows): the tighter of
    # the config's rollout.max_num_seqs and the placement's (the KV cache the plan fits).
    self.max_num_seqs = min((c for c in (max_num_seqs, placement.max_num_seqs) if c), default=0)
    # Continuous batching: that many decode slots per replica instead of waves of prompts.
    self.continuous_batching = continuous_batching
    # Multi-turn trajectories with tools in place of single responses (rollout.multi_turn).
    self.multi_turn, self.tokenizer_spec, self._tokenizer = multi_turn, tokenizer, None
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
                               generate_dtype, placement.generate_strided, self.base_graphdef,
                               generate_on=placement.generate_on)
    # The hybrid engine reshards the weights; the rollout engine samples with them, each
    # token tagged with the version of the weights (the actor's update count).
    self.rollout = RolloutEngine(self.engine.graphdef, None, sampling, mesh=self.engine.mesh,
                                 slots=self.engine.mesh.shape["data"])
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
    self.rollout.update_weights(gen_state, version=self.updates)
    del gen_state
    if self.optimizer_offload:
      metrics.update(self._offload_optimizer())
    if rng is None:
      rng = jax.random.fold_in(self._rng, self.calls)
      self.calls += 1
    if self.multi_turn is not None:
      return self._trajectories(prompts, params, rng, metrics, train=sampling is None)
    out = self.rollout.generate((prompts["prompts"], prompts["prompt_mask"]), params, rng=rng,
                                wave_rows=wave, slots=slots,
                                collect=lambda x: jax.device_put(x, self.home))
    # The generation copy is freed once the programs have consumed it.
    self.rollout.release_weights()
    metrics["rollout/waves"] = float(-(-count // wave)) if wave else 1.0
    # samples of prompt i are rows i*n .. i*n + n - 1
    out["group_ids"] = jax.device_put(
        jnp.repeat(jnp.arange(count, dtype=jnp.int32), params.n), self.home)
    return Batch(out, prompts.repeat(params.n).objects, {"metrics": metrics})

  # -- asynchronous rollouts (trainer.mode = "async", hflax.rollout.stream) -----------------
  def streaming_engine(self, *, slots: int, max_prompt_len: int, steps_per_call: int,
                       max_new_tokens: int | None = None, max_turn_len: int = 0,
                       max_context_len: int = 0) -> RolloutEngine:
    """A rollout engine of its own on the generation mesh, for requests streamed while the
    actor trains; it gets its weights from `generation_weights`. max_new_tokens (a turn's,
    default the response's), max_turn_len and max_context_len: for agent trajectories,
    as multi_turn_rollout builds its engine."""
    data = self.engine.mesh.shape["data"]
    sampling = dataclasses.replace(self.sampling, n=1,
                                   max_new_tokens=max_new_tokens or self.sampling.max_new_tokens)
    return RolloutEngine(self.engine.graphdef, None, sampling,
                         mesh=self.engine.mesh, slots=-(-slots // data) * data,
                         max_prompt_len=max_prompt_len, steps_per_call=steps_per_call,
                         max_turn_len=max_turn_len, max_context_len=max_context_len)

  def generation_weights(self) -> tuple:
    """The weight sync: (graphdef, the current weights in the generation layout, their
    version (the update count), metrics with the sync's time and bytes)."""
    start = time.perf_counter()
    gen_state, metrics = self.engine.to_generate(self._generation_weights())
    # The hybrid engine reuses a training buffer wherever a device already holds its new
    # shard; the streaming engine keeps its weights through the updates, which donate
    # those buffers, so it gets a copy of its own.
    if not self.engine.split:  # a split placement's copy is on other devices already
      gen_state = jax.tree.map(lambda x: jax.device_put(x, x.sharding, may_alias=False),
                               gen_state)
    metrics["timing_s/weight_sync"] = time.perf_counter() - start
    metrics["rollout/weight_sync_bytes"] = float(sum(x.nbytes for x in jax.tree.leaves(gen_state)))
    return self.engine.graphdef, gen_state, self.updates, metrics

  def next_sampling_key(self):
    """The key of the run's next sampling call, fold_in(seed key, call count), as
    generate_sequences draws it: a stream of requests takes one per batch of prompts."""
    key = jax.random.fold_in(self._rng, self.calls)
    self.calls += 1
    return key

  def _trajectories(self, prompts: Batch, params: SamplingParams, rng, metrics: dict, *,
                    train: bool = True) -> Batch:
    """generate_sequences for multi-turn trajectories (hflax.rollout.agents.rollout): one
    row per trajectory, prompt i's n trajectories in rows i*n .. i*n + n - 1.

    A trajectory whose history was rewritten trains as its segments: its rows follow
    each other, "segment_head" ties them (one advantage a trajectory) and copies with an
    empty loss mask pad the rows to a multiple of the mini-batch. A call with sampling of
    its own (validation, ReMax's greedy baseline) is scored, not trained: it keeps each
    trajectory's last segment, one row a trajectory, as it holds the final answer."""
    graphdef, state = self.rollout.weights
    fields, infos, agent_metrics = multi_turn_rollout(
        graphdef, state, version=self.rollout.version, mesh=self.engine.mesh, sampling=params,
        settings=self.multi_turn, tokenizer=self.agent_tokenizer(),
        raw_prompts=list(prompts["raw_prompt"]), data_sources=list(prompts["data_source"]),
        extra_info=list(prompts["extra_info"]), rng=rng,
        response_width=params.max_new_tokens)
    self.rollout.release_weights()
    return self.trajectory_batch(fields, infos, prompts, params.n,
                                 {**metrics, **agent_metrics}, train=train)

  def agent_tokenizer(self):
    """The tokenizer agent trajectories are rendered with (loaded once)."""
    if self._tokenizer is None:
      from hflax.models.tokenizer import load_tokenizer
      self._tokenizer = load_tokenizer(self.tokenizer_spec or "byte")
    return self._tokenizer

  def trajectory_batch(self, fields: dict, infos: list, prompts: Batch, n: int, metrics: dict,
                       *, train: bool = True, token_versions: bool = False) -> Batch:
    """trajectory_fields' rows (prompt i's n trajectories in rows i*n .. i*n + n - 1) as a
    batch on the actor's home device: segments padded and tied (_trajectories), each
    row's rollout_version its oldest model token's; token_versions keeps the per-token
    "rollout_versions" too (the asynchronous stream's, whose rows span versions)."""
    owner = np.arange(len(prompts) * n)
    if "segment_owner" in fields:
      mini = self.update_cfg.mini_batch_size if train and self.update_cfg is not None else 1
      fields, owner = segment_fields(fields, fields.pop("segment_owner"), mini)
      if not train:
        last = np.flatnonzero(fields.pop("segment_head") == np.arange(len(owner)))
        fields, owner = {k: v[last] for k, v in fields.items()}, owner[last]
      metrics["agent/segment_rows"] = float(len(owner))
    versions = np.asarray(fields["rollout_versions"])
    model = versions >= 0  # -1 off the model's tokens
    oldest = np.where(model, versions, np.iinfo(np.int32).max).min(axis=1)
    fields = {**fields, "rollout_version": np.where(model.any(axis=1), oldest,
                                                    versions.max(axis=1)).astype(np.int32)}
    if not token_versions:
      del fields["rollout_versions"]
    out = {k: jax.device_put(v, self.home) for k, v in fields.items()}
    out["group_ids"] = jax.device_put(jnp.asarray(owner // n, jnp.int32), self.home)
    objects = {k: v[owner] for k, v in prompts.repeat(n).objects.items()}
    objects["extra_info"] = np.asarray(infos, dtype=object)[owner]
    return Batch(out, objects, {"metrics": metrics})

  def old_log_probs(self, batch: Batch) -> Batch:
    """The behaviour policy's log-probs: the rollout's own, or recomputed when they differ,
    as they do for rows sampled by older weights (one-step-off, async): those rows' PPO
    ratio and rollout correction are taken against the weights about to train."""
    differ = self.recompute_log_prob or self._stale(batch)
    if differ and not self._update_reads_only_its_own(len(batch)):
      out = self.compute_log_prob(batch)
      if "routes" not in self.loss_fields:
        return out
      # Routing replay: the pass's statistics become the step's metrics, not fields.
      stats = {k: out[f"replay/{k}"] for k in ("agree", "tokens", "load")}
      return Batch({k: out[k] for k in ("old_log_probs", "entropy")},
                   meta={"metrics": routes.replay_metrics(stats)})
    return Batch({"old_log_probs": batch["rollout_log_probs"]})

  def _stale(self, batch: Batch) -> bool:
    """Whether any row was sampled by weights older than the current ones (reads the small
    version array back: the log-prob pass waits for the generation anyway)."""
    return ("rollout_version" in batch and
            int(np.min(np.asarray(batch["rollout_version"]))) < self.updates)

  def _update_reads_only_its_own(self, rows: int) -> bool:
    """Whether nothing but the update's first (FRESH) mini-batch would read recomputed
    old log-probs of `rows` rows: then the separate pass is skipped, as TRL does."""
    cfg = self.update_cfg
    return (cfg is not None and cfg.epochs == 1 and rows <= cfg.mini_batch_size
            and not self.recompute_requested and not self.old_log_probs_in_reward)

  @transfer(Protocol.DATA_PARALLEL, inputs=("input_ids", "attention_mask"), packs=packs_forward)
  def compute_log_prob(self, rows, batch):
    if self.remove_padding:
      logp, entropy = self._packed_forward(packed_log_probs_fn(self.graphdef, self.temperature),
                                           rows, batch)
      return {"old_log_probs": logp, "entropy": entropy}
    if "routes" in self.loss_fields:  # routing replay: the rollout's experts
      rows["routes"] = jax.device_put(batch["routes"], self.rows_sharding)
      fn = self.update_engine.jit_rows(routes.replay_log_probs_fn(
          self.graphdef, response_width(batch), self.temperature, self.cfg.num_experts))
      logp, entropy, stats = fn(self.params, rows)
      return {"old_log_probs": logp, "entropy": entropy,
              **{f"replay/{k}": v for k, v in stats.items()}}
    fn = self.update_engine.jit_rows(
        log_probs_fn(self.graphdef, response_width(batch), self.temperature))
    logp, entropy = fn(self.params, rows)
    return {"old_log_probs": logp, "entropy": entropy}

  def _generation_weights(self):
    """The training-layout weights generation reshards: with LoRA, the merged ones."""
    if self.trainable is None:
      return self.params
    kernels, adapters, rest = split_for_merge(self.params)
    return nnx.merge_state(rest, self._merge(kernels, adapters))

  @transfer(Protocol.DATA_PARALLEL, inputs=("input_ids", "attention_mask"), packs=packs_forward)
  def compute_ref_log_prob(self, rows, batch):
    """With LoRA, the reference policy is the base model beneath the adapters (verl's
    ref_in_actor): the log-probs of the frozen weights, with no copy of them elsewhere."""
    if self.trainable is None:
      raise ValueError("actor.compute_ref_log_prob needs LoRA adapters (model.lora_rank > 0); "
                       "without them the reference policy is a role of its own")
    if self.remove_padding:
      logp, _ = self._packed_forward(
          base_packed_log_probs_fn(self.base_graphdef, self.temperature), rows, batch)
      return {"ref_log_prob": logp}
    fn = self.update_engine.jit_rows(
        base_log_probs_fn(self.base_graphdef, response_width(batch), self.temperature))
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
                                            "old_log_probs", "advantages"), packs=packs_update)
  def update_actor(self, rows, batch):
    if self.loss_fn is None:
      raise ValueError("actor has no loss_fn; pass one (e.g. from hflax.algorithms)")
    self._reload_optimizer()
    # How many weight versions behind the rows were sampled, before this update counts.
    live = batch.meta.get(LIVE_ROWS, len(batch))  # not the rows padding it to the data width
    staleness = (staleness_histogram(batch["rollout_version"][:live], self.updates)
                 if "rollout_version" in batch else {})
    out = self._update_actor(rows, batch)
    out.meta["metrics"] = {**out.meta.get("metrics", {}), **staleness}
    return out

  def _update_actor(self, rows, batch):
    for k in self.loss_fields:  # e.g. ref_log_prob for a KL loss
      rows[k] = jax.device_put(batch[k], self.rows_sharding)
    width, temperature, graphdef, loss = response_width(batch), self.temperature, self.graphdef, self.loss_fn
    weight_fn = getattr(loss, "micro_batch_weight", None)
    # The kernels in the compute dtype, cast once per optimizer step for all its micro-batches.
    prepare = functools.partial(compute_kernels, graphdef)
    top_k = self.cfg.num_experts_per_tok if self.cfg.num_sparse_layers else 0
    if self.update_cfg.packed:
      return self._train_packed("update_actor", packed_loss(
          graphdef, loss, temperature=temperature, top_k=top_k), rows, batch, weight_fn, prepare)
    return self._train("update_actor", padded_loss(
        graphdef, loss, width=width, temperature=temperature, top_k=top_k),
        rows, batch, weight_fn, prepare)

