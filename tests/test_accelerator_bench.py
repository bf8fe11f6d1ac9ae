"""bench/accelerator.py --smoke on CPU: every row printed, measured, and in the JSON."""
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))

import accelerator  # noqa: E402

ROWS = ("device", "peak FLOP/s (table)", "peak FLOP/s (matmul)", "actor update",
        "generate B=1", "generate B=4", "log-probs", "hybrid switch", "peak memory",
        "fused log-prob kernel")


def test_smoke_prints_every_row_and_writes_json(tmp_path):
  out = tmp_path / "acc.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # one CPU device
  # The suite's compile-speed XLA options go on: the smoke run checks rows, not speed.
  env["XLA_FLAGS"] = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                              if not f.startswith("--xla_force_host_platform_device_count"))
  env.update(JAX_PLATFORMS="cpu", HF_HUB_OFFLINE="1")
  run = subprocess.run([sys.executable, str(ROOT / "bench" / "accelerator.py"), "--smoke",
                        "--json", str(out)], capture_output=True, text=True, env=env,
                       timeout=240)
  assert run.returncode == 0, run.stderr[-2000:]
  lines = run.stdout.splitlines()
  for row in ROWS:
    assert any(f" {row} " in f" {line} " for line in lines), (row, run.stdout)
  assert "n/a: needs a GPU" in run.stdout and "n/a: cpu is not in the table" in run.stdout
  report = json.loads(out.read_text())
  assert report["backend"] == "cpu" and report["smoke"]
  assert report["peak_flops"]["table"] is None and report["peak_flops"]["measured"] > 0
  (model,) = report["models"]
  assert model["model"] == "tiny" and model["params"] == accelerator.TINY.num_params
  update = model["update"]
  assert update["seconds"] > 0 and 0 < update["mfu_measured"] < 10
  measured = update["mfu_measured"] * report["peak_flops"]["measured"]
  assert abs(update["flops_per_s"] / measured - 1) < 1e-9
  batches = [g["batch"] for g in model["generate"]]
  assert batches == [1, 4]
  for g in model["generate"]:  # greedy with no end token: every row runs to the end
    assert g["tokens"] == g["batch"] * report["shapes"]["new_tokens"] and g["tokens_per_s"] > 0
  assert model["log_probs"]["tokens_per_s"] > 0 and model["switch"]["seconds"] > 0
  memory = model["memory"]
  assert memory["device_peak_bytes"] is None  # CPU devices keep no memory_stats()
  assert 0.7 < memory["automap_update_bytes"] / memory["xla_update_bytes"] < 1.5
  assert report["kernel"]["interpret_max_abs_diff"] < 1e-4


def test_peak_table_matches_device_kinds():
  assert accelerator.table_peak("NVIDIA H100 80GB HBM3") == 989e12
  assert accelerator.table_peak("NVIDIA H200") == 989e12
  assert accelerator.table_peak("NVIDIA A100-SXM4-80GB") == 312e12
  assert accelerator.table_peak("TPU v5 lite") == 197e12
  assert accelerator.table_peak("TPU v5p") == 459e12
  assert accelerator.table_peak("TPU v6 lite") == 918e12
  assert accelerator.table_peak("TPU v4") == 275e12
  assert accelerator.table_peak("cpu") is None


def test_unknown_model_is_refused():
  with pytest.raises(ValueError, match="--models"):
    accelerator.main(["--models", "gpt-5"])
