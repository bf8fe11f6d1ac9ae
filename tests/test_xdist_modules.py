"""The suite's xdist scheduling (tests/xdist_modules.py): the slow modules' tests first, the
modules with costly module fixtures whole in one worker, every other test on its own."""
import os
import subprocess
import sys

import pytest

pytest.importorskip("xdist")

from xdist_modules import KEEP_TOGETHER, SLOWEST_FIRST, queue_order  # noqa: E402

TESTS = os.path.dirname(os.path.abspath(__file__))


def test_slow_modules_first_in_their_order_and_kept_modules_as_one_unit():
  slow_a, slow_b = SLOWEST_FIRST[1], SLOWEST_FIRST[0]
  kept = next(m for m in KEEP_TOGETHER if m not in (slow_a, slow_b))
  ids = ["tests/test_small.py::a", f"tests/{slow_a}::x", f"tests/{kept}::a",
         "tests/test_big.py::a", "tests/test_big.py::b", f"tests/{kept}::b",
         f"tests/{slow_b}::y", f"tests/{slow_b}::z"]
  assert queue_order(ids) == [
      f"tests/{slow_b}::y", f"tests/{slow_b}::z",
      f"tests/{slow_a}" if slow_a in KEEP_TOGETHER else f"tests/{slow_a}::x",
      f"tests/{kept}",  # later in SLOWEST_FIRST than both
      "tests/test_small.py::a", "tests/test_big.py::a", "tests/test_big.py::b"]


def test_a_run_with_two_workers_keeps_a_kept_module_in_one_worker(tmp_path):
  """A throwaway suite run with `-n 2` through this scheduler: the module named like a
  KEEP_TOGETHER one reports all its tests from one worker, and both workers run tests."""
  kept = KEEP_TOGETHER[0]
  for name, count in (("test_aa.py", 6), (kept, 6)):
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
  assert len(ran) == 12, done.stdout[-3000:]
  workers = {}
  for module, _, worker in ran:
    workers.setdefault(module, set()).add(worker)
  assert len(workers[kept[:-3]]) == 1, workers
  assert len(set.union(*workers.values())) == 2, workers
