"""The process pool for user code: each way a call can end (returned, raised, died,
timed out), the worker replaced after a death, reused otherwise, and Ctrl-C left to the
caller."""
import ctypes
import os
import signal
import threading
import time

import pytest

from hflax.sandbox import ProcessPool, report_progress


def add(a, b):
  return a + b


def pid():
  return os.getpid()


def divide_rows(n):
  for row in range(n):
    report_progress(row)
    1 / (row - 2)  # row 2 divides by zero


def exit_at_row(n):
  for row in range(n):
    report_progress(row)
    if row == 3:
      os._exit(0)


def segfault():
  ctypes.string_at(0)


def hang():
  time.sleep(600)


def sys_exit():
  raise SystemExit(0)


def allocate():
  blocks = []
  while True:
    blocks.append(bytearray(64 << 20))


@pytest.fixture(scope="module")
def pool():
  with ProcessPool(workers=1) as p:
    yield p


def test_a_call_returns_and_the_worker_is_reused(pool):
  assert pool.call(add, 2, 3).value == 5
  assert pool.call("operator:add", 2, 3).value == 5  # by import path
  assert pool.call(pid).value == pool.call(pid).value != os.getpid()


def test_a_raise_names_the_type_message_line_and_row(pool):
  first = pool.call(pid).value
  out = pool.call(divide_rows, 5)
  assert out.kind == "raised" and out.error_type == "ZeroDivisionError"
  assert out.message == "division by zero" and out.progress == 2
  assert out.where == f"test_sandbox_pool.py:{divide_rows.__code__.co_firstlineno + 3}"
  assert out.describe().startswith("raised ZeroDivisionError: division by zero (test_sandbox")
  assert pool.call(pid).value == first  # a raise leaves the worker alive
  assert pool.call(sys_exit).error_type == "SystemExit"


@pytest.mark.parametrize("target, exitcode", [(exit_at_row, 0), (segfault, -signal.SIGSEGV)])
def test_a_dying_worker_is_reported_and_replaced(pool, target, exitcode):
  first = pool.call(pid).value
  out = pool.call(target, 10) if target is exit_at_row else pool.call(target)
  assert out.kind == "died" and out.exitcode == exitcode, out
  if target is exit_at_row:
    assert out.progress == 3 and "exit status 0" in out.describe()
  else:
    assert out.describe() == "ended its worker process (killed by SIGSEGV)"
  assert pool.call(add, 1, 1).value == 2
  assert pool.call(pid).value != first


def test_a_hang_times_out_and_the_worker_is_killed(pool):
  first = pool.call(pid).value
  began = time.monotonic()
  out = pool.call(hang, timeout_s=1)
  assert out.kind == "timed_out" and time.monotonic() - began < 10
  assert out.describe() == "timed out after 1 s (its worker process was killed)"
  assert pool.call(pid).value != first


def test_a_signal_to_the_worker_is_a_death(pool):
  worker = pool.call(pid).value
  threading.Timer(0.5, os.kill, (worker, signal.SIGKILL)).start()
  out = pool.call(hang, timeout_s=30)
  assert out.kind == "died" and out.describe() == "ended its worker process (killed by SIGKILL)"


def test_unbounded_memory_under_a_limit_is_a_raise_not_the_callers_death():
  with ProcessPool(memory_limit_bytes=1 << 30) as limited:
    out = limited.call(allocate, timeout_s=60)
    assert out.kind in ("raised", "died"), out
    assert out.kind == "died" or out.error_type == "MemoryError"
    assert limited.call(add, 1, 2).value == 3


def test_ctrl_c_while_waiting_is_the_callers_and_kills_the_busy_worker(pool):
  worker = pool.call(pid).value
  threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
  with pytest.raises(KeyboardInterrupt):
    pool.call(hang, timeout_s=30)
  with pytest.raises(ProcessLookupError):
    os.kill(worker, 0)
  assert pool.call(add, 2, 2).value == 4


def test_calls_from_threads_use_separate_workers():
  with ProcessPool(workers=2) as two:
    pids = []
    threads = [threading.Thread(target=lambda: pids.append(two.call(sleepy_pid).value))
               for _ in range(2)]
    for t in threads:
      t.start()
    for t in threads:
      t.join()
    assert len(set(pids)) == 2


def sleepy_pid():
  time.sleep(1)
  return os.getpid()


def test_a_script_without_a_main_guard_is_not_rerun_in_the_worker(tmp_path):
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script = tmp_path / "train.py"  # no `if __name__ == "__main__"`, as notebooks and scripts
  script.write_text("from hflax.sandbox import ProcessPool\n"
                    "print('script ran', flush=True)\n"
                    "print(ProcessPool().call('operator:mul', 6, 7).value)\n")
  done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                        env={**os.environ, "PYTHONPATH": root}, timeout=120)
  assert done.stdout.split("\n") == ["script ran", "42", ""], done.stderr
