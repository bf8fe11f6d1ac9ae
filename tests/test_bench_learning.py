"""bench/learning.py's smoke run (the toy model, one step, hflax's modes; the benchmark
itself runs on a quiet machine): every run prints its curve and its row of the table, the
JSON holds the curves from step 0, and the goal's report reads both sides' curves."""
import importlib.util
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _module():
  spec = importlib.util.spec_from_file_location("learning", os.path.join(ROOT, "bench",
                                                                         "learning.py"))
  module = importlib.util.module_from_spec(spec)
  sys.path.insert(0, os.path.join(ROOT, "bench"))
  spec.loader.exec_module(module)
  return module


def test_learning_smoke_writes_the_curves(tmp_path):
  out = tmp_path / "learning.json"
  # The real core count, with the suite's compile-speed XLA options: what prints, not how fast.
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  env["XLA_FLAGS"] = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                              if not f.startswith("--xla_force_host_platform_device_count"))
  done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "learning.py"), "--toy",
                         "--steps", "1", "--val-every", "1", "--val-prompts", "8",
                         "--modes", "sync,async", "--json", str(out)],
                        env=env, capture_output=True, text=True, timeout=900, cwd=ROOT)
  assert done.returncode == 0, done.stderr[-3000:]
  for name in ("hflax sync", "hflax async"):
    assert f"{name}: step 0 " in done.stdout and f"\n{name} | " in done.stdout
  assert "matmul peak before" in done.stdout and "matmul peak after" in done.stdout
  run = json.loads(out.read_text())
  assert [r["name"] for r in run["runs"]] == ["hflax sync", "hflax async"]
  for r in run["runs"]:
    assert [p["step"] for p in r["curve"]] == [0, 1]
    assert all(0 <= p["accuracy"] <= 1 and p["seconds"] >= 0 for p in r["curve"])
  # No TRL run, no goal figure: the stale mode's curve per step against sync's instead.
  (figure,) = run["figures"]
  accuracy = {r["name"]: r["curve"][1]["accuracy"] for r in run["runs"]}
  assert figure["target"] == "learning_stale_per_step" and figure["unit"].endswith("steps 1")
  assert (figure["hflax"], figure["peer"]) == (round(accuracy["hflax async"], 4),
                                               round(accuracy["hflax sync"], 4))


def test_the_goal_is_read_from_the_curves():
  learning = _module()
  trl = {"name": "TRL GRPOTrainer", "curve": [
      {"step": 0, "accuracy": 0.2, "seconds": 0.0}, {"step": 2, "accuracy": 0.5, "seconds": 90.0},
      {"step": 4, "accuracy": 0.4, "seconds": 180.0}]}
  fast = {"name": "hflax async", "curve": [
      {"step": 0, "accuracy": 0.2, "seconds": 0.0}, {"step": 2, "accuracy": 0.45, "seconds": 20.0}]}
  slow = {"name": "hflax sync", "curve": [
      {"step": 0, "accuracy": 0.2, "seconds": 0.0}, {"step": 2, "accuracy": 0.3, "seconds": 30.0}]}
  table, figure = learning.report([slow, fast, trl], [0.3, 0.5])
  # TRL's final accuracy 0.4, first reached at 90 s; async reaches it at 20 s, sync never.
  assert figure["peer"] == 90.0 and figure["hflax"] == 20.0 and figure["ratio"] == 4.5
  assert figure["hflax_name"] == "hflax async" and "4.50x (>= 3x: PASS)" in table
  assert "hflax sync | 0.300 | 30.0 | 30.0 | -" in table


def test_without_trl_the_stale_curve_is_compared_with_sync_per_step():
  learning = _module()
  sync = {"name": "hflax sync", "curve": [
      {"step": 0, "accuracy": 0.2, "seconds": 0.0}, {"step": 4, "accuracy": 0.5, "seconds": 9.0},
      {"step": 8, "accuracy": 0.7, "seconds": 18.0}]}
  stale = {"name": "hflax one_step_off (TIS token)", "curve": [
      {"step": 0, "accuracy": 0.2, "seconds": 0.0}, {"step": 4, "accuracy": 0.4, "seconds": 7.0},
      {"step": 8, "accuracy": 0.8, "seconds": 14.0}]}
  _, figure = learning.report([sync, stale], [0.5])
  assert (figure["hflax"], figure["peer"], figure["ratio"]) == (0.6, 0.6, 1.0)  # steps 4, 8
  assert figure["hflax_name"] == stale["name"] and figure["unit"].endswith("steps 4, 8")
  assert learning.report([sync], [0.5])[1] is None
