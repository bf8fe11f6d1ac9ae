"""Starting (or joining) the Ray cluster.

Users get Ray's own defaults (ray.init's node address, temp dir, dashboard and log
forwarding unless the cluster section says otherwise). `cluster.require_loopback=True` is
this project's test setting: a local cluster is then started only inside a loopback-only
network namespace (`shared/bin/netless`), bound to 127.0.0.1, with usage stats and the
dashboard off and its files in a temp dir of its own, because Ray binds to the machine's
address and some of its components probe the network at start.
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile

SAFE_ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
            "RAY_AUTH_MODE": "disabled"}


def network_interfaces() -> list[str]:
  """Interfaces of this process's network namespace (/sys/class/net may show another's)."""
  with open("/proc/self/net/dev") as f:
    return sorted(line.split(":")[0].strip() for line in f.readlines()[2:] if ":" in line)


def loopback_only_reason() -> str | None:
  """None inside a loopback-only namespace (netless), else why this process is not in one."""
  if os.environ.get("HFLAX_NETLESS") != "1":
    return "HFLAX_NETLESS is not set: not started by shared/bin/netless"
  try:
    interfaces = network_interfaces()
  except OSError as e:
    return f"cannot read /proc/self/net/dev ({e})"
  if interfaces != ["lo"]:
    return f"network interfaces {interfaces} besides loopback are reachable"
  return None


def check_loopback(cluster) -> None:
  """Refuses to start a local cluster where Ray would reach beyond loopback (unless told)."""
  reason = None if cluster.address or not cluster.require_loopback else loopback_only_reason()
  if reason:
    raise ValueError(
        f"config.cluster.require_loopback: not starting a local Ray cluster outside a "
        f"loopback-only network namespace ({reason}); run under shared/bin/netless, "
        "join a cluster with cluster.address, or set cluster.require_loopback=False")


class RaySession:
  """ray.init with hflax's settings; `close()` shuts down what this session started."""

  def __init__(self, cluster):
    import ray
    self.started, self.temp_dir, self._own_temp = False, None, False
    if ray.is_initialized():  # e.g. a test fixture or the caller already joined a cluster
      return
    kw = dict(log_to_driver=bool(cluster.log_to_driver), logging_level=logging.WARNING)
    dashboard = getattr(cluster, "include_dashboard", None)
    if dashboard is not None:
      kw["include_dashboard"] = bool(dashboard)
    if cluster.address:
      ray.init(address=cluster.address, **kw)
    elif cluster.require_loopback:
      check_loopback(cluster)
      for key, value in SAFE_ENV.items():  # inherited by every process Ray starts from here
        os.environ.setdefault(key, value)
      kw.setdefault("include_dashboard", False)
      # A short path: Ray's unix sockets live under it (107-character limit).
      self._own_temp = not cluster.temp_dir
      self.temp_dir = cluster.temp_dir or tempfile.mkdtemp(prefix="hflax-ray-", dir="/tmp")
      ray.init(_temp_dir=self.temp_dir, _node_ip_address="127.0.0.1",
               num_cpus=os.cpu_count(), **kw)
    else:
      if cluster.temp_dir:
        kw["_temp_dir"] = cluster.temp_dir
      ray.init(**kw)
    self.started = True

  def close(self):
    import ray
    if self.started and ray.is_initialized():
      ray.shutdown()
    self.started = False
    if self._own_temp and self.temp_dir:
      shutil.rmtree(self.temp_dir, ignore_errors=True)
      self.temp_dir = None
