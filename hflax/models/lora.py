"""LoRA on a policy: adapters added to a loaded model, the merged weights that generation
and export use, the base model beneath the adapters (the reference policy, for free), and
PEFT's adapter format.

Adapters are `nnx.LoRAParam`s (a subclass of `nnx.Param`): lora_a and lora_b on the
targeted `Dense` layers, and on a mixture of experts' stacks (hflax.models.moe) one pair
an expert, stacked as <proj>_lora_a [E, in, r] and <proj>_lora_b [E, r, out] beside the
stack <proj>; everything here tells them apart by that type.
"""
from __future__ import annotations

import json
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from hflax.models.config import LORA_ROUTER, LORA_SHARED_GATE, LORA_TARGETS, ModelConfig
from hflax.models.peft_experts import (check_fusable, fused_targets, fused_tensors,
                                       gate_up_rank, read_fused, read_json)
from hflax.models.transformer import DecoderLM, create_abstract, model_rngs


_NAMED = LORA_TARGETS + (LORA_ROUTER, LORA_SHARED_GATE)


def lora_targets(spec) -> tuple[str, ...]:
  """"all-linear" (PEFT's: every linear layer but the output one; on a mixture of experts
  every expert's too, but not the router; lora_config adds Qwen2-MoE's shared expert gate
  where the model has one), or HF module names, comma-separated or as a sequence ("gate": a
  mixture of experts' router, mlp.gate; "shared_expert_gate": Qwen2-MoE's)."""
  if spec == "all-linear":
    return LORA_TARGETS
  names = [t.strip() for t in spec.split(",")] if isinstance(spec, str) else list(spec)
  unknown = [t for t in names if t not in _NAMED]
  if unknown or not names:
    raise ValueError(f"{spec!r}: LoRA adapts 'all-linear' or a comma-separated list of "
                     f"{_NAMED}" + (f"; unknown: {unknown}" if unknown else ""))
  return tuple(dict.fromkeys(names))


def lora_config(cfg: ModelConfig, rank: int, alpha: float, targets,
                experts: bool = True) -> ModelConfig:
  """cfg with adapters of `rank` on `targets` (see lora_targets). "all-linear" covers the
  shared expert gate of a model that has one: it is an nn.Linear, which PEFT's adapts.
  experts=False leaves a mixture of experts' routed experts unadapted, gate_proj, up_proj
  and down_proj then adapting the dense and shared-expert MLPs only (an adapter's own
  choice: adapter_adapts_experts)."""
  names = lora_targets(targets)
  if targets == "all-linear" and cfg.shared_expert_intermediate_size:
    names += (LORA_SHARED_GATE,)
  return cfg.replace(lora_rank=rank, lora_alpha=float(alpha), lora_targets=names,
                     lora_experts=bool(experts))


def adapter_adapts_experts(path: str) -> bool:
  """Whether a PEFT adapter directory holds LoRA on a mixture of experts' routed experts:
  target_parameters on the fused experts (not the router's), or per-expert tensors
  (mlp.experts.{e}.*). PEFT on transformers 5 adapts nn.Linear modules by name, and the
  routed experts are fused parameters there, so an adapter made without target_parameters
  on them (all-linear, where PEFT does not convert transformers 4's names) adapts the
  dense and shared-expert MLPs alone, though its target_modules name gate_proj, up_proj
  and down_proj."""
  from safetensors import safe_open
  config = read_json(path)
  if set(fused_targets(config, os.path.join(path, "adapter_config.json"))) & set(_MLP):
    return True
  file = os.path.join(path, "adapter_model.safetensors")
  if not os.path.isfile(file):
    raise FileNotFoundError(f"no adapter_model.safetensors in LoRA adapter directory {path!r}")
  with safe_open(file, framework="numpy") as f:
    return any(_ROUTED.search(key) for key in f.keys())


# A routed expert's tensor in PEFT's names (mlp.experts.3.down_proj.lora_A.weight) or the
# fused experts' (mlp.experts.lora_A.weight, mlp.experts.base_layer.lora_A.weight).
_ROUTED = re.compile(r"\.experts\.(\d+\.|lora_|base_layer\.)")


