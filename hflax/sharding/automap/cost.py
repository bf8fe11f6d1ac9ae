"""The latency and memory simulator: one role's work in one stage, on one mesh.

Every formula is per device. Compute runs at `peak_flops * compute_efficiency`, streaming
memory traffic at `memory_bandwidth * bandwidth_efficiency`, collectives as in comm.py.
FSDP weight gathers are prefetched and partly hide behind compute (Overheads.hide);
tensor-parallel all-reduces sit on the critical path; the data-parallel gradient
all-reduce runs after each mini-batch's last backward pass.

Bytes: a model's weights, their gradients and FSDP gathers take its param_dtype's bytes;
activations, the KV cache and the actor's generation copy (cast to the compute dtype, as
the hybrid engine writes it) take its dtype's: 2 and 2 for the paper's bfloat16 models,
4 and 4 for a float32 CPU job. A trained model keeps 16 bytes/param (weights and
gradients, fp32 master copy, two fp32 Adam moments), sharded over fsdp x tensor and
replicated over data; a forward-only role (ref, reward, cost, a distillation teacher of
any size) keeps its weights alone and runs one forward pass a step. With LoRA only the
adapters have gradients and optimizer state, and the backward pass skips the base
weights' gradient matmuls: 2 forward-equivalents, not 3.

Mixture of experts: weights, gradients and optimizer state count every expert (the total
parameters), FLOPs the experts a token runs through (terms.compute_params). An expert
axis splits the routed experts' weights (replicated over it: everything else, whose
gradients therefore all-reduce over data x expert), and its devices are data parallel.
How the sparse layers move data is what XLA makes of hflax.models.moe on such a mesh,
not an all-to-all (hflax has no explicit dispatch): read from the compiled programs' HLO
on 8 simulated CPU devices (meshes data 8, fsdp 8, data 2 x expert 4, fsdp 2 x expert 4,
2 x 2 x 2; one sparse layer of 64 experts of width 512 at hidden 1024, and of 8 of width
48 at 64), see _expert_exchange. The experts never take part in FSDP's layer gathers.

Runtime modes (Workload): padded passes compute every row at the full width and waves of
generation last as long as their longest row; packed passes compute the mean length's
real tokens, and continuous batching's decode steps follow the total generated tokens
over its slots (its memory: the slots' cache beside every prompt's kept prefill cache).
"""
from __future__ import annotations

import dataclasses
import functools
import math

from hflax.models.config import ModelConfig
from hflax.rollout.waves import generation_slots, generation_waves
from hflax.sharding.automap import comm, memory
from hflax.sharding.automap.mesh import MeshShape
from hflax.sharding.automap.profile import DeviceProfile
# The shape terms and Overheads (terms.py) are also imported from here by callers.
from hflax.sharding.automap.terms import (TRAIN_BYTES_PER_PARAM, Overheads, compute_bytes,
                                          expert_params, expert_problem, forward_flops,
                                          layer_params, matmul_params, param_bytes,
                                          rows_per_shard, shape_problem, trained_params,
                                          weight_tensors)
from hflax.sharding.automap.workload import TRAINED, Workload


def memoised(method):
  """A Simulator method cached by its (hashable) arguments. Its terms are pure functions
  of them and of the Simulator's fixed workload, profile and overheads, and a search asks
  for the same role on the same mesh thousands of times (once per pool layout it scores),
  each costing ModelConfig.num_params' loop over the layers and config copies."""
  @functools.wraps(method)
  def cached(self, *args, **kwargs):
    key = (method.__name__, args, tuple(kwargs.items())) if kwargs else (method.__name__,) + args
    try:
      return self._memo[key]
    except KeyError:
      value = self._memo[key] = method(self, *args, **kwargs)
      return value
  return cached


@dataclasses.dataclass
class StageCost:
  time: float = math.inf
  transient: float = 0.0  # bytes per device held only while this call runs
  reason: str | None = None
  note: str = ""
  max_num_seqs: int = 0  # generation: the sequences per replica its KV budget holds
  exchange: float = 0.0  # bytes a device receives moving a mixture of experts' tokens


