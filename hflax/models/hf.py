"""Hugging Face checkpoints: load a local directory into hflax params, export them back.

Loading reads each device's shard straight from the memory-mapped safetensors files
(`jax.make_array_from_callback`), so no device, and no host buffer, ever holds a full
copy of a parameter that the target sharding splits.
"""
from __future__ import annotations

import json
import os
import re
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, which safetensors needs)
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from hflax.models import gguf
from hflax.models.config import ModelConfig
from hflax.models.transformer import Dense, create_abstract

# Tensors some checkpoints carry that hflax recomputes or does not use.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
_HEAD_ARCH = {"lm": "ForCausalLM", "value": "ForTokenClassification"}
_FAMILY_PREFIX = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "qwen3_moe": "Qwen3Moe",
                  "qwen2_moe": "Qwen2Moe"}
# In a name, the place of the expert index: the parameter stacks those tensors on axis 0
# (HF stores one tensor an expert; a GGUF file the stack itself, under this very name).
EXPERT = "*"


def hf_name_map(cfg: ModelConfig, head: str = "lm") -> dict[tuple, tuple[str, bool]]:
  """hflax parameter path -> (HF tensor name, whether HF stores it transposed); an expert
  stack's name holds EXPERT where HF's names hold the expert's index."""
  names: dict[tuple, tuple[str, bool]] = {("embed",): ("model.embed_tokens.weight", False),
                                          ("final_norm", "scale"): ("model.norm.weight", False)}
  for i in range(cfg.num_layers):
    hf, ours = f"model.layers.{i}.", ("layers", i)
    for proj in "qkvo":
      names[ours + ("attn", proj, "kernel")] = (hf + f"self_attn.{proj}_proj.weight", True)
      names[ours + ("attn", proj, "bias")] = (hf + f"self_attn.{proj}_proj.bias", False)
    for norm in "qk":
      names[ours + ("attn", f"{norm}_norm", "scale")] = (hf + f"self_attn.{norm}_norm.weight", False)
    for proj in ("gate", "up", "down"):
      names[ours + ("mlp", proj, "kernel")] = (hf + f"mlp.{proj}_proj.weight", True)
      names[ours + ("mlp", proj, "bias")] = (hf + f"mlp.{proj}_proj.bias", False)
    names[ours + ("mlp", "router")] = (hf + "mlp.gate.weight", True)
    for proj in ("gate", "up", "down"):
      names[ours + ("mlp", proj)] = (hf + f"mlp.experts.{EXPERT}.{proj}_proj.weight", True)
      names[ours + ("mlp", "shared_expert", proj, "kernel")] = (
          hf + f"mlp.shared_expert.{proj}_proj.weight", True)
    names[ours + ("mlp", "shared_expert_gate", "kernel")] = (hf + "mlp.shared_expert_gate.weight",
                                                             True)
    names[ours + ("attn_norm", "scale")] = (hf + "input_layernorm.weight", False)
    names[ours + ("mlp_norm", "scale")] = (hf + "post_attention_layernorm.weight", False)
  names[("lm_head", "kernel")] = ("lm_head.weight", True)
  names[("score", "kernel")] = ("score.weight", True)
  names[("score", "bias")] = ("score.bias", False)
  return names


def _path_key(path) -> tuple:
  return tuple(getattr(p, "key", getattr(p, "idx", p)) for p in path)


def read_config(path: str) -> ModelConfig:
  """The model config of a checkpoint: an HF directory, a .gguf file or a shipped model."""
  file = gguf.resolve(path)
  if file is not None:
    return ModelConfig.from_hf(gguf.hf_config(file), source=file)
  file = os.path.join(path, "config.json")
  if not os.path.isfile(file):
    raise FileNotFoundError(f"no config.json in checkpoint directory {path!r}")
  with open(file) as f:
    return ModelConfig.from_hf(json.load(f), source=file)


class _TensorIndex:
  """Which safetensors file holds each tensor, with lazily opened handles."""

  def __init__(self, path: str):
    index_file = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(index_file):
      with open(index_file) as f:
        weight_map = json.load(f)["weight_map"]
      self.file_of = {k: os.path.join(path, v) for k, v in weight_map.items()}
    elif os.path.isfile(single):
      with _open(single) as f:
        self.file_of = {k: single for k in f.keys()}
    else:
      raise FileNotFoundError(
          f"checkpoint directory {path!r} has neither model.safetensors nor "
          "model.safetensors.index.json")
    for file in set(self.file_of.values()):
      if not os.path.isfile(file):
        raise FileNotFoundError(f"{index_file} names {file!r}, which does not exist")
    self._handles: dict[str, Any] = {}

  def slice(self, name: str):
    file = self.file_of[name]
    if file not in self._handles:
      self._handles[file] = _open(file)
    return self._handles[file].get_slice(name)


