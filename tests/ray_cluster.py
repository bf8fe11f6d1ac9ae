"""The tests' Ray cluster: a loopback-only RaySession started without Ray's idle workers."""
import os

IDLE_WORKERS = "RAY_prestart_worker_first_driver"


def loopback_session():
  """A RaySession on this host (the caller closes it). Ray prestarts an idle worker per CPU
  for tasks when the first driver connects; hflax's pools start actors with an environment
  of their own, which never use them (about a second of CPU each), so none are started."""
  import ml_collections
  from hflax.controller.ray_backend.session import RaySession
  before = os.environ.get(IDLE_WORKERS)
  os.environ[IDLE_WORKERS] = "0"
  try:
    return RaySession(ml_collections.ConfigDict(dict(
        address="", require_loopback=True, temp_dir="", log_to_driver=False)))
  finally:
    if before is None:
      del os.environ[IDLE_WORKERS]
    else:
      os.environ[IDLE_WORKERS] = before


def on_loopback_only():
  """A Ray test module's mark: it runs only where Ray is installed and the network is
  loopback only (Ray must never listen beyond it); elsewhere the module skips, saying how
  to run it. Call at module level: a missing Ray skips the module there and then."""
  import pytest
  pytest.importorskip("ray", reason="Ray is not installed (pip install 'ray[default]')")
  from hflax.controller.ray_backend.session import loopback_only_reason
  reason = loopback_only_reason()
  return pytest.mark.skipif(
      reason is not None,
      reason=f"Ray tests run only in a loopback-only network namespace ({reason}); "
             "run them as ../shared/bin/netless python -m pytest tests/test_ray*.py")
