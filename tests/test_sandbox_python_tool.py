"""The sandboxed Python tool against hostile code: every case comes back to the model as
text within its limit, the calling process carries on, and nothing is written outside."""
import json
import os
import pathlib

import pytest

from hflax.rollout.agents import ToolEnvironment, Turn
from hflax.sandbox.python_tool import Limits, PythonTool, run_python

LIMITS = Limits(cpu_s=2, wall_s=3.0, memory_bytes=256 << 20, output_bytes=4096)


@pytest.fixture(scope="module")
def env():
  return ToolEnvironment([PythonTool(LIMITS)])


def call(env, code=None, arguments=None, name="python") -> str:
  args = json.dumps({"code": code} if arguments is None else arguments)
  text = f'<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'
  obs = env.step(Turn(text, (), 0))
  assert len(obs.messages) == 1 and not obs.done
  return obs.messages[0]["content"]


def test_a_program_prints_its_result(env):
  assert call(env, "import math\nprint(math.factorial(12))") == "479001600"
  assert call(env, "open('notes.txt', 'w').write('kept')\nprint(open('notes.txt').read())") \
      == "kept"


@pytest.mark.parametrize("code, expected", [
    ("while True: pass", "ran past its time limit"),  # CPU or wall clock, whichever first
    ("import time\ntime.sleep(60)", "ran past its time limit"),
    ("x = bytearray(4 << 30)", "MemoryError"),
    ("import os\nwhile True: os.fork()", "new processes refused"),
    ("import subprocess\nsubprocess.Popen(['sh', '-c', ':(){ :|:& };:'])",
     "new processes refused"),
    ("import sys\nwhile True: sys.stdout.write('x' * 100000)", "passed its size limit"),
    ("import socket\nsocket.create_connection(('192.0.2.1', 80), timeout=1)",
     "network access refused"),
    ("import ctypes\nctypes.CDLL(None).system(b'touch /tmp/hflax-escaped')", "ctypes refused"),
    ("import os\nos._exit(0)", "(no output)"),
    ("import os\nos._exit(7)", "exit status 7"),
    ("raise ValueError('bad input')", "ValueError: bad input"),
])
def test_hostile_code_comes_back_as_text(env, code, expected):
  text = call(env, code)
  assert expected in text, text
  assert len(text) < LIMITS.output_bytes + 200


def test_only_loopback_is_visible():
  """A network namespace of its own where the kernel allows one: interfaces list loopback
  only (where it does not, creating a socket is refused all the same)."""
  text = run_python("import socket\nprint([n for _, n in socket.if_nameindex()])", LIMITS).text()
  assert text == "['lo']" or "network access refused" in text, text


def test_files_outside_its_directory(env, tmp_path):
  run_dir = tmp_path / "run"
  run_dir.mkdir()
  (run_dir / "secret.txt").write_text("checkpoint")
  outside = tmp_path / "escaped.txt"
  for code in (f"print(open({str(run_dir / 'secret.txt')!r}).read())",
               f"import os\nprint(os.listdir({str(run_dir)!r}))",
               f"open({str(outside)!r}, 'w').write('x')",
               f"import os\nos.remove({str(run_dir / 'secret.txt')!r})",
               "import os\nos.chdir('/')"):
    text = call(env, code)
    assert "outside the tool's directory" in text and "checkpoint" not in text, text
  assert not outside.exists() and (run_dir / "secret.txt").read_text() == "checkpoint"
  assert not pathlib.Path("/tmp/hflax-escaped").exists()


def test_bad_calls(env):
  assert call(env, arguments={"program": "print(1)"}).startswith("Error: python needs")
  assert "unknown tool 'shell'" in call(env, "print(1)", name="shell")
  obs = env.step(Turn('<tool_call>{"name": "python", "arguments": {"code": </tool_call>', (), 0))
  assert obs.messages[0]["content"].startswith("Error: tool call is not valid JSON")


def test_the_caller_is_untouched():
  before = os.getcwd()
  for _ in range(3):
    assert run_python("print('again')", LIMITS).ok
  assert os.getcwd() == before


def test_jails_start_from_the_reward_code_pool():
  """The tool's jails start from hflax.sandbox's ProcessPool workers (the mechanism user
  reward code runs in), never from the caller."""
  from hflax.sandbox import ProcessPool
  pool = ProcessPool(1)
  tool = PythonTool(LIMITS, pool=pool)
  assert tool.execute({"code": "import os\nprint(os.getppid())"}) == str(
      pool._all[0].process.pid)
  pool.close()
  with pytest.raises(RuntimeError, match="closed"):
    tool.execute({"code": "print(1)"})