class Simulator:
  def __init__(self, workload: Workload, profile: DeviceProfile,
               overheads: Overheads | None = None):
    self.wl, self.prof = workload, profile
    self.ovh = Overheads.for_profile(profile) if overheads is None else overheads
    self.capacity = profile.memory_bytes * profile.usable_memory
    self.flops_rate = profile.peak_flops * profile.compute_efficiency
    self.hbm_rate = profile.memory_bandwidth * profile.bandwidth_efficiency
    self._memo: dict[tuple, object] = {}  # see memoised

  def share(self, mesh: MeshShape) -> float:
    """Factor on a pool's compute and memory-traffic times: 1, or on a shared host (where
    the rates are per device with all devices busy) the pool's fraction of the host, as
    any pool running alone gets all of the host's cores."""
    if not self.prof.shared_compute:
      return 1.0
    return min(1.0, mesh.size / self.prof.devices_per_node)

  @memoised
  def resident(self, role: str, mesh: MeshShape) -> float:
    cfg = self.wl.models[role]
    experts = param_bytes(cfg) * expert_params(cfg)
    if role not in TRAINED:
      return device_part(mesh, memory.weight_bytes(cfg), experts)
    frozen = memory.weight_bytes(cfg) if cfg.lora_rank else 0  # the base beneath the adapters
    # LoRA adapts attention only on a mixture of experts: its experts stay frozen.
    trained_experts = experts if cfg.lora_rank else TRAIN_BYTES_PER_PARAM * expert_params(cfg)
    return device_part(mesh, TRAIN_BYTES_PER_PARAM * trained_params(cfg) + frozen,
                      trained_experts)

  @memoised
  def mesh_problem(self, role: str, mesh: MeshShape) -> str | None:
    cfg = self.wl.models[role]
    return (shape_problem(cfg, mesh.tensor, f"{role} mesh")
            or expert_problem(cfg, mesh.expert, f"{role} mesh"))

  def _layer_comm(self, cfg, mesh, tokens, passes):
    """Per micro-batch of `tokens`: tensor-parallel all-reduces (2 per layer per pass) and
    the all-gathers of the weights over fsdp, one per weight tensor (so a pass can run
    layer by layer)."""
    tp = passes * 2 * cfg.num_layers * comm.all_reduce(
        self.prof, tokens * cfg.hidden_size * compute_bytes(cfg), mesh.tensor, mesh.tensor)
    # The experts stay split (_expert_exchange moves tokens to them, or gathers them).
    weights = param_bytes(cfg) * (cfg.num_params - expert_params(cfg)) / mesh.tensor
    gather = comm.all_gather(self.prof, weights, mesh.fsdp, mesh.model_span,
                             pieces=weight_tensors(cfg) - 3 * cfg.num_sparse_layers)
    return tp, gather

  def _gathers_experts(self, cfg, mesh, tokens) -> bool:
    """Whether XLA gathers dense dispatch's experts rather than the tokens: the expert
    matmuls' operands, the call's tokens and a stack of experts, are split over the same
    row axes (fsdp, expert) and it gathers the smaller (compared whole)."""
    return (cfg.num_sparse_layers > 0 and cfg.moe_dispatch == "dense"
            and mesh.fsdp * mesh.expert > 1
            and mesh.batch_ways * tokens > cfg.num_experts * cfg.moe_intermediate_size)

  def _expert_exchange(self, cfg, mesh, tokens, passes) -> tuple[float, float]:
    """(seconds, bytes a device receives) moving a mixture of experts' tokens or experts in
    one call of `tokens` per device, as XLA partitions hflax.models.moe (the compiled HLO,
    see the module docstring); `passes` as in _layer_comm. Per sparse layer and pass, with
    g = fsdp x expert, the row axes that also split the experts:

    dense dispatch (g > 1): tokens, when fewer than a stack's columns (_gathers_experts):
      an all-gather of the g devices' tokens (each then runs its part of the experts on all
      of them) and an all-reduce of the outputs over the g devices; the backward pass does
      the same pair for the gradients. Else the experts: an all-gather of the three stacks
      over the g devices (each runs every expert on its own rows); the backward's
      reduce-scatter of their gradients counts as one more.
    sorted dispatch, whenever the batch is split (an expert axis or not): the sort by
      expert runs over the whole batch, and every device all-reduces all of its
      num_experts_per_tok x tokens picked rows over the pool; the experts stay split.
    all-to-all dispatch on an expert axis of e > 1 (hflax.models.experts): each device
      sends the others a buffer of e x capacity rows (capacity: its tokens x k picks, or
      moe_capacity_factor x that / e) and receives the outputs back, two all-to-alls over
      the expert axis; its own experts are gathered whole over fsdp x tensor for the
      exchange (in the backward pass, their gradients reduce-scattered). Without an
      expert axis it is sorted dispatch."""
    layers, d = cfg.num_sparse_layers, cfg.hidden_size
    g, n = mesh.fsdp * mesh.expert, mesh.size
    dispatch = cfg.moe_dispatch
    if dispatch == "all_to_all" and mesh.expert == 1:
      dispatch = "sorted"
    if not layers or (dispatch == "sorted" and mesh.batch_ways == 1) or \
        (dispatch == "dense" and g == 1):
      return 0.0, 0.0
    act = compute_bytes(cfg)
    if dispatch == "all_to_all":
      e, group = mesh.expert, mesh.fsdp * mesh.tensor
      picks = tokens * cfg.num_experts_per_tok
      capacity = (min(picks, math.ceil(cfg.moe_capacity_factor * picks / e))
                  if cfg.moe_capacity_factor else picks)
      buffer = e * capacity * d * act
      own = self._expert_stacks(cfg, mesh) * mesh.tensor / e  # its experts, whole
      time = (2 * comm.all_to_all(self.prof, buffer, e, e * mesh.tensor)
              + comm.all_gather(self.prof, own, group, mesh.model_span, pieces=3))
      moved = 2 * buffer * (e - 1) / e + own * (group - 1) / group
    elif dispatch == "sorted":
      picks = mesh.batch_ways * tokens * cfg.num_experts_per_tok * d * act
      time, moved = comm.all_reduce(self.prof, picks, n, n), 2 * picks * (n - 1) / n
    elif self._gathers_experts(cfg, mesh, tokens):
      stacks = self._expert_stacks(cfg, mesh)
      time = comm.all_gather(self.prof, stacks, g, mesh.model_span, pieces=3)
      moved = stacks * (g - 1) / g
    else:
      group = g * tokens * d * act  # the group's tokens, whole on each device
      time = (comm.all_gather(self.prof, group, g, mesh.model_span)
              + comm.all_reduce(self.prof, group, g, mesh.model_span))
      moved = 3 * group * (g - 1) / g
    return passes * layers * time, passes * layers * moved

  def _expert_stacks(self, cfg, mesh) -> float:
    """Bytes of one sparse layer's three expert stacks on a device once gathered."""
    return (param_bytes(cfg) * 3 * cfg.num_experts * cfg.hidden_size
            * cfg.moe_intermediate_size / mesh.tensor)

  def _activations(self, cfg, mesh, micro_seqs, train, remat, packed_tokens=0.0):
    """One micro-batch's transient bytes per device: what hflax's compiled pass allocates
    (memory.py: each layer's saved activations, dense or blockwise attention scores, one
    chunk of fp32 logits), split over the tensor axis, plus FSDP's gathered layers in
    flight. Gradients are not here: `resident` counts them with the weights.
    packed_tokens: a packed micro-batch, one row of that many tokens holding as many
    sequences as their mean length gives, instead of micro_seqs padded rows."""
    wl, t = self.wl, mesh.tensor
    layer = layer_params(cfg)
    if cfg.num_sparse_layers:  # the experts are not gathered with the layer
      layer -= expert_params(cfg) / cfg.num_layers
    gathered = 2 * param_bytes(cfg) * layer / t if mesh.fsdp > 1 else 0.0
    rows, length, scored_rows = micro_seqs, wl.seq_len, None
    if packed_tokens:
      rows, length = 1, math.ceil(packed_tokens)
      scored_rows = math.ceil(packed_tokens / wl.packed_seq_len)
    if self._gathers_experts(cfg, mesh, packed_tokens or micro_seqs * wl.seq_len):
      gathered += 2 * self._expert_stacks(cfg, mesh)
    if not train:
      return memory.forward_bytes(cfg, rows, length, wl.response_len, wl.attention,
                                  scored_rows).transient / t + gathered
    run = cfg.replace(remat=remat)
    return (memory.activation_bytes(run, rows, length, wl.response_len, wl.attention,
                                    scored_rows) / t + 2 * gathered)

  def _micro_batches(self, sequences, train):
    """(calls, sequences per padded micro-batch, packed tokens per call or 0) for one
    device's `sequences`: micro_batch_size padded rows each, or with packing about the
    token budget of real tokens each (the last call takes the rest)."""
    wl = self.wl
    micro = min(wl.micro_batch_size, sequences)
    if not wl.packed:
      return math.ceil(sequences / micro), micro, 0.0
    tokens = sequences * wl.packed_seq_len
    row = min(wl.packed_row_tokens(train), tokens)
    return math.ceil(tokens / row), micro, row

  def pass_flops(self, cfg, sequences):
    """One forward pass over `sequences`: padded rows compute the whole width; packed rows
    the real tokens, and attention within each sequence (blockwise attention skips the
    key blocks of a row's other sequences)."""
    wl = self.wl
    if not wl.packed:
      return sequences * forward_flops(cfg, wl.seq_len)
    # A shared prompt's matmuls once per group; each response still attends to it.
    unshared = wl.mean_seq_len - wl.packed_seq_len
    return sequences * (forward_flops(cfg, wl.mean_seq_len) - 2 * matmul_params(cfg) * unshared)

  def forward(self, role: str, mesh: MeshShape, free: float) -> StageCost:
    """Log-probs, values or rewards of the whole batch: one micro-batched pass."""
    time, transient, moved = self._forward(role, mesh)
    if transient > free:
      return StageCost(reason=f"OOM: {role} forward needs {transient / 1e9:.1f} GB, "
                       f"{max(free, 0) / 1e9:.1f} GB free")
    return StageCost(time, transient, exchange=moved)

  @memoised
  def _forward(self, role: str, mesh: MeshShape) -> tuple[float, float, float]:
    """(seconds, transient bytes, expert exchange bytes) of forward, which only the free
    memory does not set."""
    cfg, wl = self.wl.models[role], self.wl
    per_device = rows_per_shard(wl.sequences, mesh.batch_ways)
    calls, micro, packed = self._micro_batches(per_device, train=False)
    transient = self._activations(cfg, mesh, micro, False, False, packed)
    compute = (mesh.batch_ways * self.pass_flops(cfg, per_device)
               / (mesh.size * self.flops_rate) * self.share(mesh))
    tp, gather = self._layer_comm(cfg, mesh, packed or micro * wl.seq_len, passes=1)
    exchange, moved = self._expert_exchange(cfg, mesh, packed or micro * wl.seq_len, 1)
    time = (self.ovh.hide(compute, calls * gather) + calls * (tp + exchange)
            + self.ovh.call_time(mesh.size))
    return time, transient, calls * moved

  def train(self, role: str, mesh: MeshShape, free: float) -> StageCost:
    """ppo_epochs passes over the batch in mini-batches, one optimizer step each; layers
    are recomputed in the backward pass (remat) only when their activations do not fit."""
    time, transient, moved = self._train(role, mesh, False)
    remat = transient > free
    if remat:
      time, transient, moved = self._train(role, mesh, True)
    if transient > free:
      return StageCost(reason=f"OOM: {role} training needs {transient / 1e9:.1f} GB, "
                       f"{max(free, 0) / 1e9:.1f} GB free")
    return StageCost(time, transient, note="remat" if remat else "", exchange=moved)

  @memoised
  def _train(self, role: str, mesh: MeshShape, remat: bool) -> tuple[float, float, float]:
    """(seconds, transient bytes, expert exchange bytes) of train with or without remat."""
    cfg, wl = self.wl.models[role], self.wl
    per_device = rows_per_shard(wl.mini_batch_sequences, mesh.batch_ways)
    calls, micro, packed = self._micro_batches(per_device, train=True)
    transient = self._activations(cfg, mesh, micro, True, remat, packed)
    steps = wl.optimizer_steps
    calls *= steps
    # forward, backward (2x: activation and weight gradients; LoRA's frozen weights need
    # no weight gradients), and the recomputed forward
    passes = (2 if cfg.lora_rank else 3) + remat
    compute = (steps * mesh.batch_ways * passes * self.pass_flops(cfg, per_device)
               / (mesh.size * self.flops_rate) * self.share(mesh))
    tp, gather = self._layer_comm(cfg, mesh, packed or micro * wl.seq_len, passes=2 + remat)
    exchange, moved = self._expert_exchange(cfg, mesh, packed or micro * wl.seq_len,
                                            2 + remat)
    fsdp = calls * gather * (2 + remat)  # gathers for forward and backward (+ recompute),
    # the reduce-scatter of gradients costing as much as one gather
    trained = trained_params(cfg)
    experts = 0 if cfg.lora_rank else expert_params(cfg)  # trained experts' parameters
    sync = steps * self._gradient_sync(param_bytes(cfg), trained, experts, mesh)
    update = (device_part(mesh, steps * 2 * TRAIN_BYTES_PER_PARAM * trained,
                         steps * 2 * TRAIN_BYTES_PER_PARAM * experts) / self.hbm_rate
              * self.share(mesh))
    time = (self.ovh.hide(compute, fsdp) + calls * (tp + exchange) + sync + update
            + self.ovh.call_time(mesh.size))
    return time, transient, calls * moved

  def _gradient_sync(self, nbytes, trained, experts, mesh) -> float:
    """The data-parallel all-reduce of one step's gradients: the experts' over the data
    axis, every other weight's over data x expert (the expert axis replicates them)."""
    if mesh.expert == 1:
      return comm.all_reduce(self.prof, nbytes * trained / mesh.shards, mesh.data, mesh.size)
    return (comm.all_reduce(self.prof, nbytes * (trained - experts) / mesh.shards,
                            mesh.data * mesh.expert, mesh.size)
            + comm.all_reduce(self.prof, nbytes * experts / mesh.expert_shards, mesh.data,
                              mesh.size))

  @memoised
  def reshard(self, mesh: MeshShape, gen_tensor: int, strided: bool = True) -> float:
    """The hybrid engine's switch from the train layout to the generate layout.

    Training splits the weights m = fsdp * tensor ways; generation splits them t_g ways.
    With the paper's strided grouping (Sec. 5.3) each t_g-group is taken inside an
    m-group so that a device's generation shard (M / t_g bytes) contains its own
    training shard (M / m): the m / t_g consecutive devices holding one generation
    shard all-gather it and each receives M / t_g - M / m = (m - t_g) / (t_g m) * M.
    That is Table 2's (tp - t_g p_g) / (t_g p_g tp) * M with no pipeline stages
    (p = p_g = 1) and the fsdp axis counted into t. Nothing moves back: the train layout
    stays the source of truth and the generate copy is dropped.

    When m spans several nodes, strided groups span them too and every decoded token
    pays inter-node all-reduces. The node-local alternative (strided=False) keeps each
    t_g-group inside a node; then almost none of a device's generation shard is local,
    and it receives the whole M / t_g from across the m-group.
    """
    cfg = self.wl.models["actor"]
    experts = compute_bytes(cfg) * expert_params(cfg)
    # Generation has no expert axis (hybrid_engine: experts split like the MLP, t_g ways):
    # the experts, trained expert x more split, are a part of their own.
    parts = [(compute_bytes(cfg) * cfg.num_params - experts, mesh.shards)]
    if experts:
      parts.append((experts, mesh.expert_shards))
    return sum(self._reshard_part(shard / gen_tensor, m, gen_tensor, strided)
               for shard, m in parts)

  def _reshard_part(self, shard, m, gen_tensor, strided) -> float:
    if not strided:
      return comm.transfer(self.prof, shard, m)
    if gen_tensor >= m:  # the generation shard is a slice of the training shard
      return 0.0
    return comm.all_gather(self.prof, shard, m // gen_tensor, m // gen_tensor)

  def generate(self, mesh: MeshShape, gen_tensor: int, free: float,
               strided: bool = True) -> StageCost:
    """Reshard, then prefill and decode every sequence on n / t_g replicas of t_g-way
    tensor parallelism. The KV cache gets the memory left free; a replica whose
    sequences do not all fit (or exceed the workload's max_num_seqs) generates them in
    waves, as the actor does when the plan's max_num_seqs caps it (rollout/waves.py), or
    with continuous batching in that many decode slots (rollout/continuous.py)."""
    problem, weights, _ = self._generation_shape(gen_tensor)
    if problem:
      return StageCost(reason=problem)
    if mesh.size % gen_tensor:
      return StageCost(reason=f"indivisible shape: t_g={gen_tensor} does not divide the "
                       f"pool's {mesh.size} devices")
    run = self._slots if self.wl.continuous_batching else self._waves
    span = mesh.shards if strided else gen_tensor  # devices one tensor group spreads over
    cost = run((mesh, gen_tensor, span), free - weights)
    if cost.reason:
      return cost
    cost.time += self.reshard(mesh, gen_tensor, strided) + self.ovh.call_time(mesh.size)
    cost.transient += weights
    cost.note = ", ".join(filter(None, ["" if strided else "node-local t_g groups", cost.note]))
    return cost

  @memoised
  def _generation_shape(self, gen_tensor: int) -> tuple[str | None, float, ModelConfig]:
    """(why t_g cannot split the actor or None, its generation weights' bytes per device,
    the model's shape on one device of a t_g group, as the sampler allocates for it)."""
    cfg = self.wl.models["actor"]
    weights = compute_bytes(cfg) * cfg.num_params / gen_tensor
    kv_heads = max(1, cfg.num_kv_heads // gen_tensor)  # fewer than t_g: replicated
    split = cfg.replace(num_heads=max(1, cfg.num_heads // gen_tensor), num_kv_heads=kv_heads)
    return shape_problem(cfg, gen_tensor, "actor generate"), weights, split

  def _oom(self, free, per_seq, what):
    return StageCost(reason=f"OOM: actor generate KV {per_seq / 1e9:.2f} GB/seq x {what}, "
                     f"{max(free, 0) / 1e9:.1f} GB free beside the weights")

  def _waves(self, layout, free) -> StageCost:
    """Waves of whole prompts, each decoded until its longest row ends."""
    wl = self.wl
    kv_seq = self._wave_sequence_bytes(layout[1])
    fits = int(max(free, 0) // kv_seq)  # sequences the KV budget holds
    if fits < wl.samples_per_prompt_most:
      return self._oom(free, kv_seq, f"{wl.samples_per_prompt_most} samples of a prompt")
    cap = min(fits, wl.max_num_seqs) if wl.max_num_seqs else fits
    mesh, gen_tensor, _ = layout
    waves, prompts = generation_waves(wl.prompts_per_step, mesh.size // gen_tensor,
                                      wl.samples_per_prompt, cap)
    batch = prompts * wl.samples_per_prompt
    time = self._wave_time(layout, waves, batch)
    return StageCost(time, batch * kv_seq, note=f"waves={waves}" if waves > 1 else "",
                     max_num_seqs=fits)

  @memoised
  def _wave_sequence_bytes(self, gen_tensor: int) -> float:
    """Per sequence, as the sampler allocates (memory.generate_bytes): the decode cache of
    the bucketed prompt plus the response, and its share of the prompt's prefill cache and
    attention; the heads split t_g ways."""
    wl, split = self.wl, self._generation_shape(gen_tensor)[2]
    if wl.kv_cache == "paged":
      return memory.kv_cache_bytes(split, 1, wl.seq_len)
    return memory.generate_bytes(split, 1, wl.prompt_len, wl.response_len,
                                 wl.samples_per_prompt, wl.attention).transient \
        / wl.samples_per_prompt

  @memoised
  def _wave_time(self, layout, waves: int, batch: int) -> float:
    """Seconds of `waves` waves of `batch` sequences on each replica."""
    wl, split = self.wl, self._generation_shape(layout[1])[2]
    step = self._decode_step(layout, split, batch, wl.prompt_len + wl.response_len / 2)
    return waves * (self._prefill(layout, batch) + wl.response_len * step)

  def _slots(self, layout, free) -> StageCost:
    """Continuous batching: a replica prefills all of its prompts, then decodes them in
    `slots` rows, a finished row's slot taking the next waiting sequence. The loop runs
    until the waiting sequences have had their slots, (rows - slots) x mean / slots steps,
    and then until the last admitted ends: counted as the longest response, as waves are."""
    wl = self.wl
    prompts, kept, per_slot = self._slot_memory(layout)
    fits = int(max(free - kept, 0) // per_slot)
    if fits < 1:
      return self._oom(free - kept, per_slot, f"1 slot beside {kept / 1e9:.2f} GB of "
                       f"{prompts} prompts' prefill cache")
    cap = min(fits, wl.max_num_seqs) if wl.max_num_seqs else fits
    mesh, gen_tensor, _ = layout
    slots = generation_slots(wl.prompts_per_step, mesh.size // gen_tensor,
                             wl.samples_per_prompt, cap)
    time, rows = self._slot_time(layout, slots)
    return StageCost(time, kept + slots * per_slot, note=f"slots={slots}" if slots < rows else "",
                     max_num_seqs=fits)

  def _slot_prompts(self, layout) -> tuple[int, int]:
    """(prompt length bucket or the paged cache's prompt length, prompts per replica)."""
    wl, (mesh, gen_tensor, _) = self.wl, layout
    P = wl.prompt_len if wl.kv_cache == "paged" else memory.length_bucket(wl.prompt_len)
    return P, -(-wl.prompts_per_step // (mesh.size // gen_tensor))

  @memoised
  def _slot_memory(self, layout) -> tuple[int, float, float]:
    """(prompts per replica, bytes of their kept prefill cache, bytes per decode slot)."""
    wl, N = self.wl, self.wl.response_len
    split = self._generation_shape(layout[1])[2]
    P, prompts = self._slot_prompts(layout)
    if wl.kv_cache == "paged":  # each sequence's blocks hold its prompt and response
      return prompts, 0.0, memory.kv_cache_bytes(split, 1, wl.seq_len)
    kept = memory.slots_generate_bytes(split, prompts, wl.prompt_len, N, 0,
                                       wl.attention).transient
    return prompts, kept, memory.kv_cache_bytes(split, 1, P + N)

  @memoised
  def _slot_time(self, layout, slots: int) -> tuple[float, int]:
    """(seconds, sequences per replica) of continuous batching in `slots` decode slots."""
    wl, mesh = self.wl, layout[0]
    split = self._generation_shape(layout[1])[2]
    n, N = wl.samples_per_prompt, wl.response_len
    P, prompts = self._slot_prompts(layout)
    rows = prompts * n
    steps = (rows - slots) * wl.mean_response_len / slots + N
    if wl.kv_cache == "paged":  # the blocks a row has filled
      context = wl.prompt_len + wl.mean_response_len / 2
    else:  # the whole cache, grown with the loop's step up to prompt + N
      context = wl.prompt_len + (steps / 2 if steps <= N else N - N * N / (2 * steps))
    # A slot taking a sequence copies its prompt's cache columns in (read and write).
    copy = 2 * rows * memory.kv_cache_bytes(split, 1, P) / self.hbm_rate
    time = (self._prefill(layout, rows) + copy * self.share(mesh)
            + steps * self._decode_step(layout, split, slots, context))
    return time, rows

  def _prefill(self, layout, batch) -> float:
    (mesh, gen_tensor, span), cfg, wl = layout, self.wl.models["actor"], self.wl
    return (batch * forward_flops(cfg, wl.prompt_len) / (gen_tensor * self.flops_rate)
            * self.share(mesh)
            + 2 * cfg.num_layers * comm.all_reduce(
                self.prof, batch * wl.prompt_len * cfg.hidden_size * compute_bytes(cfg),
                gen_tensor, span))

  def _decode_step(self, layout, split, batch, context) -> float:
    """One decode step of `batch` rows: it reads the weights and the KV cache of `context`
    tokens per row (`split`: the model's heads on one device of a t_g group) and
    all-reduces one token's activations twice per layer."""
    (mesh, gen_tensor, span), cfg = layout, self.wl.models["actor"]
    read = (compute_bytes(cfg) * cfg.num_params / gen_tensor
            + memory.kv_cache_bytes(split, batch, context))
    flops = batch * (forward_flops(cfg, 1) + 4 * cfg.num_layers * cfg.num_heads *
                     cfg.head_dim * context) / gen_tensor
    token_comm = 2 * cfg.num_layers * comm.all_reduce(
        self.prof, batch * cfg.hidden_size * compute_bytes(cfg), gen_tensor, span)
    return (max(read / self.hbm_rate, flops / self.flops_rate) * self.share(mesh) + token_comm
            + self.ovh.decode_step)


def device_part(mesh: MeshShape, nbytes: float, experts: float) -> float:
  """One device's part of `nbytes` of weights (or their gradients or optimizer state), of
  which `experts` are the routed experts', which the expert axis splits further."""
  if not experts:
    return nbytes / mesh.shards
  return (nbytes - experts) / mesh.shards + experts / mesh.expert_shards
