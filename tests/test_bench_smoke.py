"""The CPU benchmarks' smoke runs print every row they promise.

They run on the toy model (--toy): the real SmolLM2's quick runs took 15-21 minutes on the
shared 2-core machine (each hflax program of the 135M model compiles for 1-2.5 minutes there),
too long for the suite; the toy runs took 3 minutes each.
Each script runs in a process of its own, on the real core count: the suite's simulated
devices would skew them and JAX's device count is fixed once a process starts. It compiles
with the suite's compile-speed XLA options (tests/conftest.py): a smoke run checks what
prints, not how fast, and its time is mostly XLA compiling."""
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def bench_env() -> dict:
  """This process's environment less the simulated device count in XLA_FLAGS: the other
  XLA options (the suite's compile-speed ones) go on to the benchmark's process."""
  flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
           if not f.startswith("--xla_force_host_platform_device_count")]
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  return {**env, "XLA_FLAGS": " ".join(flags)}


def run(script: str, *args: str) -> str:
  done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", script), *args],
                        env=bench_env(), capture_output=True, text=True, timeout=900, cwd=ROOT)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def test_rl_step_quick_prints_every_row(tmp_path):
  pytest.importorskip("trl", reason="TRL is rl_step.py's peer, in the bench extra: "
                      "pip install -e '.[bench]' -c constraints.txt")
  saved = str(tmp_path / "run.json")
  # A smaller random model than --toy's 10.5M parameters: the rows do not depend on its size.
  out = run("rl_step.py", "--quick", "--toy", "--hidden", "64", "--layers", "2", "--heads", "2",
            "--kv-heads", "1", "--intermediate", "128", "--peak-size", "256", "--json", saved)
  again = run("rl_step.py", "--report", saved)  # the same tables, read back from the JSON
  rows = lambda text: [line for line in text.splitlines() if " | " in line]  # noqa: E731
  assert rows(again) == rows(out) and "peak resident memory" not in again
  for precision, compute in (("fp32", "float32"), ("bf16", "bfloat16")):
    assert f"[{precision}] GRPO step" in out
    # the peak is measured after each timed step and before/after the pair
    assert f"[{precision}] {compute} matmul peak (" in out and "after each timed step" in out
    assert "before/after the pair: fp32" in out
    assert f"update, {precision} | hflax at" in out
  lines = [line for line in out.splitlines() if line.strip().startswith(("hflax |", "TRL |"))]
  assert len(lines) == 4  # both frameworks in both precisions
  for line in lines:  # tokens/s, step, stage times, GFLOP/s, peak RSS: all numbers
    cells = [c.strip() for c in line.split("|")]
    assert float(cells[1]) > 0 and float(cells[-1]) > 0
  assert "same numerics (fp32 vs fp32)" in out
  assert "best: hflax" in out
  assert "peak resident memory of the process" in out and "load average" in out


def test_generate_quick_prints_every_row():
  out = run("generate.py", "--quick", "--toy", "--toy-layers", "1", "--batches", "2", "64",
            "--new-tokens", "8")
  rows = [line for line in out.splitlines() if line.strip().startswith(("fp32 |", "bf16 |"))]
  # 2 precisions x 2 batches x (1 device + data-parallel over the cores when there are several)
  assert len(rows) == 4 * (2 if (os.cpu_count() or 1) > 1 else 1)
  for line in rows:
    cells = [c.strip() for c in line.split("|")]
    assert float(cells[3]) > 0 and float(cells[4]) > 0 and cells[5].endswith("x")
    if "64 prompts" in line:
      assert cells[7] in ("PASS", "MISS") and cells[10] in ("PASS", "MISS")
  assert "[fp32] matmul peak (float32)" in out and "[bf16] matmul peak (bfloat16)" in out
  # The weight matmuls alone, one line per row above: positive times, a call's share, a ceiling.
  floors = re.findall(r"^  (fp32|bf16) batch (\d+), hflax.*: decode ([\d.]+) ms/step, prefill "
                      r"(\d+) ms: ([\d.]+) s a call, (\d+)% of hflax's .* is ([\d.]+)x that",
                      out, re.M)
  assert len(floors) == len(rows)
  assert all(float(f[2]) > 0 and float(f[4]) > 0 and float(f[6]) > 0 for f in floors)
  assert "peak resident memory of the process" in out


def test_generate_samples_with_filters_on_both_sides():
  out = run("generate.py", "--quick", "--toy", "--toy-layers", "1", "--precision", "fp32",
            "--batches", "2", "--new-tokens", "8", "--cpu-devices", "1", "--no-breakdown",
            "--temperature", "0.7", "--top-k", "5", "--top-p", "0.9")
  assert "Sampled generation (temperature 0.7, top_k 5, top_p 0.9" in out
  rows = [line for line in out.splitlines() if line.strip().startswith("fp32 |")]
  assert len(rows) == 1 and float(rows[0].split("|")[3]) > 0
  greedy_filter = subprocess.run(
      [sys.executable, os.path.join(ROOT, "bench", "generate.py"), "--quick", "--toy",
       "--top-p", "0.9"], capture_output=True, text=True, timeout=300, cwd=ROOT)
  assert greedy_filter.returncode != 0
  assert "--top-k/--top-p: sampling only, set --temperature > 0" in greedy_filter.stderr


def test_agents_smoke_prints_every_row_and_writes_a_results_record(tmp_path):
  """bench/agents.py --smoke: the three runs (instant, slow tools, re-prefill) sample the
  same tokens, the slow tools' ratio and the re-prefill cost are printed, and the record
  has every key bench/results_table.py's table needs."""
  import importlib.util
  import json
  saved = tmp_path / "agents.json"
  out = run("agents.py", "--smoke", "--machine", "vm", "--json", str(saved))
  rows = [line for line in out.splitlines() if " | " in line and line.strip().startswith(
      ("instant ", "slow tools ", "re-prefill "))]
  assert len(rows) == 3 and all(line.endswith("same tokens: True") for line in rows)
  assert re.search(r"slow tools / instant: [\d.]+x \(target <= 1.3x: (PASS|MISS)\)", out)
  assert re.search(r"re-prefill / kept cache: [\d.]+x the time, [\d.]+x the prefilled", out)
  assert "float32 matmul peak before/after" in out
  spec = importlib.util.spec_from_file_location("results_table",
                                                os.path.join(ROOT, "bench", "results_table.py"))
  table = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(table)
  record = json.loads(saved.read_text())
  assert all(k in record for k in table.RUN_KEYS) and record["machine"] in table.MACHINES
  assert [f["target"] for f in record["figures"]] == ["agents_slow_tools", "agents_reprefill"]
  for figure in record["figures"]:
    assert all(k in figure for k in table.FIGURE_KEYS) and figure["target"] in table.TARGETS
    assert figure["hflax"] > 0 and figure["peer"] > 0 and figure["ratio"] > 0
  runs = record["runs"]
  # Re-prefilling prefills every turn's whole context: more tokens than the kept cache.
  assert runs["re-prefill"]["prefilled_tokens"] > runs["instant"]["prefilled_tokens"]
  assert runs["slow tools"]["tool_wait_seconds"] >= 0 and len(record["matmul_peak_fp32_gflops"]) == 2
