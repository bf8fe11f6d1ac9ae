"""The Ray backend: the single controller drives JAX worker groups across processes/hosts.

  session.py    starting/joining Ray (a local cluster only on loopback), shutdown
  member.py     PoolMember: one process of a pool (a Ray actor in a jax.distributed job)
  split.py      the split placement (a rollout pool of its own): the weight sync, the
                rollout pool's replica of the actor (and async's stream beside it);
                split_actor.py the driver's side
  stream.py     trainer.mode = "async": the stream in the generating pool's processes
  group.py      WorkerGroup (a pool's processes), RoleHandle, failure detection
  transport.py  Batches and arguments as host numpy between driver and members
  backend.py    RayBackend: the roles of a run on worker groups (restarts, checkpoints)
  config.py     the `cluster` settings, pools onto processes

Nothing here imports Ray at module import time, so the package is importable (and the
config validated) where Ray is not installed.
"""
from hflax.controller.ray_backend.config import ClusterSettings, PoolLayout, pool_layouts
from hflax.controller.ray_backend.session import loopback_only_reason

__all__ = ["ClusterSettings", "PoolLayout", "pool_layouts", "loopback_only_reason"]
