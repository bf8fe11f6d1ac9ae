"""Decoder LMs (Llama, Qwen2, Qwen3), their HF checkpoints, tokenizers and log-probs."""
from hflax.models.config import ModelConfig
from hflax.models import moe
from hflax.models.transformer import (DecoderLM, create, create_abstract, forward, init_cache,
                                      logical_axes, logits_fn, positions_from_mask,
                                      positions_from_segments)

__all__ = ["ModelConfig", "DecoderLM", "create", "create_abstract", "forward", "init_cache",
           "logical_axes", "logits_fn", "moe", "positions_from_mask", "positions_from_segments"]
