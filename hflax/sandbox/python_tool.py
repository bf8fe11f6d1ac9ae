"""A code interpreter a policy can call: Python in a jailed process, its errors as text.

Each call runs the model's code in a fresh interpreter (started without a fork of the
caller, which holds JAX's threads and gigabytes) inside its own temporary directory, with:
- limits: CPU seconds, address space, size of any file written, wall-clock seconds (the
  process group is killed), and bytes of output kept (the rest cut, the process killed);
- no network: a network namespace of its own where the kernel allows one (loopback only,
  and down), and every socket refused;
- no other processes: fork, exec, spawn and subprocess refused (RLIMIT_NPROC does not
  bind root, so the refusal does);
- its directory only: files outside it can be read only under Python's own installation
  (for imports) and written nowhere; directory listings outside it refused.
The refusals are an audit hook (PEP 578) installed before the code runs: code cannot
remove it, and ctypes, the way around it, is refused too. What comes back to the model
is text: the output, or the error, the limit hit, or how the process ended.

PythonTool starts each jail from a worker of hflax.sandbox's ProcessPool, the mechanism
user reward code runs in: the trainer (gigabytes, JAX's threads) never forks, and a jail
the worker fails to reap still ends at the pool's own time limit, its worker replaced.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

from hflax.sandbox.pool import ProcessPool, exit_status


@dataclasses.dataclass(frozen=True)
class Limits:
  cpu_s: int = 10
  wall_s: float = 20.0
  memory_bytes: int = 1 << 30
  file_bytes: int = 16 << 20
  output_bytes: int = 16 << 10


@dataclasses.dataclass(frozen=True)
class RunResult:
  output: str  # stdout then stderr, cut at the output limit
  exitcode: int | None  # None: killed by the wall-clock limit or the output limit
  timed_out: bool = False
  truncated: bool = False
  seconds: float = 0.0

  @property
  def ok(self) -> bool:
    return self.exitcode == 0 and not self.timed_out and not self.truncated

  def text(self) -> str:
    """What the model reads."""
    notes = []
    if self.timed_out or self.exitcode == -signal.SIGXCPU:  # wall clock or CPU seconds
      notes.append("Error: the code ran past its time limit and was stopped")
    elif self.truncated:
      notes.append("Error: the output passed its size limit; the process was stopped")
    elif self.exitcode not in (0, None):
      notes.append(f"Error: the process ended ({exit_status(self.exitcode)})")
    return "\n".join([self.output.rstrip()] + notes).strip() or "(no output)"


# Runs inside the jailed interpreter (python -I -c), its limits as argv[1] in JSON.
_JAIL = r'''
import json, os, resource, sys
limits = json.loads(sys.argv[1])
for name, value in (("RLIMIT_CPU", limits["cpu_s"]), ("RLIMIT_AS", limits["memory_bytes"]),
                    ("RLIMIT_FSIZE", limits["file_bytes"]), ("RLIMIT_CORE", 0),
                    ("RLIMIT_NPROC", 64)):
  # CPU: SIGXCPU at the soft limit (read back as a time limit), SIGKILL a second later.
  resource.setrlimit(getattr(resource, name), (value, value + (name == "RLIMIT_CPU")))
try:  # a network namespace of its own: no interface but a loopback that is down
  import ctypes
  if ctypes.CDLL(None, use_errno=True).unshare(0x40000000) != 0:  # CLONE_NEWNET
    pass  # not allowed here: every socket is refused below all the same
except Exception:
  pass
home = os.path.realpath(os.getcwd())
readable = tuple(sorted({os.path.realpath(p) for p in (sys.prefix, sys.base_prefix,
                                                       sys.exec_prefix)}))
WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
REFUSED = {"socket.__new__": "network access", "socket.getaddrinfo": "network access",
           "os.fork": "new processes", "os.forkpty": "new processes",
           "os.system": "new processes", "os.exec": "new processes",
           "os.posix_spawn": "new processes", "os.spawn": "new processes",
           "subprocess.Popen": "new processes", "pty.spawn": "new processes",
           "ctypes.dlopen": "ctypes", "ctypes.dlsym": "ctypes", "ctypes.cdata": "ctypes",
           "os.kill": "signals", "os.killpg": "signals", "sys.addaudithook": "audit hooks"}
WRITES = {"os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.symlink", "os.link",
          "os.truncate", "os.chmod", "os.chown", "os.utime", "shutil.rmtree", "os.chdir"}
LISTINGS = {"os.listdir", "os.scandir"}  # imports list Python's own directories

def inside(path, allowed):
  path = os.path.realpath(os.fsdecode(path))
  return any(path == a or path.startswith(a + os.sep) for a in allowed)

def hook(event, args):
  if event in REFUSED:
    raise PermissionError(f"sandbox: {REFUSED[event]} refused")
  if event == "open":
    path, mode, flags = args
    if path is None or isinstance(path, int):
      return
    writes = any(c in (mode or "") for c in "wax+") or bool(flags & WRITE_FLAGS)
    if not inside(path, (home,) if writes else (home,) + readable):
      raise PermissionError(f"sandbox: {os.fsdecode(path)!r} is outside the tool's directory")
  elif event in WRITES or event in LISTINGS:
    allowed = (home,) if event in WRITES else (home,) + readable
    for path in args[:2]:
      if isinstance(path, (str, bytes, os.PathLike)) and not inside(path, allowed):
        raise PermissionError(f"sandbox: {os.fsdecode(path)!r} is outside the tool's directory")

import runpy, traceback
sys.addaudithook(hook)
del ctypes
sys.argv = ["main.py"]
try:
  runpy.run_path("main.py", run_name="__main__")
except SystemExit:
  raise
except BaseException as e:  # the model reads its own frames only, not the jail's
  tb = e.__traceback__
  while tb is not None and tb.tb_frame.f_code.co_filename != "main.py":
    tb = tb.tb_next
  traceback.print_exception(type(e), e, tb)
  sys.exit(1)
'''


def run_python(code: str, limits: Limits = Limits()) -> RunResult:
  """Runs `code` in a jailed interpreter (module docstring) and returns its output."""
  workdir = tempfile.mkdtemp(prefix="hflax-python-tool-")
  try:
    with open(os.path.join(workdir, "main.py"), "w", encoding="utf-8") as f:
      f.write(code)
    env = {"PATH": "/usr/bin:/bin", "HOME": workdir, "TMPDIR": workdir, "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONIOENCODING": "utf-8"}
    began = time.monotonic()
    process = subprocess.Popen(
        [sys.executable, "-I", "-c", _JAIL, json.dumps(dataclasses.asdict(limits))],
        cwd=workdir, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True, close_fds=True)
    output, truncated, timed_out = _read_capped(process, limits.output_bytes,
                                                began + limits.wall_s)
    if not (timed_out or truncated):
      try:  # the output closed: the process is ending
        process.wait(max(0.1, began + limits.wall_s - time.monotonic()))
      except subprocess.TimeoutExpired:  # it closed its output and went on
        timed_out = True
        _kill_group(process)
    seconds = time.monotonic() - began
    return RunResult(output.decode("utf-8", "replace"),
                     None if (timed_out or truncated) else process.returncode,
                     timed_out, truncated, seconds)
  finally:
    shutil.rmtree(workdir, ignore_errors=True)


def _read_capped(process, limit: int, deadline: float) -> tuple[bytes, bool, bool]:
  """The process's output up to `limit` bytes, read on a thread while the wall clock runs;
  (bytes, whether it passed the limit, whether the deadline passed). The process group is
  killed at either."""
  chunks, total, over = [], 0, threading.Event()

  def read():
    nonlocal total
    for chunk in iter(lambda: process.stdout.read1(65536), b""):
      chunks.append(chunk)
      total += len(chunk)
      if total > limit:
        over.set()
        _kill_group(process)
        return

  reader = threading.Thread(target=read, daemon=True)
  reader.start()
  reader.join(max(0.0, deadline - time.monotonic()))
  timed_out = reader.is_alive()
  if timed_out:
    _kill_group(process)
    reader.join()
  return b"".join(chunks)[:limit], over.is_set(), timed_out and not over.is_set()


def _kill_group(process):
  try:
    os.killpg(process.pid, 9)
  except (ProcessLookupError, PermissionError):
    pass
  process.wait()


def run_python_text(code: str, limits: Limits) -> str:
  """run_python's text: what a pool worker returns for the model to read."""
  return run_python(code, limits).text()