def _open(file: str):
  """safe_open, with a damaged file (truncated, not safetensors) as one ValueError naming it."""
  try:
    return safe_open(file, "np")
  except Exception as e:  # noqa: BLE001 - SafetensorError is not a ValueError
    raise ValueError(f"{file}: not a readable safetensors file "
                     f"({' '.join(str(e).split())})") from None


def load_checkpoint(path: str, *, head: str = "lm", sharding=None, param_dtype: str | None = None,
                    dtype: str | None = None, remat: bool = False, seed: int = 0,
                    attention: str = "auto", moe_dispatch: str = "dense",
                    moe_capacity_factor: float = 0.0):
  """Loads a Llama/Qwen2/Qwen3/Qwen3-MoE HF checkpoint directory.

  Args:
    path: directory with config.json and model.safetensors (or sharded + index); or a
      .gguf file, or the name of a model a package ships (`hflax.models.gguf.SHIPPED`).
    head: "lm" for a causal LM; "value" for a scalar head (critic/reward/cost). A value
      model loaded from a causal-LM checkpoint gets a freshly initialised score head.
    sharding: where each parameter goes: a `jax.sharding.Sharding` for all of them, a
      pytree of shardings shaped like the state, or a function
      `(logical_axes, shape) -> Sharding`. Default: the first device.
    param_dtype / dtype: storage and compute dtypes (default: float32 for both).
    remat: recompute layer activations in the backward pass (less memory for training).
    attention: the attention implementation (ModelConfig.attention).
    moe_dispatch, moe_capacity_factor: how a mixture of experts' sparse layers compute
      (ModelConfig.moe_dispatch, moe_capacity_factor).
  Returns:
    (config, graphdef, state).
  """
  cfg = read_config(path)
  cfg = cfg.replace(param_dtype=param_dtype or cfg.param_dtype, dtype=dtype or cfg.dtype,
                    remat=remat, attention=attention, moe_dispatch=moe_dispatch,
                    moe_capacity_factor=moe_capacity_factor)
  graphdef, abstract = create_abstract(cfg, head=head)
  gguf_file = gguf.resolve(path)
  index = gguf.TensorIndex(gguf_file) if gguf_file else _TensorIndex(path)
  names = hf_name_map(cfg, head)
  shardings = _resolve_shardings(abstract, sharding)
  fresh = None
  if head == "value" and "score.weight" not in index.file_of:  # critic from a causal LM
    fresh = nnx.state(Dense(cfg.hidden_size, 1, ("embed", None), bias=True, cfg=cfg,
                            rngs=nnx.Rngs(seed)))

  def load_leaf(kpath, var, target_sharding):
    key = _path_key(kpath)
    hf_name, transposed = names[key]
    shape, want = var.get_value().shape, jnp.dtype(cfg.param_dtype)
    if EXPERT in hf_name and hf_name not in index.file_of:
      return var.replace(_load_experts(index, hf_name, shape, want, target_sharding, path))
    if hf_name not in index.file_of:
      if key[0] == "score" and fresh is not None:
        return var.replace(jax.device_put(fresh[key[1]][...].astype(want), target_sharding))
      if key == ("score", "bias"):  # sequence-classification heads have no bias
        return var.replace(jax.device_put(jnp.zeros(shape, want), target_sharding))
      raise KeyError(f"checkpoint {path!r} lacks tensor {hf_name!r} (needed for {'/'.join(map(str, key))})")
    tensor = index.slice(hf_name)
    stored = tuple(tensor.get_shape())
    expected = _swap_last(shape) if transposed else shape
    if stored != expected:
      raise ValueError(f"{index.file_of[hf_name]}: tensor {hf_name!r} has shape {stored}, "
                       f"but config.json implies {expected}")

    def read(idx):
      idx = tuple(idx) + (slice(None),) * (len(shape) - len(idx))
      # An expert stack (GGUF's) keeps its expert axis first: only [out, in] is swapped.
      block = np.swapaxes(tensor[_swap_last(idx)], -1, -2) if transposed else tensor[idx]
      return np.asarray(block).astype(want)

    return var.replace(jax.make_array_from_callback(shape, target_sharding, read))

  state = jax.tree_util.tree_map_with_path(
      load_leaf, abstract, shardings, is_leaf=lambda x: isinstance(x, nnx.Variable))
  _check_unused(index, names, abstract, path)
  return cfg, graphdef, state


