"""One process of a resource pool, run as a Ray actor.

The members of a pool join one `jax.distributed` job, so `jax.devices()` inside each
member lists the whole pool (every member's devices) and each member addresses its own.
They build the same role workers (the local backend's classes, on the job's global
devices) and run every method the driver broadcasts: each member runs the same jitted
programs on its own shards (multi-controller SPMD), and XLA's collectives (gloo on CPU,
NCCL on GPU) connect them.

Only the `home` of the workers differs from the local backend: results are collected
onto the pool's fully replicated sharding (one device_put, a same-device-set reshard that
compiles to an all-gather), from which `transport.to_host` reads the host copy.
"""
from __future__ import annotations

import os
import socket

from hflax import platforms
from hflax.platforms.compile_cache import use_compile_cache

STREAM = "stream"  # trainer.mode = "async": the stream's host among a member's workers


def _node_ip() -> str:
  import ray
  return ray.util.get_node_ip_address()


class PoolMember:
  """Process `process_id` of `num_processes` in pool `pool` (devices: its local devices)."""

  def __init__(self, pool: str, process_id: int, num_processes: int, devices: int,
               platform: str = "cpu", jax_config: dict | None = None,
               compile_cache: str = ""):
    self.pool, self.process_id, self.num_processes = pool, process_id, num_processes
    self.devices, self.platform, self.jax_config = devices, platform, dict(jax_config or {})
    self.compile_cache = compile_cache  # the trainer's compile_cache_dir, expanded here
    self.workers: dict = {}
    self._checkpointers: dict = {}
    # Before JAX starts its backend; this process's own device count comes with initialize.
    platforms.prepare_process(platform)

  def info(self) -> dict:
    return {"pid": os.getpid(), "node": _node_ip()}

  def coordinator_address(self) -> str:
    """host:port for the jax.distributed coordinator (process 0 serves it)."""
    ip = _node_ip()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
      s.bind((ip, 0))
      port = s.getsockname()[1]
    return f"{ip}:{port}"

  def initialize(self, coordinator: str, timeout_s: int) -> dict:
    import jax
    platforms.set_local_devices(self.platform, self.devices)
    for key, value in self.jax_config.items():
      jax.config.update(key, value)
    use_compile_cache(self.compile_cache)
    if self.num_processes > 1:
      # A one-process pool stays a plain JAX process: its devices then talk through XLA's
      # in-process collectives instead of the distributed (gloo/NCCL) ones.
      jax.distributed.initialize(coordinator, self.num_processes, self.process_id,
                                 initialization_timeout=int(timeout_s))
    if jax.local_device_count() != self.devices:
      raise RuntimeError(f"pool {self.pool!r} process {self.process_id}: expected "
                         f"{self.devices} local devices, JAX sees {jax.local_device_count()}")
    return {"global_devices": jax.device_count(), "local_devices": jax.local_device_count()}

  # -- reuse by a later backend (ray_backend.reuse) -------------------------------------------
  def release(self) -> int:
    """Drops the role workers, the stream and the checkpointers, so that a later backend's
    roles start from what a fresh process holds (the compiled programs stay); returns the
    bytes of JAX arrays still alive here."""
    import gc

    import jax
    for ckpt in self._checkpointers.values():
      ckpt.close()
    self._checkpointers.clear()
    self.workers.clear()
    gc.collect()  # frees the workers' device buffers now, not at some later collection
    return sum(a.nbytes for a in jax.live_arrays())

  def adopt(self, pool: str) -> int:
    """Joins pool `pool` (a later backend's name for it); returns this process's pid."""
    if self.workers:
      raise RuntimeError(f"pool {self.pool!r} process {self.process_id}: adopted while it "
                         "still holds role workers")
    self.pool = pool
    return os.getpid()

  # -- roles ----------------------------------------------------------------------------------
  def build(self, builder, *args) -> dict:
    """builder(devices, *args) -> {role: worker} on the pool's global devices."""
    import jax
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    devices = jax.devices()
    workers = builder(devices, *args)
    home = NamedSharding(Mesh(np.asarray(devices), ("pool",)), P())
    for worker in workers.values():
      if hasattr(worker, "home"):
        worker.home = home
    self.workers.update(workers)
    return {role: _describe(w) for role, w in workers.items()}

  def call(self, role: str, method: str, payload: tuple):
    """payload: (args, kwargs) on the host, as `transport.to_wire` made them."""
    from hflax.controller.ray_backend.transport import from_wire, to_host
    args, kwargs = payload
    out = getattr(self.workers[role], method)(*from_wire(args), **from_wire(kwargs))
    out = to_host(out)  # collective where needed: every member converts
    return out if self.process_id == 0 else None

  # -- the split placement's weight sync (ray_backend.split) ------------------------------------
  def trainer_weights(self, role: str, draw_key: bool):
    """The train pool's side: the actor's weights (and next key) as host values."""
    from hflax.controller.ray_backend.split import trainer_weights
    out = trainer_weights(self.workers[role], draw_key)  # collective where needed
    return out if self.process_id == 0 else None

  def generate_with(self, role: str, weights: dict, payload: tuple):
    """The rollout pool's side: `weights` is the train pool's process 0's answer (Ray
    resolves the ref it was passed as), payload the generation's (args, kwargs)."""
    from hflax.controller.ray_backend.transport import from_wire, to_host
    args, kwargs = payload
    out = to_host(self.workers[role].generate_with(weights, *from_wire(args),
                                                   **from_wire(kwargs)))
    return out if self.process_id == 0 else None

  def open_stream(self, role: str, settings: dict) -> bool:
    """trainer.mode = "async": the stream's host beside worker `role` (a split's replica
    opens its own; the actor on its own pool gets a StreamHost over it), then called as
    the worker STREAM (ray_backend.stream.RemoteStream)."""
    from hflax.controller.stream_host import StreamHost
    worker = self.workers[role]
    opener = getattr(worker, "open_stream", None)
    self.workers[STREAM] = opener(settings) if opener else StreamHost(worker, **settings)
    return True

  def sync_stream(self, role: str, weights: dict):
    """The stream's weight sync: `weights` is the train pool's process 0's answer."""
    from hflax.controller.ray_backend.transport import to_host
    out = to_host(self.workers[role].sync_stream(weights))
    return out if self.process_id == 0 else None

  def get(self, role: str, attribute: str):
    from hflax.controller.ray_backend.transport import to_host
    out = to_host(getattr(self.workers[role], attribute))
    return out if self.process_id == 0 else None

  # -- checkpoints (orbax, written by every process of the pool) ------------------------------
  def _checkpointer(self, directory: str, keep: int):
    from hflax.checkpoint import Checkpointer
    if directory not in self._checkpointers:
      self._checkpointers[directory] = Checkpointer(directory, keep=keep, save_every=1)
    return self._checkpointers[directory]

  def _drop_after(self, ckpt, step: int):
    """Removes steps newer than `step`: a save the driver never recorded (it died midway)."""
    for newer in [s for s in ckpt.all_steps() if s > step]:
      ckpt._manager.delete(newer)  # noqa: SLF001 - every process calls it; orbax coordinates
    ckpt._manager.reload()  # noqa: SLF001

  def save(self, directory: str, keep: int, step: int, roles: list[str]) -> dict:
    ckpt = self._checkpointer(directory, keep)
    self._drop_after(ckpt, step - 1)
    arrays = {f"{role}_{k}": v for role in roles
              for k, v in self.workers[role].checkpoint_arrays().items()}
    ckpt.save(step, arrays, {}, force=True)
    ckpt.wait_until_finished()
    return self.counters(roles)

  def restore(self, directory: str, keep: int, step: int, roles: list[str], counters: dict):
    ckpt = self._checkpointer(directory, keep)
    self._drop_after(ckpt, step)
    targets = {f"{role}_{k}": v for role in roles
               for k, v in self.workers[role].checkpoint_arrays().items()}
    arrays, _ = ckpt.restore(step, targets)
    for role in roles:
      self.workers[role].restore_checkpoint(
          {k: arrays[f"{role}_{k}"] for k in ("params", "opt_state")}, counters[role], step)
    return True

  def counters(self, roles: list[str]) -> dict:
    return {role: self.workers[role].checkpoint_counters() for role in roles}


def _describe(worker) -> dict:
  """What the driver's handle needs without a round trip: methods and a few settings."""
  methods = sorted(name for name in dir(type(worker)) if not name.startswith("_")
                   and callable(getattr(type(worker), name, None)))
  info = {"methods": methods, "type": type(worker).__name__}
  if hasattr(worker, "sampling"):
    info["sampling"] = worker.sampling
  if hasattr(worker, "engine"):
    info["generate_mesh_shape"] = dict(worker.engine.mesh.shape)
  if hasattr(worker, "mesh"):
    info["mesh_shape"] = dict(worker.mesh.shape)
  return info
