"""RLOO: GRPO's loop with the leave-one-out baseline (algorithm.adv_estimator = "rloo")."""
import dataclasses

from hflax.algorithms.drivers import grpo
from hflax.algorithms.drivers.registry import register_algorithm

ALGORITHM = register_algorithm(dataclasses.replace(grpo.ALGORITHM, name="rloo"))
