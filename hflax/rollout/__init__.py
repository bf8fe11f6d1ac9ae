"""Generation: the rollout engine (requests in, tokens out) and the batch KV-cache sampler."""
from hflax.rollout.decoding import SamplingParams, filter_logits
from hflax.rollout.engine import Completion, Request, RolloutEngine
from hflax.rollout.sampler import generate, left_pad, replicate
from hflax.rollout.waves import generation_slots, generation_waves

__all__ = ["Completion", "Request", "RolloutEngine", "SamplingParams", "filter_logits",
           "generate", "generation_slots", "generation_waves", "left_pad", "replicate"]
