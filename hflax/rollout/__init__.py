"""Generation: the jitted KV-cache sampler."""
from hflax.rollout.decoding import SamplingParams, filter_logits
from hflax.rollout.sampler import generate, left_pad, replicate
from hflax.rollout.waves import generation_slots, generation_waves

__all__ = ["SamplingParams", "filter_logits", "generate", "generation_slots", "generation_waves",
           "left_pad", "replicate"]
