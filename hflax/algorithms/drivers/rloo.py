"""RLOO: GRPO's loop with the leave-one-out baseline (algorithm.adv_estimator = "rloo")."""
from hflax.algorithms.drivers.grpo import step  # noqa: F401  (same dataflow)
