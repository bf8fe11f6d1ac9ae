"""REINFORCE++: GRPO's loop with whitened discounted returns
(algorithm.adv_estimator = "reinforce_plus_plus" or "reinforce_plus_plus_baseline")."""
import dataclasses

from hflax.algorithms.drivers import grpo
from hflax.algorithms.drivers.registry import register_algorithm

ALGORITHM = register_algorithm(dataclasses.replace(grpo.ALGORITHM, name="reinforce_pp"))
