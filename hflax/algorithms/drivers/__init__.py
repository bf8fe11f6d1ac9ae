"""One short driver per algorithm: step(roles, prompts, cfg: StepConfig, state) -> Batch.

Drivers talk to role handles only (local workers or remote groups alike); the math is
in hflax.algorithms. Each driver module registers its `Algorithm` description; importing
this package registers the built-in ones.
"""
# Importing a driver module registers its algorithm.
from hflax.algorithms.drivers import (dapo, grpo, ppo, reinforce_pp, remax, rloo,  # noqa: F401
                                      safe_rlhf)
from hflax.algorithms.drivers.common import StepConfig, StepState, init_state
from hflax.algorithms.drivers.registry import (Algorithm, algorithm_names, get_algorithm,
                                               register_algorithm, unregister_algorithm)

__all__ = ["Algorithm", "StepConfig", "StepState", "algorithm_names", "get_algorithm",
           "init_state", "register_algorithm", "unregister_algorithm"]
