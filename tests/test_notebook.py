"""The quickstart notebook runs top to bottom (its code cells, in a fresh process), its GRPO
demo learns, and it leaves nothing behind."""
import json
import os
import re
import subprocess
import sys

from conftest import TEST_ONLY_XLA_FLAGS

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_notebook_executes(tmp_path):
  with open(os.path.join(ROOT, "notebooks", "quickstart.ipynb")) as f:
    cells = json.load(f)["cells"]
  code = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
  script = tmp_path / "quickstart.py"
  script.write_text(code)
  temp = tmp_path / "tmp"
  temp.mkdir()
  # XLA_FLAGS stays as conftest set it (8 devices), like a runtime that sets XLA_FLAGS itself
  # (Colab does): the notebook must put its own device count (4) in. Its tempfile run
  # directory goes under TMPDIR, where this test checks that the notebook removed it.
  env = {**os.environ, "PYTHONPATH": ROOT, "TMPDIR": str(temp)}
  assert "--xla_force_host_platform_device_count=8" in env["XLA_FLAGS"]
  # The notebook trains for minutes: compiled as users compile it, without conftest's
  # compile-speed options (at level 0 its training ran slower than it compiled faster).
  env["XLA_FLAGS"] = " ".join(flag for flag in env["XLA_FLAGS"].split()
                             if flag not in TEST_ONLY_XLA_FLAGS)
  done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                        timeout=600, env=env)
  assert done.returncode == 0, done.stderr[-3000:]
  out = done.stdout
  assert "{'actor': {'data': 1, 'fsdp': 2, 'tensor': 1}" in out
  accuracy = re.search(r"held-out accuracy: ([\d.]+) before RL -> ([\d.]+) after", out)
  assert accuracy, out[-3000:]
  before, after = float(accuracy[1]), float(accuracy[2])
  # The warm-up leaves a policy that is sometimes right, so GRPO has rewards to compare: every
  # step has some reward and non-zero advantages (all-zero rewards were the old demo's bug).
  assert before > 0, out[-3000:]
  steps = re.findall(r"step +\d+  reward ([\d.]+)  advantages \[([-+\d.]+), ([-+\d.]+)\]", out)
  assert len(steps) == 20, out[-3000:]
  assert all(float(reward) > 0 and float(high) > 0 > float(low) for reward, low, high in steps)
  # Measured: 0.548 -> 0.772 (seed 0); seeds 1-4 gain 0.07 to 0.56.
  assert after > before, out[-3000:]
  assert not list(temp.glob("hflax-notebook-*")), "the notebook left its run directory"
