"""One short driver per algorithm: step(roles, prompts, cfg, state) -> Batch.

Drivers talk to role handles only (local workers or remote groups alike); the math is
in hflax.algorithms. DAPO's step takes an iterator of prompt batches (dynamic sampling
draws as many as it needs); the others take one prompt batch.
"""
from hflax.algorithms.drivers import dapo, grpo, ppo, reinforce_pp, remax, rloo, safe_rlhf
from hflax.algorithms.drivers.common import Roles, StepState, init_state

DRIVERS = {"ppo": ppo.step, "grpo": grpo.step, "rloo": rloo.step, "remax": remax.step,
           "reinforce_pp": reinforce_pp.step, "dapo": dapo.step, "safe_rlhf": safe_rlhf.step}
NEEDS_CRITIC = {"ppo", "safe_rlhf"}
TAKES_PROMPT_ITERATOR = {"dapo"}

__all__ = ["DRIVERS", "NEEDS_CRITIC", "TAKES_PROMPT_ITERATOR", "Roles", "StepState", "init_state"]
