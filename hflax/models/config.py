"""Decoder LM configuration, shared by Llama (2/3), Qwen2/2.5, Qwen3, Qwen3-MoE and Qwen2-MoE."""
from __future__ import annotations

import dataclasses
from typing import Any

# The mesh axes that split a batch's rows: the model pins its activations to them between
# layers (transformer.rows_split); hflax.sharding lays the weights out around them. The
# expert axis (expert parallelism) is data parallel outside the experts.
ROW_AXES = ("data", "fsdp", "expert")

# HF architecture name -> the family switches it implies.
_FAMILIES = {"Llama": dict(family="llama"), "Qwen2": dict(family="qwen2", qkv_bias=True),
             "Qwen3": dict(family="qwen3", qk_norm=True),
             "Qwen3Moe": dict(family="qwen3_moe", qk_norm=True),
             "Qwen2Moe": dict(family="qwen2_moe", qkv_bias=True)}
# The families whose sparse layers route tokens to experts (hflax.models.moe).
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe")
ARCHITECTURES = {prefix + head: switches for prefix, switches in _FAMILIES.items()
                 for head in ("ForCausalLM", "ForTokenClassification", "ForSequenceClassification")}
# hflax.models.attention.IMPLEMENTATIONS ("cudnn", "splash": the GPU and TPU kernels),
# kept here so that the config does not import jax.
ATTENTION_IMPLEMENTATIONS = ("auto", "reference", "blockwise", "cudnn", "splash")
# How a mixture of experts' sparse layer computes its experts (hflax.models.moe).
MOE_DISPATCHES = ("dense", "sorted", "all_to_all")
ROPE_TYPES = ("default", "linear", "llama3", "yarn")
# The linear layers LoRA can adapt, by their HF module names (PEFT's "all-linear" is all
# of them: the output layer is never adapted).
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# A mixture of experts' router (HF's mlp.gate): LoRA adapts it only where named, never as
# part of "all-linear".
LORA_ROUTER = "gate"
# Qwen2-MoE's shared expert gate ([hidden, 1], an nn.Linear that PEFT's "all-linear"
# adapts): part of "all-linear" on a model that has one (hflax.models.lora.lora_config).
LORA_SHARED_GATE = "shared_expert_gate"


