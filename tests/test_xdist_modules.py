"""The suite's xdist scheduling (tests/xdist_modules.py): each module runs whole in one
worker, the listed slow modules start first, the rest by test count."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("xdist")

from xdist_modules import SLOWEST_FIRST, queue_order  # noqa: E402
TESTS = os.path.dirname(os.path.abspath(__file__))


def test_listed_modules_first_in_their_order_then_by_test_count():
  slow_a, slow_b = SLOWEST_FIRST[1], SLOWEST_FIRST[0]
  ids = ["tests/test_small.py::a", f"tests/{slow_a}::x", "tests/test_big.py::a",
         "tests/test_big.py::b", "tests/test_tie.py::a", f"tests/{slow_b}::y"]
  assert queue_order(ids) == [f"tests/{slow_b}", f"tests/{slow_a}", "tests/test_big.py",
                              "tests/test_small.py", "tests/test_tie.py"]


def test_a_run_with_two_workers_keeps_each_module_in_one_worker(tmp_path):
  """A throwaway suite of three modules (one named like a listed slow module) run with
  `-n 2` through this scheduler: every module's tests report from one worker, and both
  workers run some."""
  slow = SLOWEST_FIRST[0]
  for name, count in (("test_aa.py", 6), ("test_bb.py", 3), (slow, 2)):
    (tmp_path / name).write_text("".join(
        f"def test_{i}(worker_id):\n  print('RAN', __name__, {i}, worker_id)\n"
        for i in range(count)))
  (tmp_path / "conftest.py").write_text(
      "import sys\n"
      f"sys.path.insert(0, {TESTS!r})\n"
      "from xdist_modules import make_scheduler\n\n"
      "def pytest_xdist_make_scheduler(config, log):\n"
      "  return make_scheduler(config, log)\n")
  done = subprocess.run(
      [sys.executable, "-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "-rP", "-q",
       str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
      env={k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"})
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  ran = [line.split()[1:] for line in done.stdout.splitlines() if line.startswith("RAN ")]
  assert len(ran) == 11, done.stdout[-3000:]
  workers = {}
  for module, _, worker in ran:
    workers.setdefault(module, set()).add(worker)
  assert all(len(w) == 1 for w in workers.values()), workers
  assert len(set.union(*workers.values())) == 2  # and both workers had modules to run
