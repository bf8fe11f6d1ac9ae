"""Generation: the jitted KV-cache sampler."""
from hflax.rollout.sampler import (SamplingParams, filter_logits, generate, left_pad,
                                   replicate)

__all__ = ["SamplingParams", "filter_logits", "generate", "left_pad", "replicate"]