def lora_target_problem(targets, model: "ModelConfig | None") -> str | None:
  """What makes `targets` unfit as LoRA targets of `model` (None: hflax's built-in dense
  model), or None: one check for ModelConfig and for the launcher, which reads a config's
  target_modules before any model is built."""
  named = LORA_TARGETS + (LORA_ROUTER, LORA_SHARED_GATE)
  unknown = [t for t in targets if t not in named]
  if unknown:
    return f"{unknown} are not among {named}"
  which = f"this {model.family} model" if model else "the built-in model"
  if LORA_ROUTER in targets and not (model and model.num_experts):
    return f"{LORA_ROUTER!r} names a mixture of experts' router; {which} has none"
  if LORA_SHARED_GATE in targets and not (model and model.shared_expert_intermediate_size):
    return (f"{LORA_SHARED_GATE!r} names Qwen2-MoE's shared expert gate; {which} has no "
            "shared expert")
  return None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int
  hidden_size: int
  intermediate_size: int
  num_layers: int
  num_heads: int
  num_kv_heads: int
  head_dim: int | None = None
  family: str = "llama"
  rope_theta: float = 10000.0
  # Hashable form of HF's rope_scaling dict: tuple of (key, value) pairs.
  rope_scaling: tuple[tuple[str, Any], ...] | None = None
  max_position_embeddings: int = 4096
  rms_norm_eps: float = 1e-6
  tie_word_embeddings: bool = False
  qkv_bias: bool = False
  o_bias: bool = False
  mlp_bias: bool = False
  qk_norm: bool = False
  bos_token_id: int | None = None
  eos_token_id: int | tuple[int, ...] | None = None
  pad_token_id: int | None = None
  # "float32" or "bfloat16": what matmuls run in; parameters keep their own dtype.
  dtype: str = "float32"
  param_dtype: str = "float32"
  # Recompute each layer's activations in the backward pass instead of storing them.
  remat: bool = False
  # LoRA: rank-`lora_rank` adapters (0: none) on the linear layers named in lora_targets
  # (HF module names, see LORA_TARGETS), each adding (lora_alpha / lora_rank) x A B to
  # its kernel, as PEFT does. Adapters are trained; the rest stays frozen.
  lora_rank: int = 0
  lora_alpha: float = 16.0
  lora_targets: tuple[str, ...] = ()
  # Whether gate_proj / up_proj / down_proj in lora_targets adapt a mixture of experts'
  # routed experts too (one pair an expert), or only the dense and shared-expert MLPs: a
  # PEFT adapter made where transformers 5's fused experts are parameters, not nn.Linear
  # modules, leaves them out (hflax.models.lora.adapter_adapts_experts).
  lora_experts: bool = True
  # How attention is computed (hflax.models.attention.IMPLEMENTATIONS): "auto" picks per
  # backend and shape; the others force one.
  attention: str = "auto"
  # Mixture of experts (families in MOE_FAMILIES, HF's names): a sparse layer routes each
  # token to num_experts_per_tok of num_experts SwiGLU experts of width moe_intermediate_size
  # (hflax.models.moe); layers in mlp_only_layers, or whose index + 1 is not a multiple of
  # decoder_sparse_step, keep a dense MLP of width intermediate_size.
  num_experts: int = 0
  num_experts_per_tok: int = 0
  moe_intermediate_size: int = 0
  norm_topk_prob: bool = False
  decoder_sparse_step: int = 1
  mlp_only_layers: tuple[int, ...] = ()
  router_aux_loss_coef: float = 0.0
  # Qwen2-MoE: every token also runs through a shared SwiGLU expert of this width (0: none),
  # scaled by a sigmoid gate of its own, and added to the routed experts' sum.
  shared_expert_intermediate_size: int = 0
  # How a sparse layer computes its experts (MOE_DISPATCHES, hflax.models.experts): "dense"
  # runs every expert on every token; "sorted" groups tokens by expert for a grouped
  # matmul; "all_to_all" sends each pick to its expert's device over the mesh's expert
  # axis and back (expert parallelism). Equal results (all_to_all with capacity factor 0).
  moe_dispatch: str = "dense"
  # all_to_all: rows a device sends each other, as a multiple of its picks / expert-axis
  # size (0: all its picks, so none is dropped; c > 0: picks past c x the balanced share
  # of an expert device are dropped).
  moe_capacity_factor: float = 0.0

  def __post_init__(self):
    if self.head_dim is None:
      object.__setattr__(self, "head_dim", self.hidden_size // self.num_heads)
    if self.num_heads % self.num_kv_heads:
      raise ValueError(
          f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
    if self.family not in {v["family"] for v in ARCHITECTURES.values()}:
      raise ValueError(f"unknown model family {self.family!r}")
    rope_type = self.rope_scaling_dict.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
      raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: {ROPE_TYPES}")
    if self.attention not in ATTENTION_IMPLEMENTATIONS:
      raise ValueError(f"attention={self.attention!r} is not one of {ATTENTION_IMPLEMENTATIONS}")
    if self.moe_dispatch not in MOE_DISPATCHES:
      raise ValueError(f"moe_dispatch={self.moe_dispatch!r} is not one of {MOE_DISPATCHES}")
    if not self.moe_capacity_factor >= 0:
      raise ValueError(f"moe_capacity_factor={self.moe_capacity_factor!r} must be >= 0 "
                       "(0: no pick dropped)")
    problem = lora_target_problem(self.lora_targets, self)
    if problem:
      raise ValueError(f"lora_targets {problem}")
    if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                 and self.moe_intermediate_size > 0
                                 and self.decoder_sparse_step > 0):
      raise ValueError(f"num_experts={self.num_experts} needs 0 < num_experts_per_tok "
                       f"({self.num_experts_per_tok}) <= num_experts, moe_intermediate_size "
                       f"({self.moe_intermediate_size}) > 0 and decoder_sparse_step "
                       f"({self.decoder_sparse_step}) > 0")
    if self.shared_expert_intermediate_size < 0 or (self.shared_expert_intermediate_size
                                                    and not self.num_experts):
      raise ValueError(f"shared_expert_intermediate_size={self.shared_expert_intermediate_size}"
                       " needs num_experts > 0 (a shared expert sits beside routed ones)")
    if self.lora_rank < 0 or (self.lora_rank > 0) != bool(self.lora_targets):
      raise ValueError(f"lora_rank={self.lora_rank} with lora_targets={self.lora_targets}: a "
                       "positive rank needs targets, and targets need a positive rank")

  @property
  def lora_scale(self) -> float:
    return self.lora_alpha / self.lora_rank if self.lora_rank else 0.0

  @property
  def rope_scaling_dict(self) -> dict[str, Any]:
    return dict(self.rope_scaling or ())

  def sparse_layer(self, layer: int) -> bool:
    """Whether layer `layer` is a mixture of experts (HF's rule for Qwen3-MoE)."""
    return (self.num_experts > 0 and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0)

  @property
  def num_sparse_layers(self) -> int:
    return sum(self.sparse_layer(i) for i in range(self.num_layers))

  @property
  def num_params(self) -> int:
    """Parameter count (what the auto-mapper and FLOP counts use): every expert counted."""
    return self._count_params(self.num_experts)

  @property
  def num_active_params(self) -> int:
    """Parameters one token runs through: num_experts_per_tok experts in a sparse layer
    (the router's full width counted), the same as num_params for a dense model."""
    return self._count_params(self.num_experts_per_tok)

  def _count_params(self, experts: int) -> int:
    d, h, kv, hd, f = (self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim,
                       self.intermediate_size)
    attn = d * h * hd * 2 + d * kv * hd * 2
    attn += (h + 2 * kv) * hd * self.qkv_bias + d * self.o_bias + 2 * hd * self.qk_norm
    mlp = 3 * d * f + (2 * f + d) * self.mlp_bias
    sparse = self.num_sparse_layers
    moe = d * self.num_experts + experts * 3 * d * self.moe_intermediate_size
    shared = self.shared_expert_intermediate_size
    moe += 3 * d * shared + d if shared else 0  # the shared expert and its [d, 1] gate
    per_layer = attn + 2 * d
    head = 0 if self.tie_word_embeddings else self.vocab_size * d
    return (self.vocab_size * d + self.num_layers * per_layer + (self.num_layers - sparse) * mlp
            + sparse * moe + d + head)

  @property
  def num_lora_params(self) -> int:
    """Parameters of the LoRA adapters: rank x (in + out) per adapted layer; in a sparse
    layer one pair an expert, and the shared expert's like a dense MLP's."""
    d, h, kv, hd = self.hidden_size, self.num_heads, self.num_kv_heads, self.head_dim
    attn = {"q_proj": d + h * hd, "k_proj": d + kv * hd, "v_proj": d + kv * hd,
            "o_proj": h * hd + d}
    sparse, shared = self.num_sparse_layers, self.shared_expert_intermediate_size
    # One MLP projection's in + out, summed over every layer's MLPs (experts included).
    mlp = ((self.num_layers - sparse) * (d + self.intermediate_size)
           + sparse * (self.num_experts * (d + self.moe_intermediate_size) * self.lora_experts
                       + (d + shared if shared else 0)))
    gates = {LORA_ROUTER: sparse * (d + self.num_experts),
             LORA_SHARED_GATE: sparse * (d + 1) if shared else 0}
    return self.lora_rank * sum(self.num_layers * attn[t] if t in attn else
                                gates[t] if t in gates else mlp for t in self.lora_targets)

  def replace(self, **kw) -> "ModelConfig":
    return dataclasses.replace(self, **kw)

  @classmethod
  def from_hf(cls, hf: dict[str, Any], source: str = "config.json") -> "ModelConfig":
    archs = hf.get("architectures") or []
    known = [a for a in archs if a in ARCHITECTURES]
    if not known:
      model_type = hf.get("model_type")
      by_type = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 "qwen2_moe": "Qwen2MoeForCausalLM"}
      if model_type not in by_type:
        raise ValueError(
            f"{source}: unsupported architecture {archs or model_type!r}; hflax supports "
            f"{sorted(ARCHITECTURES)}")
      known = [by_type[model_type]]
    switches = dict(ARCHITECTURES[known[0]])
    # transformers 5 keeps rope_theta inside rope_parameters; older files keep it top level.
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope_theta = rope.pop("rope_theta", hf.get("rope_theta", 10000.0))
    if "type" in rope:
      rope.setdefault("rope_type", rope.pop("type"))
    if rope.get("rope_type", "default") == "default":
      rope = {}
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads",
                "intermediate_size", "vocab_size"):
      if key not in hf:
        raise ValueError(f"{source}: missing required field {key!r}")
    # Options the model does not implement: refuse them rather than run a different model.
    act = hf.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
      raise ValueError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
    if hf.get("use_sliding_window"):
      raise ValueError(f"{source}: use_sliding_window=true is not supported (hflax attends "
                       "over the full context)")
    family = switches.pop("family")
    if family == "llama":
      switches["qkv_bias"] = switches["o_bias"] = bool(hf.get("attention_bias", False))
      switches["mlp_bias"] = bool(hf.get("mlp_bias", False))
    elif family in ("qwen3", "qwen3_moe"):
      switches["qkv_bias"] = switches["o_bias"] = bool(hf.get("attention_bias", False))
    elif family == "qwen2_moe":  # transformers 5 names the q/k/v bias switch qkv_bias
      switches["qkv_bias"] = bool(hf.get("qkv_bias", True))
    if family in MOE_FAMILIES:
      switches.update(_moe_fields(hf, source))
    eos = hf.get("eos_token_id")
    return cls(
        family=family,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=hf["num_attention_heads"],
        num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
        head_dim=hf.get("head_dim"),
        rope_theta=float(rope_theta),
        rope_scaling=tuple(sorted(rope.items())) or None,
        max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        bos_token_id=hf.get("bos_token_id"),
        eos_token_id=tuple(eos) if isinstance(eos, list) else eos,
        pad_token_id=hf.get("pad_token_id"),
        **switches,
    )

  def to_hf(self) -> dict[str, Any]:
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
            "qwen2_moe": "Qwen2MoeForCausalLM"}[self.family]
    out = dict(
        architectures=[arch],
        model_type=self.family,
        vocab_size=self.vocab_size,
        hidden_size=self.hidden_size,
        intermediate_size=self.intermediate_size,
        num_hidden_layers=self.num_layers,
        num_attention_heads=self.num_heads,
        num_key_value_heads=self.num_kv_heads,
        head_dim=self.head_dim,
        hidden_act="silu",
        rope_theta=self.rope_theta,
        rope_scaling=self.rope_scaling_dict or None,
        max_position_embeddings=self.max_position_embeddings,
        rms_norm_eps=self.rms_norm_eps,
        tie_word_embeddings=self.tie_word_embeddings,
        bos_token_id=self.bos_token_id,
        eos_token_id=list(self.eos_token_id) if isinstance(self.eos_token_id, tuple)
        else self.eos_token_id,
        pad_token_id=self.pad_token_id,
        torch_dtype=self.param_dtype,
    )
    if self.family in ("llama", "qwen3", "qwen3_moe"):
      if self.qkv_bias != self.o_bias:
        raise ValueError(f"{arch} cannot express qkv_bias={self.qkv_bias} with o_bias={self.o_bias}")
      out["attention_bias"] = self.qkv_bias
    if self.family == "llama":
      out["mlp_bias"] = self.mlp_bias
    elif self.mlp_bias:
      raise ValueError(f"{arch} has no mlp_bias")
    if self.family == "qwen2":
      out["use_sliding_window"] = False
    if self.family == "qwen2_moe":
      if self.o_bias:
        raise ValueError(f"{arch} has no o_proj bias")
      out.update(qkv_bias=self.qkv_bias,
                 shared_expert_intermediate_size=self.shared_expert_intermediate_size)
    if self.family in MOE_FAMILIES:
      out.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                 moe_intermediate_size=self.moe_intermediate_size,
                 norm_topk_prob=self.norm_topk_prob,
                 decoder_sparse_step=self.decoder_sparse_step,
                 mlp_only_layers=list(self.mlp_only_layers),
                 router_aux_loss_coef=self.router_aux_loss_coef, use_sliding_window=False)
    return out


def _moe_fields(hf: dict[str, Any], source: str) -> dict[str, Any]:
  """ModelConfig's mixture-of-experts fields from a Qwen3-MoE or Qwen2-MoE config.json
  (transformers 5 writes num_experts as num_local_experts)."""
  experts = hf.get("num_experts", hf.get("num_local_experts"))
  for key, value in (("num_experts", experts),
                     ("num_experts_per_tok", hf.get("num_experts_per_tok")),
                     ("moe_intermediate_size", hf.get("moe_intermediate_size"))):
    if value is None:
      raise ValueError(f"{source}: missing required field {key!r}")
  return dict(num_experts=int(experts), num_experts_per_tok=int(hf["num_experts_per_tok"]),
              moe_intermediate_size=int(hf["moe_intermediate_size"]),
              norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
              decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
              mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
              router_aux_loss_coef=float(hf.get("router_aux_loss_coef", 0.0)),
              shared_expert_intermediate_size=int(hf.get("shared_expert_intermediate_size")
                                                  or 0))