def _swap_last(seq) -> tuple:
  """seq with its last two entries swapped (a shape or index of a transposed matrix, or
  of a stack of them)."""
  seq = tuple(seq)
  return seq[:-2] + seq[:-3:-1]


def _load_experts(index, name: str, shape, want, target_sharding, path: str):
  """An expert stack [E, in, out] from HF's one [out, in] tensor an expert."""
  parts = [name.replace(EXPERT, str(e)) for e in range(shape[0])]
  for part in parts:
    if part not in index.file_of:
      raise KeyError(f"checkpoint {path!r} lacks tensor {part!r}")
    stored = tuple(index.slice(part).get_shape())
    if stored != shape[:0:-1]:
      raise ValueError(f"{index.file_of[part]}: tensor {part!r} has shape {stored}, but "
                       f"config.json implies {shape[:0:-1]}")

  def read(idx):
    idx = tuple(idx) + (slice(None),) * (len(shape) - len(idx))
    experts = range(shape[0])[idx[0]]
    return np.stack([np.asarray(index.slice(parts[e])[idx[2], idx[1]]).T
                     for e in experts]).astype(want)

  return jax.make_array_from_callback(shape, target_sharding, read)


def _expanded(name: str, shape) -> list[str]:
  """The HF tensor names one parameter covers (an expert stack's: one an expert)."""
  return [name.replace(EXPERT, str(e)) for e in range(shape[0])] if EXPERT in name else [name]


def _resolve_shardings(abstract, sharding):
  is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
  if sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
  if isinstance(sharding, jax.sharding.Sharding):
    return jax.tree.map(lambda _: sharding, abstract, is_leaf=is_var)
  if callable(sharding):
    return jax.tree.map(lambda v: sharding(v.get_metadata().get("axes"), v.get_value().shape),
                        abstract, is_leaf=is_var)
  return jax.tree.map(lambda s: s.get_value() if is_var(s) else s, sharding, is_leaf=is_var)


def _check_unused(index, names, abstract, path):
  used = {n for k, v in jax.tree_util.tree_flatten_with_path(
      abstract, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
      for n in _expanded(names[_path_key(k)][0], v.get_value().shape) + [names[_path_key(k)][0]]}
  spare = {"lm_head.weight"}  # checkpoints with tied embeddings sometimes store it anyway
  unused = [n for n in index.file_of if n not in used and n not in spare
            and not n.endswith(_IGNORED_SUFFIXES)]
  if unused:
    raise ValueError(f"checkpoint {path!r} has tensors hflax would not load, so its config.json "
                     f"does not describe it: {sorted(unused)[:5]}")


def export_checkpoint(path: str, cfg: ModelConfig, state, *, head: str = "lm",
                      dtype: str | None = None, max_shard_bytes: int = 5 * 2**30,
                      extra_config: dict | None = None):
  """Writes a directory that transformers' from_pretrained loads (one tensor gathered at a time)."""
  os.makedirs(path, exist_ok=True)
  # An earlier export's weight files would outlive this one where it writes fewer files,
  # and a loader that prefers the index would read them.
  for name in os.listdir(path):
    if name in ("model.safetensors", "model.safetensors.index.json") or \
        re.fullmatch(r"model-\d+-of-\d+\.safetensors", name):
      os.remove(os.path.join(path, name))
  names = hf_name_map(cfg, head)
  out_dtype = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
  shards: list[dict[str, np.ndarray]] = [{}]
  size = 0
  flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=lambda x: isinstance(x, nnx.Variable))[0]
  for kpath, var in flat:
    hf_name, transposed = names[_path_key(kpath)]
    array = np.asarray(jax.device_get(var[...])).astype(out_dtype)
    stack = array if EXPERT in hf_name else array[None]
    for name, part in zip(_expanded(hf_name, stack.shape), stack):
      part = np.ascontiguousarray(part.T if transposed else part)
      if size + part.nbytes > max_shard_bytes and shards[-1]:
        shards.append({})
        size = 0
      shards[-1][name] = part
      size += part.nbytes
  if len(shards) == 1:
    save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
  else:
    weight_map = {}
    for i, shard in enumerate(shards):
      file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
      save_file(shard, os.path.join(path, file), metadata={"format": "pt"})
      weight_map.update({name: file for name in shard})
    total = sum(a.nbytes for s in shards for a in s.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
  hf_config = cfg.to_hf()
  hf_config["torch_dtype"] = str(out_dtype) if out_dtype != np.dtype(ml_dtypes.bfloat16) else "bfloat16"
  if head == "value":
    hf_config["architectures"] = [_FAMILY_PREFIX[cfg.family] + _HEAD_ARCH["value"]]
    hf_config.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
  hf_config.update(extra_config or {})
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(hf_config, f, indent=2)
