"""LoRA on a policy: adapters added to a loaded model, the merged weights that generation
and export use, the base model beneath the adapters (the reference policy, for free), and
PEFT's adapter format.

Adapters are `nnx.LoRAParam`s (a subclass of `nnx.Param`) on the targeted `Dense` layers;
everything here tells them apart by that type.
"""
from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from hflax.models.config import LORA_TARGETS, ModelConfig
from hflax.models.transformer import DecoderLM, create_abstract, model_rngs


def lora_targets(spec) -> tuple[str, ...]:
  """"all-linear" (PEFT's: every linear layer but the output one), or HF module names,
  comma-separated or as a sequence."""
  if spec == "all-linear":
    return LORA_TARGETS
  names = [t.strip() for t in spec.split(",")] if isinstance(spec, str) else list(spec)
  unknown = [t for t in names if t not in LORA_TARGETS]
  if unknown or not names:
    raise ValueError(f"{spec!r}: LoRA adapts 'all-linear' or a comma-separated list of "
                     f"{LORA_TARGETS}" + (f"; unknown: {unknown}" if unknown else ""))
  return tuple(dict.fromkeys(names))


def lora_config(cfg: ModelConfig, rank: int, alpha: float, targets) -> ModelConfig:
  """cfg with adapters of `rank` on `targets` (see lora_targets)."""
  return cfg.replace(lora_rank=rank, lora_alpha=float(alpha), lora_targets=lora_targets(targets))


def init_adapters(cfg: ModelConfig, seed: int) -> nnx.State:
  """Fresh adapters alone: the whole model is traced under jit, and XLA drops the base
  weights' initialisation, which nothing returns."""
  return jax.jit(lambda: nnx.state(DecoderLM(cfg, rngs=model_rngs(seed)), nnx.LoRAParam))()


def add_adapters(cfg: ModelConfig, state: nnx.State, seed: int):
  """(graphdef, state) of the model `cfg` describes (adapters included), its base weights
  taken from `state` (a model without adapters)."""
  if split_adapters(state)[0]:
    raise ValueError("add_adapters: the state already holds LoRA adapters")
  graphdef, _ = create_abstract(cfg)
  return graphdef, nnx.merge_state(state, init_adapters(cfg, seed))


def split_adapters(state: nnx.State) -> tuple[nnx.State, nnx.State]:
  """(adapters, base weights)."""
  return nnx.split_state(state, nnx.LoRAParam, ...)


def merge_adapters(cfg: ModelConfig, state: nnx.State) -> nnx.State:
  """The base model's state with each adapted kernel replaced by W + scale * A B (in
  float32, cast back to W's dtype): the same function, without the adapters' two extra
  matmuls per layer."""
  flat = dict(nnx.to_flat_state(state))
  merged = []
  for path, var in flat.items():
    if isinstance(var, nnx.LoRAParam):
      continue
    if path[-1] == "kernel" and path[:-1] + ("lora_a",) in flat:
      a, b = flat[path[:-1] + ("lora_a",)][...], flat[path[:-1] + ("lora_b",)][...]
      w = var[...]
      delta = jnp.dot(a.astype(jnp.float32), b.astype(jnp.float32))
      var = var.replace(value=(w.astype(jnp.float32) + cfg.lora_scale * delta).astype(w.dtype))
    merged.append((path, var))
  return nnx.from_flat_state(merged)


def base_config(cfg: ModelConfig) -> ModelConfig:
  return cfg.replace(lora_rank=0, lora_targets=())


def export_adapter(path: str, cfg: ModelConfig, state: nnx.State, *, base_model: str = ""):
  """Writes the adapters as PEFT's `save_pretrained` does (adapter_config.json and
  adapter_model.safetensors), for `PeftModel.from_pretrained(base, path)`."""
  from hflax.models.hf import hf_name_map  # hf imports the transformer, as this module does
  names = hf_name_map(base_config(cfg))
  tensors = {}
  for kpath, var in nnx.to_flat_state(split_adapters(state)[0]):
    weight, _ = names[kpath[:-1] + ("kernel",)]
    which = {"lora_a": "lora_A", "lora_b": "lora_B"}[kpath[-1]]
    # PEFT keeps torch's [out, in] layout: A is [rank, in], B is [out, rank].
    array = np.asarray(jax.device_get(var[...]), np.float32).T
    tensors["base_model.model." + weight.replace(".weight", f".{which}.weight")] = (
        np.ascontiguousarray(array))
  os.makedirs(path, exist_ok=True)
  save_file(tensors, os.path.join(path, "adapter_model.safetensors"), metadata={"format": "pt"})
  adapter_config = dict(
      peft_type="LORA", task_type="CAUSAL_LM", r=cfg.lora_rank, lora_alpha=cfg.lora_alpha,
      target_modules=sorted(cfg.lora_targets), lora_dropout=0.0, bias="none",
      fan_in_fan_out=False, use_rslora=False, use_dora=False, inference_mode=True,
      base_model_name_or_path=base_model or None)
  with open(os.path.join(path, "adapter_config.json"), "w") as f:
    json.dump(adapter_config, f, indent=2)
