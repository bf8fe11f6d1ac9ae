"""calibrate(): a DeviceProfile measured on the local (simulated CPU) devices, cached."""
import json
import os

import jax

from hflax.sharding import automap
from hflax.sharding.automap import calibration


def test_calibrate_measures_positive_numbers_and_caches(tmp_path, monkeypatch):
  path = tmp_path / "profile.json"
  prof = automap.calibrate(path=str(path))
  assert path.exists()
  for field in ("peak_flops", "memory_bandwidth", "intra_node_bandwidth",
                "inter_node_bandwidth", "memory_bytes", "collective_latency"):
    assert getattr(prof, field) > 0, field
  assert prof.devices_per_node == jax.device_count() == 8
  assert prof.call_overhead > 0 and prof.call_overhead_per_device >= 0
  if (os.cpu_count() or 1) <= 4:  # 8 simulated devices on a few cores share them
    assert prof.shared_compute
  if prof.shared_compute:
    assert 1.0 <= prof.host_concurrency <= min(2.0, len(os.sched_getaffinity(0)))
  assert json.loads(path.read_text())["peak_flops"] == prof.peak_flops
  # A second call reads the cache instead of measuring again.
  monkeypatch.setattr(calibration, "measure",
                      lambda *a, **k: (_ for _ in ()).throw(AssertionError("re-measured")))
  assert automap.calibrate(path=str(path)) == prof


def test_cache_path_changes_with_the_cores_this_process_may_use(monkeypatch):
  devices = jax.devices()
  path = calibration.default_cache_path(devices)
  assert path == calibration.default_cache_path(devices)
  other = set(range((os.cpu_count() or 1) + 1))  # a core count this process does not have
  monkeypatch.setattr(os, "sched_getaffinity", lambda pid: other, raising=False)
  assert calibration.default_cache_path(devices) != path  # a profile from other cores


def test_presets_name_their_source():
  for name, prof in automap.PRESETS.items():
    assert prof.name == name and prof.source
    assert prof.peak_flops > 1e14 and prof.memory_bytes > 1e10
    assert prof.intra_node_bandwidth > prof.inter_node_bandwidth