def init_adapters(cfg: ModelConfig, seed: int, head: str = "lm") -> nnx.State:
  """Fresh adapters alone: the whole model is traced under jit, and XLA drops the base
  weights' initialisation, which nothing returns."""
  return jax.jit(lambda: nnx.state(DecoderLM(cfg, rngs=model_rngs(seed), head=head),
                                   nnx.LoRAParam))()


def add_adapters(cfg: ModelConfig, state: nnx.State, seed: int, head: str = "lm"):
  """(graphdef, state) of the model `cfg` describes (adapters included), its base weights
  taken from `state` (a model without adapters)."""
  if split_adapters(state)[0]:
    raise ValueError("add_adapters: the state already holds LoRA adapters")
  graphdef, _ = create_abstract(cfg, head=head)
  return graphdef, nnx.merge_state(state, init_adapters(cfg, seed, head))


def trainable_filter(cfg: ModelConfig, head: str):
  """What an optimizer trains in a model: None (every weight), or with LoRA the adapters,
  plus a value model's score head (new, so trained in full: PEFT's modules_to_save)."""
  if not cfg.lora_rank:
    return None
  return nnx.LoRAParam if head == "lm" else nnx.Any(nnx.LoRAParam, nnx.PathContains("score"))


def split_adapters(state: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(adapters, base weights)."""
  return nnx.split_state(state, nnx.LoRAParam, ...)


def merge_adapters(cfg: ModelConfig, state: nnx.State) -> nnx.State:
  """The base model's state with each adapted kernel replaced by W + scale * A B: the
  same function, without the adapters' two extra matmuls per layer."""
  kernels, adapters, rest = split_for_merge(state)
  return nnx.merge_state(rest, merged_kernels(cfg, kernels, adapters))


def split_for_merge(state: nnx.State) -> tuple[nnx.State, nnx.State, nnx.State]:
  """(the adapted kernels, the adapters, every other weight): a merge reads the first
  two and leaves the third as it is."""
  adapters, base = split_adapters(state)
  adapted = {_kernel_of(path) for path, _ in nnx.to_flat_state(adapters)}
  kernels, rest = nnx.split_state(base, lambda path, _: tuple(path) in adapted, ...)
  return kernels, adapters, rest


def _kernel_of(adapter_path: tuple) -> tuple:
  """The kernel an adapter matrix adds to: a Dense's (..., q, lora_a) -> (..., q, kernel);
  an expert stack's (..., mlp, gate_lora_a) -> (..., mlp, gate)."""
  *module, name = adapter_path
  return (*module, name[:-len("_lora_a")] or "kernel")


def _adapters_of(kernel_path: tuple) -> tuple[tuple, tuple]:
  """The paths of A and B of an adapted kernel (_kernel_of's inverse)."""
  *module, name = kernel_path
  prefix = "" if name == "kernel" else name + "_"
  return (*module, prefix + "lora_a"), (*module, prefix + "lora_b")


def merged_kernels(cfg: ModelConfig, kernels: nnx.State, adapters: nnx.State) -> nnx.State:
  """W + scale * A B for each adapted kernel (an expert stack's: W_e + scale * A_e B_e), summed
  in float32 and cast back to W's dtype (in bfloat16 weights, an adapter change below W's
  precision rounds away)."""
  flat = dict(nnx.to_flat_state(adapters))
  out = []
  for path, var in nnx.to_flat_state(kernels):
    a, b = (flat[p][...] for p in _adapters_of(tuple(path)))
    w = var[...]
    delta = jnp.matmul(a.astype(jnp.float32), b.astype(jnp.float32))
    out.append((path, var.replace(value=(w.astype(jnp.float32) + cfg.lora_scale * delta)
                                  .astype(w.dtype))))
  return nnx.from_flat_state(out)


def base_config(cfg: ModelConfig) -> ModelConfig:
  return cfg.replace(lora_rank=0, lora_targets=(), lora_experts=True)


def export_adapter(path: str, cfg: ModelConfig, state: nnx.State, *, base_model: str = "",
                   fused_experts: bool = False):
  """Writes the adapters as PEFT's `save_pretrained` does (adapter_config.json and
  adapter_model.safetensors), for `PeftModel.from_pretrained(base, path)`. An expert
  stack's adapters are written one pair an expert under the checkpoints' per-expert names
  (mlp.experts.{e}.gate_proj.lora_A.weight), which PEFT on transformers 5 fuses as it
  fuses the experts' weights; with fused_experts, as PEFT's own LoRA on transformers 5's
  fused expert tensors (target_parameters, hflax.models.peft_experts)."""
  from hflax.models.hf import hf_name_map  # hf imports the transformer, as this module does
  if fused_experts:
    check_fusable(cfg)
  names = hf_name_map(base_config(cfg))
  tensors, stacks, weight_of, fields = {}, {}, {}, {}
  for kpath, var in nnx.to_flat_state(split_adapters(state)[0]):
    if fused_experts and var.get_value().ndim == 3:  # hflax's layout, written below
      layer, leaf = kpath[1], kpath[-1]
      pair = stacks.setdefault((layer, leaf[:-len("_lora_a")]), [None, None])
      pair[leaf.endswith("lora_b")] = np.asarray(jax.device_get(var[...]), np.float32)
      weight_of[layer] = names[_kernel_of(tuple(kpath))][0]
      continue
    # PEFT keeps torch's [out, in] layout: A is [rank, in], B is [out, rank].
    array = np.swapaxes(np.asarray(jax.device_get(var[...]), np.float32), -1, -2)
    parts = array if array.ndim == 3 else [array]  # an expert stack: one an expert
    for key, part in zip(_peft_keys(names, tuple(kpath), array.shape), parts, strict=True):
      tensors[key] = np.ascontiguousarray(part)
  if stacks:
    fused, fields = fused_tensors(weight_of, {k: tuple(v) for k, v in stacks.items()}, cfg)
    tensors.update(fused)
  os.makedirs(path, exist_ok=True)
  save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
  adapter_config = dict(
      peft_type="LORA", task_type="CAUSAL_LM", r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
      target_modules=_peft_target_modules(cfg), lora_dropout=0.0, bias="none",
      fan_in_fan_out=False, use_rslora=False, use_dora=False, inference_mode=True,
      base_model_name_or_path=base_model or None, **fields)
  with open(os.path.join(path, "adapter_config.json"), "w") as f:
    json.dump(adapter_config, f, indent=2)


def _peft_target_modules(cfg: ModelConfig) -> list[str]:
  """target_modules that make PEFT adapt what cfg adapts. With the routed experts left
  out, an MLP projection is named by its parent (shared_expert.gate_proj, mlp.gate_proj:
  PEFT matches a name's end), so that PEFT's conversion of transformers 4's expert names
  (which reads a bare gate_proj as the fused experts' gate_up_proj too) adapts no expert."""
  if cfg.lora_experts or not cfg.num_experts:
    return sorted(cfg.lora_targets)
  parents = (("shared_expert",) * bool(cfg.shared_expert_intermediate_size)
             + ("mlp",) * (cfg.num_sparse_layers < cfg.num_layers))
  return sorted(f"{parent}.{t}" if t in _MLP else t for t in cfg.lora_targets
                for parent in (parents if t in _MLP else ("",)))


_MLP = ("gate_proj", "up_proj", "down_proj")


def read_adapter_config(path: str) -> dict:
  """rank, alpha and targets of a PEFT LoRA adapter directory; what hflax cannot run
  the same way (rsLoRA, DoRA, trained biases, extra modules) is refused, naming it.
  target_parameters on the fused experts (transformers 5) count as the projections' names:
  experts.gate_up_proj as gate_proj and up_proj, experts.down_proj as down_proj."""
  file = os.path.join(path, "adapter_config.json")
  c = read_json(path)
  unsupported = {"peft_type": c.get("peft_type") != "LORA", "use_rslora": c.get("use_rslora"),
                 "use_dora": c.get("use_dora"), "bias": c.get("bias", "none") != "none",
                 "modules_to_save": c.get("modules_to_save")}
  bad = [k for k, v in unsupported.items() if v]
  if bad:
    raise ValueError(f"{file}: {', '.join(f'{k}={c.get(k)!r}' for k in bad)} is not supported "
                     "(hflax runs plain LoRA: peft_type LORA, no rsLoRA/DoRA, bias 'none')")
  gate_up_rank(c, file)  # refuses rank and alpha patterns but the fused experts' own
  fused = fused_targets(c, file)
  try:
    modules = c.get("target_modules")
    if isinstance(modules, list):  # PEFT matches a name's end: layers.1.mlp.gate_proj
      modules = [m.rsplit(".", 1)[-1] for m in modules]
    targets = lora_targets(modules) if modules or not fused else ()
  except (TypeError, ValueError) as e:
    raise ValueError(f"{file}: target_modules: {e}") from None
  return {"rank": int(c["r"]), "alpha": float(c["lora_alpha"]),
          "targets": tuple(dict.fromkeys(targets + fused))}


def load_adapter(path: str, cfg: ModelConfig) -> nnx.State:
  """The adapters of a PEFT LoRA directory (adapter_model.safetensors) as the LoRAParams
  of the model `cfg` describes; every tensor must be there, with its shape, and no other."""
  from safetensors import safe_open
  from hflax.models.hf import hf_name_map
  file = os.path.join(path, "adapter_model.safetensors")
  if not os.path.isfile(file):
    raise FileNotFoundError(f"no adapter_model.safetensors in LoRA adapter directory {path!r}")
  names = hf_name_map(base_config(cfg))
  abstract = split_adapters(create_abstract(cfg)[1])[0]
  config = read_json(path)
  fused = set(fused_targets(config, file))
  loaded = []
  with safe_open(file, framework="numpy") as f:
    stored = set(f.keys())
    fused_keys = set()
    for kpath, var in nnx.to_flat_state(abstract):
      want = var.get_value()
      proj = kpath[-1][:-len("_lora_a")] + "_proj"
      if len(want.shape) == 3 and proj in fused:  # an expert stack's, from the fused tensors
        weight = names[_kernel_of(tuple(kpath))][0]
        array, keys = read_fused(f, stored, weight, kpath[-1], cfg, config, file)
        loaded.append((kpath, var.replace(value=jnp.asarray(array, want.dtype))))
        fused_keys |= keys
        continue
      keys = _peft_keys(names, tuple(kpath), want.shape)
      parts = []
      for key in keys:
        if key not in stored:
          raise ValueError(f"{file}: no tensor {key!r} (" + (
              "its routed experts are adapted in part" if _ROUTED.search(key)
              else "adapter and model.target_modules differ?") + ")")
        part = f.get_tensor(key)
        if part.shape != want.shape[-1:-3:-1]:
          raise ValueError(f"{file}: {key} has shape {part.shape}, the model needs "
                           f"{want.shape[-1:-3:-1]}")
        parts.append(part.T)
        stored.discard(key)
      array = np.stack(parts) if len(want.shape) == 3 else parts[0]
      loaded.append((kpath, var.replace(value=jnp.asarray(array, want.dtype))))
  stored -= fused_keys
  if stored:
    raise ValueError(f"{file}: tensors the model has no place for: {sorted(stored)[:3]}")
  return nnx.from_flat_state(loaded)


def _peft_keys(names: dict, kpath: tuple, shape) -> list[str]:
  """PEFT's names of one adapter matrix, e.g. [base_model.model.model.layers.0.self_attn.
  q_proj.lora_A.weight] for (layers, 0, attn, q, lora_a); an expert stack's one an expert
  (..., mlp.experts.{e}.gate_proj.lora_A.weight for (layers, 0, mlp, gate_lora_a))."""
  from hflax.models.hf import EXPERT
  weight, _ = names[_kernel_of(kpath)]
  which = {"lora_a": "lora_A", "lora_b": "lora_B"}[kpath[-1][-len("lora_a"):]]
  key = "base_model.model." + weight.replace(".weight", f".{which}.weight")
  return [key.replace(EXPERT, str(e)) for e in range(shape[0])] if EXPERT in key else [key]
