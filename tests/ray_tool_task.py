"""The arithmetic tool task with tools that log their calls, for runs whose agent loop runs
in Ray's worker processes (tests/test_ray_split.py).

Every model turn is read as a calculator call (the parser "every_turn"), so a random
model's trajectories call tools; the calculator waits a random time before it answers
(so processes that ran it would see different latencies) and appends its process's JAX
index and pid to a log file per call. The test's process registers them with `register`;
Ray's workers, which import nothing of the test, with a sitecustomize module that
`site_dir` writes: on their PYTHONPATH, it registers them when hflax's agent rollout
module is imported.
"""
import importlib.abc
import importlib.machinery
import os
import random
import sys
import threading
import time

AGENT_ROLLOUT = "hflax.rollout.agents.rollout"
TESTS = os.path.dirname(os.path.abspath(__file__))


class EveryTurnCalls:
  def parse(self, text):
    from hflax.rollout.agents.tools import ParsedTurn, ToolCall
    return ParsedTurn((ToolCall("calculator", {"expression": "6*7"}),), ())


_LOCK = threading.Lock()


def logging_calculator(log_path: str):
  """A Calculator (the task's tool, its schema too) that logs each call, then waits 0 to
  30 ms before it answers."""
  from hflax.rollout.agents.tool_config import Calculator

  class LoggingCalculator(Calculator):
    def execute(self, arguments: dict) -> str:
      import jax
      with _LOCK, open(log_path, "a") as f:
        f.write(f"{jax.process_index()} {os.getpid()}\n")
      time.sleep(random.uniform(0.0, 0.03))
      return super().execute(arguments)

  return LoggingCalculator()


def register(log_path: str, setitem=None):
  """The parser and the logging tools in hflax's tables (setitem: a pytest monkeypatch's,
  to undo it after the test; default: for the process's lifetime)."""
  from hflax.rollout.agents import rollout, tools
  setitem = setitem or (lambda table, key, value: table.__setitem__(key, value))
  setitem(tools.PARSERS, "every_turn", EveryTurnCalls)
  setitem(rollout.BUILTIN_TOOLS, "arithmetic_tools", lambda: [logging_calculator(log_path)])


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
  """Finds hflax's agent rollout module as Python would, and registers the task once
  it has run (importing hflax here, at start-up, would import JAX before the worker sets
  it up)."""

  def __init__(self, log_path: str):
    self.log_path = log_path

  def find_spec(self, name, path, target=None):
    if name != AGENT_ROLLOUT:
      return None
    sys.meta_path.remove(self)
    spec = importlib.machinery.PathFinder.find_spec(name, path)
    run_module = spec.loader.exec_module

    def exec_module(module):
      run_module(module)
      register(self.log_path)
    spec.loader.exec_module = exec_module
    return spec


def register_on_import(log_path: str):
  sys.meta_path.insert(0, _RegisterAfterImport(log_path))


def site_dir(tmp_path, log_path) -> str:
  """A directory whose sitecustomize registers the task (logging to log_path) in any
  Python process that has it, and this directory, on its PYTHONPATH."""
  site = tmp_path / "site"
  site.mkdir(exist_ok=True)
  (site / "sitecustomize.py").write_text(
      f"import sys\nsys.path.append({TESTS!r})\nimport ray_tool_task\n"
      f"ray_tool_task.register_on_import({str(log_path)!r})\n")
  return str(site)
