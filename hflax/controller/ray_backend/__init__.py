"""The Ray backend: the single controller drives JAX worker groups across processes/hosts.

  session.py    starting/joining Ray (a local cluster only on loopback), shutdown
  member.py     PoolMember: one process of a pool (a Ray actor in a jax.distributed job)
  group.py      WorkerGroup (a pool's processes), RoleHandle, failure detection
  transport.py  Batches and arguments as host numpy between driver and members
  trainer.py    RayTrainer: the main job on this backend (restarts, checkpoints)
  config.py     the `cluster` config section

Nothing here imports Ray at module import time, so the package is importable (and the
config validated) where Ray is not installed.
"""
from hflax.controller.ray_backend.config import PoolLayout, pool_layouts, validate_cluster
from hflax.controller.ray_backend.session import loopback_only_reason

__all__ = ["PoolLayout", "pool_layouts", "validate_cluster", "loopback_only_reason"]
