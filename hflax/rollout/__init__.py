"""Generation: the jitted KV-cache sampler."""
from hflax.rollout.sampler import SamplingParams, filter_logits, generate, left_pad

__all__ = ["SamplingParams", "filter_logits", "generate", "left_pad"]
