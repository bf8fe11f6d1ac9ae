"""Llama-2 model shapes for sizing plans (the paper's 7B/13B/34B/70B evaluation models).

Only the shapes matter to the auto-mapper; the values are those of the public HF
config.json files. Llama-2 has no 34B release, so "34b" is CodeLlama-34B's shape (what the
HybridFlow paper's 34B runs used): grouped-query attention with 8 KV heads, like 70B.
"""
from __future__ import annotations

from hflax.models.config import ModelConfig

_SHAPES = {
    # size: (hidden, intermediate, layers, heads, kv_heads, extra fields)
    "7b": (4096, 11008, 32, 32, 32, {}),
    "13b": (5120, 13824, 40, 40, 40, {}),
    "34b": (8192, 22016, 48, 64, 8, dict(rope_theta=1e6, max_position_embeddings=16384)),
    "70b": (8192, 28672, 80, 64, 8, {}),
}
LLAMA2_SIZES = tuple(_SHAPES)


def llama2_config(size: str) -> ModelConfig:
  """The ModelConfig of Llama-2 `size` ("7b", "13b", "34b" = CodeLlama-34B, "70b")."""
  key = size.lower().removeprefix("llama2-").removeprefix("llama-2-")
  if key not in _SHAPES:
    raise ValueError(f"unknown Llama-2 size {size!r}; known: {LLAMA2_SIZES}")
  hidden, inter, layers, heads, kv, extra = _SHAPES[key]
  return ModelConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=inter,
                     num_layers=layers, num_heads=heads, num_kv_heads=kv, rms_norm_eps=1e-5,
                     dtype="bfloat16", param_dtype="bfloat16",
                     **{"max_position_embeddings": 4096, **extra})


def llama2_7b() -> ModelConfig:
  return llama2_config("7b")


def llama2_13b() -> ModelConfig:
  return llama2_config("13b")


def codellama_34b() -> ModelConfig:
  return llama2_config("34b")


def llama2_70b() -> ModelConfig:
  return llama2_config("70b")
