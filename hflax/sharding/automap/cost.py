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
replicated over data. With LoRA only the adapters have gradients and optimizer state,
and the backward pass skips the base weights' gradient matmuls: 2 forward-equivalents,
not 3.

Runtime modes (Workload): padded passes compute every row at the full width and waves of
generation last as long as their longest row; packed passes compute the mean length's
real tokens, and continuous batching's decode steps follow the total generated tokens
over its slots (its memory: the slots' cache beside every prompt's kept prefill cache).
"""
from __future__ import annotations

import dataclasses
import math

from hflax.models.config import ModelConfig
from hflax.rollout.waves import generation_slots, generation_waves
from hflax.sharding.automap import comm, memory
from hflax.sharding.automap.mesh import MeshShape
from hflax.sharding.automap.profile import DeviceProfile
from hflax.sharding.automap.workload import TRAINED, Workload

TRAIN_BYTES_PER_PARAM = 16


def param_bytes(cfg: ModelConfig) -> int:
  """Bytes of one stored weight (and of its gradient)."""
  return memory.dtype_bytes(cfg.param_dtype)


def compute_bytes(cfg: ModelConfig) -> int:
  """Bytes of one activation, KV-cache entry or generation weight."""
  return memory.dtype_bytes(cfg.dtype)


@dataclasses.dataclass(frozen=True)
class Overheads:
  """What the hardware roofline does not see. The defaults reproduce the HybridFlow
  paper's placement findings (see paper.py for the fit and its margins).

  decode_step (set, not fitted; the pattern holds from 0 to 10 ms): fixed time of one
    decode step of a generation engine (scheduling, sampling, launches, host sync).
  overlap (set, not fitted; holds from 0.7 to 0.9): fraction of the shorter of compute
    and prefetched FSDP gathers that hides behind the longer; they share HBM bandwidth
    and SMs, so not all of it.
  call_per_device (FITTED to the paper; the pattern needs 0.02 to 0.03 s): time per
    device of every role call the single controller makes: dispatching the call and
    its batch shards to each worker, collecting results, synchronising. With one worker
    per device (as in the paper's system) this grows with the pool; it is what makes a
    pool of everything lose to concurrent smaller pools at 96-128 GPUs. With it at 0,
    colocating wins every cell (see the report in paper.py).
  call: a fixed time per role call, on top (0: the fit did not need it).
  """
  decode_step: float = 0.005
  overlap: float = 0.8
  call_per_device: float = 0.02
  call: float = 0.0

  @classmethod
  def for_profile(cls, profile: DeviceProfile) -> Overheads:
    """The defaults, with the per-call cost calibrate() measured where it did."""
    if profile.call_overhead is None:
      return cls()
    return cls(call=profile.call_overhead,
               call_per_device=profile.call_overhead_per_device or 0.0)

  @classmethod
  def roofline(cls) -> Overheads:
    """No software overheads at all: hardware limits only, perfect overlap."""
    return cls(decode_step=0.0, overlap=1.0, call_per_device=0.0, call=0.0)

  def call_time(self, devices: int) -> float:
    return self.call + self.call_per_device * devices

  def hide(self, compute: float, comm_time: float) -> float:
    return max(compute, comm_time) + (1.0 - self.overlap) * min(compute, comm_time)


def forward_flops(cfg: ModelConfig, length: int) -> float:
  """FLOPs of one causal forward pass over `length` tokens (the embedding lookup is free)."""
  attention = 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * length * length
  return 2 * matmul_params(cfg) * length + attention


def matmul_params(cfg: ModelConfig) -> int:
  return cfg.num_params - cfg.vocab_size * cfg.hidden_size


def rows_per_shard(rows: int, ways: int) -> int:
  """Rows each of `ways` data shards computes: the runtime pads a batch that `ways` does
  not divide (controller/protocol.py), so the last shards compute repeated rows."""
  return -(-rows // ways)


def weight_tensors(cfg: ModelConfig) -> int:
  """How many separate weight arrays the model has: FSDP gathers each one on its own
  (a collective apiece), so small models on slow-latency links pay per tensor."""
  per_layer = 7 + 2 + (3 if cfg.qkv_bias else 0) + (2 if cfg.qk_norm else 0)
  return cfg.num_layers * per_layer + 2 + (0 if cfg.tie_word_embeddings else 1)


def trained_params(cfg: ModelConfig) -> int:
  """What has gradients and optimizer state: the LoRA adapters, else every parameter."""
  return cfg.num_lora_params if cfg.lora_rank else cfg.num_params


def layer_params(cfg: ModelConfig) -> float:
  return (cfg.num_params - 2 * cfg.vocab_size * cfg.hidden_size) / cfg.num_layers


def shape_problem(cfg: ModelConfig, tensor: int, what: str) -> str | None:
  """Why `tensor` cannot split this model's heads and matrices, or None."""
  kv = cfg.num_kv_heads
  if cfg.num_heads % tensor:
    return f"indivisible shape: {what} tensor={tensor} does not divide num_heads={cfg.num_heads}"
  if kv % tensor and tensor % kv:
    return f"indivisible shape: {what} tensor={tensor} vs num_kv_heads={kv}"
  for name in ("intermediate_size", "vocab_size"):
    if getattr(cfg, name) % tensor:
      return f"indivisible shape: {what} tensor={tensor} does not divide {name}"
  return None


@dataclasses.dataclass
class StageCost:
  time: float = math.inf
  transient: float = 0.0  # bytes per device held only while this call runs
  reason: str | None = None
  note: str = ""
  max_num_seqs: int = 0  # generation: the sequences per replica its KV budget holds


class Simulator:
  def __init__(self, workload: Workload, profile: DeviceProfile,
               overheads: Overheads | None = None):
    self.wl, self.prof = workload, profile
    self.ovh = Overheads.for_profile(profile) if overheads is None else overheads
    self.capacity = profile.memory_bytes * profile.usable_memory
    self.flops_rate = profile.peak_flops * profile.compute_efficiency
    self.hbm_rate = profile.memory_bandwidth * profile.bandwidth_efficiency

  def share(self, mesh: MeshShape) -> float:
    """Factor on a pool's compute and memory-traffic times: 1, or on a shared host (where
    the rates are per device with all devices busy) the pool's fraction of the host, as
    any pool running alone gets all of the host's cores."""
    if not self.prof.shared_compute:
      return 1.0
    return min(1.0, mesh.size / self.prof.devices_per_node)

  def resident(self, role: str, mesh: MeshShape) -> float:
    cfg = self.wl.models[role]
    if role not in TRAINED:
      return memory.weight_bytes(cfg) / mesh.shards
    frozen = memory.weight_bytes(cfg) if cfg.lora_rank else 0  # the base beneath the adapters
    return (TRAIN_BYTES_PER_PARAM * trained_params(cfg) + frozen) / mesh.shards

  def mesh_problem(self, role: str, mesh: MeshShape) -> str | None:
    wl = self.wl
    problem = shape_problem(wl.models[role], mesh.tensor, f"{role} mesh")
    if problem:
      return problem
    return None

  def _layer_comm(self, cfg, mesh, tokens, passes):
    """Per micro-batch of `tokens`: tensor-parallel all-reduces (2 per layer per pass) and
    the all-gathers of the weights over fsdp, one per weight tensor (so a pass can run
    layer by layer)."""
    tp = passes * 2 * cfg.num_layers * comm.all_reduce(
        self.prof, tokens * cfg.hidden_size * compute_bytes(cfg), mesh.tensor, mesh.tensor)
    gather = comm.all_gather(self.prof, param_bytes(cfg) * cfg.num_params / mesh.tensor,
                             mesh.fsdp, mesh.shards, pieces=weight_tensors(cfg))
    return tp, gather

  def _activations(self, cfg, mesh, micro_seqs, train, remat, packed_tokens=0.0):
    """One micro-batch's transient bytes per device: what hflax's compiled pass allocates
    (memory.py: each layer's saved activations, dense or blockwise attention scores, one
    chunk of fp32 logits), split over the tensor axis, plus FSDP's gathered layers in
    flight. Gradients are not here: `resident` counts them with the weights.
    packed_tokens: a packed micro-batch, one row of that many tokens holding as many
    sequences as their mean length gives, instead of micro_seqs padded rows."""
    wl, t = self.wl, mesh.tensor
    gathered = 2 * param_bytes(cfg) * layer_params(cfg) / t if mesh.fsdp > 1 else 0.0
    rows, length, scored_rows = micro_seqs, wl.seq_len, None
    if packed_tokens:
      rows, length = 1, math.ceil(packed_tokens)
      scored_rows = math.ceil(packed_tokens / wl.packed_seq_len)
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
    cfg, wl = self.wl.models[role], self.wl
    per_device = rows_per_shard(wl.sequences, mesh.batch_ways)
    calls, micro, packed = self._micro_batches(per_device, train=False)
    transient = self._activations(cfg, mesh, micro, False, False, packed)
    if transient > free:
      return StageCost(reason=f"OOM: {role} forward needs {transient / 1e9:.1f} GB, "
                       f"{max(free, 0) / 1e9:.1f} GB free")
    compute = (mesh.batch_ways * self.pass_flops(cfg, per_device)
               / (mesh.size * self.flops_rate) * self.share(mesh))
    tp, gather = self._layer_comm(cfg, mesh, packed or micro * wl.seq_len, passes=1)
    time = (self.ovh.hide(compute, calls * gather) + calls * tp
            + self.ovh.call_time(mesh.size))
    return StageCost(time, transient)

  def train(self, role: str, mesh: MeshShape, free: float) -> StageCost:
    """ppo_epochs passes over the batch in mini-batches, one optimizer step each; layers
    are recomputed in the backward pass (remat) only when their activations do not fit."""
    cfg, wl = self.wl.models[role], self.wl
    per_device = rows_per_shard(wl.mini_batch_sequences, mesh.batch_ways)
    calls, micro, packed = self._micro_batches(per_device, train=True)
    remat = self._activations(cfg, mesh, micro, True, False, packed) > free
    transient = self._activations(cfg, mesh, micro, True, remat, packed)
    if transient > free:
      return StageCost(reason=f"OOM: {role} training needs {transient / 1e9:.1f} GB, "
                       f"{max(free, 0) / 1e9:.1f} GB free")
    steps = wl.optimizer_steps
    calls *= steps
    # forward, backward (2x: activation and weight gradients; LoRA's frozen weights need
    # no weight gradients), and the recomputed forward
    passes = (2 if cfg.lora_rank else 3) + remat
    compute = (steps * mesh.batch_ways * passes * self.pass_flops(cfg, per_device)
               / (mesh.size * self.flops_rate) * self.share(mesh))
    tp, gather = self._layer_comm(cfg, mesh, packed or micro * wl.seq_len, passes=2 + remat)
    fsdp = calls * gather * (2 + remat)  # gathers for forward and backward (+ recompute),
    # the reduce-scatter of gradients costing as much as one gather
    trained = trained_params(cfg)
    grads = param_bytes(cfg) * trained / mesh.shards
    sync = steps * comm.all_reduce(self.prof, grads, mesh.data, mesh.size)
    update = (steps * 2 * TRAIN_BYTES_PER_PARAM * trained / mesh.shards / self.hbm_rate
              * self.share(mesh))
    time = (self.ovh.hide(compute, fsdp) + calls * tp + sync + update
            + self.ovh.call_time(mesh.size))
    return StageCost(time, transient, note="remat" if remat else "")

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
    cfg, m = self.wl.models["actor"], mesh.shards
    shard = compute_bytes(cfg) * cfg.num_params / gen_tensor
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
    cfg, wl = self.wl.models["actor"], self.wl
    problem = shape_problem(cfg, gen_tensor, "actor generate")
    if problem:
      return StageCost(reason=problem)
    if mesh.size % gen_tensor:
      return StageCost(reason=f"indivisible shape: t_g={gen_tensor} does not divide the "
                       f"pool's {mesh.size} devices")
    weights = compute_bytes(cfg) * cfg.num_params / gen_tensor
    kv_heads = max(1, cfg.num_kv_heads // gen_tensor)  # fewer than t_g: replicated
    # The model's shape on one device of a t_g group, as the sampler allocates for it.
    split = cfg.replace(num_heads=max(1, cfg.num_heads // gen_tensor), num_kv_heads=kv_heads)
    run = self._slots if wl.continuous_batching else self._waves
    span = mesh.shards if strided else gen_tensor  # devices one tensor group spreads over
    cost = run((mesh, gen_tensor, span), free - weights, split)
    if cost.reason:
      return cost
    cost.time += self.reshard(mesh, gen_tensor, strided) + self.ovh.call_time(mesh.size)
    cost.transient += weights
    cost.note = ", ".join(filter(None, ["" if strided else "node-local t_g groups", cost.note]))
    return cost

  def _oom(self, free, per_seq, what):
    return StageCost(reason=f"OOM: actor generate KV {per_seq / 1e9:.2f} GB/seq x {what}, "
                     f"{max(free, 0) / 1e9:.1f} GB free beside the weights")

  def _waves(self, layout, free, split) -> StageCost:
    """Waves of whole prompts, each decoded until its longest row ends."""
    wl, (mesh, gen_tensor, _) = self.wl, layout
    n = wl.samples_per_prompt
    # Per sequence, as the sampler allocates (memory.generate_bytes): the decode cache of
    # the bucketed prompt plus the response, and its share of the prompt's prefill cache
    # and attention; the heads split t_g ways.
    if wl.kv_cache == "paged":
      kv_seq = memory.kv_cache_bytes(split, 1, wl.seq_len)
    else:
      kv_seq = memory.generate_bytes(split, 1, wl.prompt_len, wl.response_len, n,
                                     wl.attention).transient / n
    fits = int(max(free, 0) // kv_seq)  # sequences the KV budget holds
    if fits < wl.samples_per_prompt_most:
      return self._oom(free, kv_seq, f"{wl.samples_per_prompt_most} samples of a prompt")
    cap = min(fits, wl.max_num_seqs) if wl.max_num_seqs else fits
    waves, prompts = generation_waves(wl.prompts_per_step, mesh.size // gen_tensor, n, cap)
    batch = prompts * n
    step = self._decode_step(layout, split, batch, wl.prompt_len + wl.response_len / 2)
    time = waves * (self._prefill(layout, batch) + wl.response_len * step)
    return StageCost(time, batch * kv_seq, note=f"waves={waves}" if waves > 1 else "",
                     max_num_seqs=fits)

  def _slots(self, layout, free, split) -> StageCost:
    """Continuous batching: a replica prefills all of its prompts, then decodes them in
    `slots` rows, a finished row's slot taking the next waiting sequence. The loop runs
    until the waiting sequences have had their slots, (rows - slots) x mean / slots steps,
    and then until the last admitted ends: counted as the longest response, as waves are."""
    wl, (mesh, gen_tensor, _) = self.wl, layout
    n, N = wl.samples_per_prompt, wl.response_len
    prompts = -(-wl.prompts_per_step // (mesh.size // gen_tensor))  # per replica
    rows = prompts * n
    P = memory.length_bucket(wl.prompt_len)
    if wl.kv_cache == "paged":  # each sequence's blocks hold its prompt and response
      P, kept, per_slot = wl.prompt_len, 0.0, memory.kv_cache_bytes(split, 1, wl.seq_len)
    else:
      kept = memory.slots_generate_bytes(split, prompts, wl.prompt_len, N, 0,
                                         wl.attention).transient
      per_slot = memory.kv_cache_bytes(split, 1, P + N)
    fits = int(max(free - kept, 0) // per_slot)
    if fits < 1:
      return self._oom(free - kept, per_slot, f"1 slot beside {kept / 1e9:.2f} GB of "
                       f"{prompts} prompts' prefill cache")
    cap = min(fits, wl.max_num_seqs) if wl.max_num_seqs else fits
    slots = generation_slots(wl.prompts_per_step, mesh.size // gen_tensor, n, cap)
    steps = (rows - slots) * wl.mean_response_len / slots + N
    if wl.kv_cache == "paged":  # the blocks a row has filled
      context = wl.prompt_len + wl.mean_response_len / 2
    else:  # the whole cache, grown with the loop's step up to prompt + N
      context = wl.prompt_len + (steps / 2 if steps <= N else N - N * N / (2 * steps))
    # A slot taking a sequence copies its prompt's cache columns in (read and write).
    copy = 2 * rows * memory.kv_cache_bytes(split, 1, P) / self.hbm_rate
    time = (self._prefill(layout, rows) + copy * self.share(mesh)
            + steps * self._decode_step(layout, split, slots, context))
    return StageCost(time, kept + slots * per_slot, note=f"slots={slots}" if slots < rows else "",
                     max_num_seqs=fits)

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
