"""The quickstart notebook runs top to bottom (its code cells, in a fresh process)."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_notebook_executes(tmp_path):
  with open(os.path.join(ROOT, "notebooks", "quickstart.ipynb")) as f:
    cells = json.load(f)["cells"]
  code = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
  script = tmp_path / "quickstart.py"
  script.write_text(code)
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}  # the notebook sets its own
  done = subprocess.run([sys.executable, str(script)], cwd=ROOT, capture_output=True, text=True,
                        timeout=600, env={**env, "PYTHONPATH": ROOT})
  assert done.returncode == 0, done.stderr[-3000:]
  assert "held-out accuracy" in done.stdout or "before" in done.stdout
  assert "{'actor': {'data': 1, 'fsdp': 2, 'tensor': 1}" in done.stdout