_POOL = None
_POOL_LOCK = threading.Lock()


def shared_pool(workers: int = 4) -> ProcessPool:
  """The process's pool of tool workers (started at first use): at most `workers` jails
  run at once, the agent loop's other tool calls waiting for one."""
  global _POOL
  with _POOL_LOCK:
    if _POOL is None or _POOL.closed:
      _POOL = ProcessPool(workers)
    return _POOL


class PythonTool:
  """The code interpreter as a tool (hflax.rollout.agents): {"code": "..."} in, the
  program's output (print what you need) or its error out. pool: the ProcessPool whose
  workers start the jails (default: shared_pool())."""
  name = "python"

  def __init__(self, limits: Limits = Limits(), pool: ProcessPool | None = None):
    self.limits, self._pool = limits, pool

  @property
  def schema(self) -> dict:
    return {"type": "function", "function": {
        "name": self.name,
        "description": "Runs a Python program and returns what it prints. No network, no "
                       "files outside its own directory; print the result you need.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                       "required": ["code"]}}}

  def execute(self, arguments: dict) -> str:
    code = arguments.get("code")
    if not isinstance(code, str):
      return "Error: python needs {\"code\": \"<program>\"}"
    pool = self._pool or shared_pool()
    # The worker's own limit: the jail's wall clock, with time to start and reap it.
    outcome = pool.call(run_python_text, code, self.limits, timeout_s=self.limits.wall_s + 10)
    if outcome.ok:
      return outcome.value
    return f"Error: the tool's worker {outcome.describe()}"
