"""Checks of the `cluster` config section (the Ray backend's settings), before any work."""
from __future__ import annotations

from hflax.controller.ray_backend.config import BACKENDS, PLATFORMS, STRATEGIES


def validate_cluster(c, fail, check_int) -> None:
  """Checks c.cluster; `fail(field, why)` raises naming config.<field>."""
  k = c.cluster
  if k.backend not in BACKENDS:
    fail("cluster.backend", f"{k.backend!r} is not one of {BACKENDS}")
  for field in ("processes_per_pool", "devices_per_process", "max_restarts"):
    check_int(c, f"cluster.{field}", 0, fail)
  if k.platform not in PLATFORMS:
    fail("cluster.platform", f"{k.platform!r} is not one of {PLATFORMS}")
  for field in ("cpus_per_process", "gpus_per_process"):
    if k[field] < 0:
      fail(f"cluster.{field}", f"must be >= 0, got {k[field]!r}")
  if k.strategy not in STRATEGIES:
    fail("cluster.strategy", f"{k.strategy!r} is not one of {STRATEGIES}")
  if k.strategy and k.cpus_per_process <= 0 and k.gpus_per_process <= 0:
    fail("cluster.strategy", "a placement-group strategy needs cluster.cpus_per_process or "
         "cluster.gpus_per_process > 0 (Ray bundles cannot be empty)")
  if k.init_timeout_s <= 0:
    fail("cluster.init_timeout_s", f"must be > 0, got {k.init_timeout_s!r}")
  if k.backend == "ray":
    if c.placement.kind == "auto":
      fail("placement.kind", "'auto' measures the local devices; with cluster.backend='ray' "
           "use 'colocated', 'standalone' or 'custom' (python -m hflax.launch.plan prints "
           "the custom placement of the best plan)")
    if c.placement.kind in ("colocated", "standalone") and not c.trainer.devices:
      fail("trainer.devices", f"placement.kind={c.placement.kind!r} with cluster.backend='ray' "
           "needs the number of devices the cluster provides for the run")
