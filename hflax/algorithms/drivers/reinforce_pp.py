"""REINFORCE++: GRPO's loop with whitened discounted returns
(algorithm.adv_estimator = "reinforce_plus_plus" or "reinforce_plus_plus_baseline")."""
from hflax.algorithms.drivers.grpo import step  # noqa: F401  (same dataflow)
