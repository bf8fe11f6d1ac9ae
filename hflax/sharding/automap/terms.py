"""The cost model's terms that a model's shape alone sets (FLOPs, parameters, bytes per
value, which tensor widths divide it) and the software overheads the hardware roofline
does not see. cost.Simulator combines them per role, stage and mesh."""
from __future__ import annotations

import dataclasses

from hflax.models.config import ModelConfig
from hflax.sharding.automap import memory
from hflax.sharding.automap.profile import DeviceProfile

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
  return compute_params(cfg) - cfg.vocab_size * cfg.hidden_size


def compute_params(cfg: ModelConfig) -> int:
  """Parameters each token's matmuls run through. A mixture of experts with sorted or
  all-to-all dispatch runs a token through its num_experts_per_tok experts only (the
  active parameters); dense dispatch (hflax.models.experts.dense_experts) runs every
  expert on every token and zeroes the others' outputs, so it pays for all of them (the
  total)."""
  if cfg.num_experts and cfg.moe_dispatch in ("sorted", "all_to_all"):
    return cfg.num_active_params
  return cfg.num_params


def expert_params(cfg: ModelConfig) -> int:
  """The routed experts' weights (gate, up, down stacks of every sparse layer): what an
  expert mesh axis splits; every other weight is replicated over it. 0 for a dense model."""
  return (cfg.num_sparse_layers * cfg.num_experts * 3 * cfg.hidden_size
          * cfg.moe_intermediate_size)


def rows_per_shard(rows: int, ways: int) -> int:
  """Rows each of `ways` data shards computes: the runtime pads a batch that `ways` does
  not divide (controller/protocol.py), so the last shards compute repeated rows."""
  return -(-rows // ways)


def weight_tensors(cfg: ModelConfig) -> int:
  """How many separate weight arrays the model has: FSDP gathers each one on its own
  (a collective apiece), so small models on slow-latency links pay per tensor."""
  per_layer = 7 + 2 + (3 if cfg.qkv_bias else 0) + (2 if cfg.qk_norm else 0)
  router = cfg.num_sparse_layers  # a sparse layer's router beside its 3 expert stacks
  return cfg.num_layers * per_layer + router + 2 + (0 if cfg.tie_word_embeddings else 1)


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
  for name in ("intermediate_size", "vocab_size") + (
      ("moe_intermediate_size",) if cfg.num_experts else ()):
    if getattr(cfg, name) % tensor:
      return f"indivisible shape: {what} tensor={tensor} does not divide {name}"
  return None


def expert_problem(cfg: ModelConfig, expert: int, what: str) -> str | None:
  """Why an expert axis of `expert` devices cannot split this model's experts, or None."""
  if expert == 1:
    return None
  if not cfg.num_sparse_layers:
    return f"{what} expert={expert}: the model has no experts to split"
  if cfg.num_experts % expert:
    return (f"indivisible shape: {what} expert={expert} does not divide "
            f"num_experts={cfg.num_experts}")
  return None
