"""A user's tool class from a verl tool config file runs in pool workers: never imported in
this process, its crashes, hangs, memory and raises come back to the model as the tool's
error within the limit, the worker replaced, this process stepping on; an import that
kills its worker is a one-line config error."""
import os
import sys
import textwrap
import time

import pytest

from hflax.rollout.agents import ToolEnvironment, Turn
from hflax.rollout.agents.tool_config import load_tools
from hflax.sandbox.class_tool import PooledTool, close_tools

TIMEOUT_S = 3.0

TOOLS_MODULE = """
import os, time
with open(os.environ["HFLAX_TEST_IMPORTS"], "a") as f:
    f.write(f"{os.getpid()}\\n")


class Adder:
    def __init__(self, config, tool_schema):
        self.offset = config.get("offset", 0)
        self.schema = tool_schema or {"type": "function", "function": {
            "name": "add", "description": "a + b + offset",
            "parameters": {"type": "object", "properties": {}}}}
        self.calls = 0

    def execute(self, arguments):
        self.calls += 1
        return f"{arguments['a'] + arguments['b'] + self.offset} pid={os.getpid()} call={self.calls}"


class Hostile:
    def __init__(self, config, tool_schema):
        self.schema = {"type": "function", "function": {
            "name": "hostile", "description": "misbehaves",
            "parameters": {"type": "object", "properties": {}}}}

    def execute(self, arguments):
        how = arguments["how"]
        if how == "exit":
            os._exit(3)
        if how == "loop":
            while True:
                pass
        if how == "memory":
            blocks = []
            while True:
                blocks.append(b"x" * (32 << 20))
        if how == "segfault":
            import ctypes
            ctypes.string_at(0)
        if how == "raise":
            raise ValueError("no such thing")
        return "fine"
"""

CONFIG = """
tools:
  - class_name: user_tools_{tag}.Adder
    config: {{offset: 100}}
  - class_name: user_tools_{tag}.Hostile
    sandbox: {{workers: 1, memory_limit_gb: 0.5}}
  - class_name: calculator
"""


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
  root = tmp_path_factory.mktemp("class_tools")
  tag = f"{os.getpid()}"
  (root / f"user_tools_{tag}.py").write_text(TOOLS_MODULE)
  imports = root / "imports.txt"
  os.environ["HFLAX_TEST_IMPORTS"] = str(imports)
  sys.path.insert(0, str(root))  # the workers get this process's sys.path
  path = root / "tools.yaml"
  path.write_text(CONFIG.format(tag=tag))
  tools = load_tools(str(path), timeout_s=TIMEOUT_S)
  yield {"root": root, "tag": tag, "imports": imports, "tools": tools,
         "env": ToolEnvironment(tools, tool_timeout_s=TIMEOUT_S)}
  close_tools(tools)
  sys.path.remove(str(root))
  del os.environ["HFLAX_TEST_IMPORTS"]


def call(env, name, arguments) -> tuple[str, dict]:
  import json
  obs = env.step(Turn(f'<tool_call>{{"name": "{name}", "arguments": '
                      f'{json.dumps(arguments)}}}</tool_call>', (), 0))
  assert len(obs.messages) == 1 and not obs.done
  return obs.messages[0]["content"], obs.counts


def test_the_class_is_imported_in_workers_only(setup):
  assert f"user_tools_{setup['tag']}" not in sys.modules
  pids = {int(line) for line in setup["imports"].read_text().split()}
  assert pids and os.getpid() not in pids
  pooled = [t for t in setup["tools"] if isinstance(t, PooledTool)]
  assert [t.name for t in pooled] == ["add", "hostile"]
  assert not isinstance(setup["tools"][2], PooledTool)  # hflax's own tool runs here


def test_a_well_behaved_class_answers_through_the_proxy_and_keeps_its_state(setup):
  env = setup["env"]
  assert setup["tools"][0].schema["function"]["name"] == "add"
  first, counts = call(env, "add", {"a": 2, "b": 3})
  second, _ = call(env, "add", {"a": 2, "b": 3})
  assert first.startswith("105 pid=") and counts["tool_errors"] == 0
  worker = int(first.split("pid=")[1].split()[0])
  assert worker != os.getpid()
  # Its own worker's instance, built once: the call count goes on in one worker.
  if second.split("pid=")[1].split()[0] == str(worker):
    assert second.endswith("call=2")
  assert call(env, "calculator", {"expression": "347*29"})[0] == "10063"


@pytest.mark.parametrize("how, expected, timed_out", [
    ("exit", "ended its worker process (exit status 3)", False),
    ("segfault", "ended its worker process (killed by SIGSEGV)", False),
    ("loop", f"ran past its limit of {TIMEOUT_S:g} s", True),
    ("memory", "raised MemoryError", False),
    ("raise", "raised ValueError: no such thing", False),
])
def test_a_hostile_class_is_the_models_error_and_this_process_steps_on(setup, how, expected,
                                                                       timed_out):
  env, me = setup["env"], os.getpid()
  hostile = setup["tools"][1]
  before = hostile.pool._all[0].process.pid
  start = time.monotonic()
  text, counts = call(env, "hostile", {"how": how})
  assert time.monotonic() - start < TIMEOUT_S + 5
  assert text.startswith("Error:") and expected in text, text
  assert counts["tool_errors"] == 1 and counts["tool_timeouts"] == timed_out
  assert os.getpid() == me
  replaced = hostile.pool._all[0].process.pid != before
  assert replaced == (how in ("exit", "segfault", "loop"))
  assert call(env, "hostile", {"how": "nothing"})[0] == "fine"  # the next call is served
  assert call(env, "add", {"a": 1, "b": 1})[0].startswith("102 ")


def test_an_import_that_kills_its_worker_is_a_one_line_config_error(tmp_path, monkeypatch):
  monkeypatch.syspath_prepend(str(tmp_path))
  module = f"exits_at_import_{os.getpid()}"
  (tmp_path / f"{module}.py").write_text("import os\nos._exit(0)\n")
  (tmp_path / f"raises_{module}.py").write_text(textwrap.dedent("""
      class Broken:
          def __init__(self, config, tool_schema):
              raise KeyError("token")
      """))
  path = tmp_path / "tools.yaml"
  for class_name, message in (
      (f"{module}.Tool", f"importing and constructing class_name '{module}.Tool' in a worker "
                         "process ended its worker process (exit status 0, as os._exit(0) gives)"),
      (f"raises_{module}.Broken", "raised KeyError: 'token'"),
      (f"raises_{module}.Missing", f"cannot import class_name 'raises_{module}.Missing'"),
      ("no_such_module_anywhere.Tool", "cannot import class_name")):
    path.write_text(f"tools:\n  - class_name: {class_name}\n")
    with pytest.raises(ValueError) as e:
      load_tools(str(path))
    assert "\n" not in str(e.value) and message in str(e.value), str(e.value)
    assert str(e.value).startswith(f"tool config {str(path)!r}, tool 0: ")
  assert module not in sys.modules


def test_bad_sandbox_settings_are_refused_before_any_worker(tmp_path):
  path = tmp_path / "tools.yaml"
  for sandbox, message in (("{workers: 0}", "sandbox.workers must be an integer >= 1"),
                           ("{memory_limit_gb: -1}", "sandbox.memory_limit_gb must be > 0"),
                           ("{cpus: 2}", "sandbox takes only workers and memory_limit_gb")):
    path.write_text(f"tools:\n  - class_name: a.B\n    sandbox: {sandbox}\n")
    with pytest.raises(ValueError, match=message):
      load_tools(str(path))


def test_the_run_keeps_stepping_through_the_launcher_while_a_class_kills_its_workers(
    tmp_path, monkeypatch):
  """The tiny GRPO job with a tool config whose only tool is a user class that os._exits in
  every call, each model turn read as a call to it (a test parser): both steps train in
  this process, every call is counted as a tool error, and the class never loads here."""
  import json
  from hflax.launch.trainer import Trainer
  from hflax.rollout.agents import tools as tools_module
  from tiny_config import get_config

  module = f"exiting_tool_{os.getpid()}"
  (tmp_path / f"{module}.py").write_text(textwrap.dedent("""
      import os
      class Exits:
          def __init__(self, config, tool_schema):
              self.schema = tool_schema
          def execute(self, arguments):
              os._exit(0)
      """))
  monkeypatch.syspath_prepend(str(tmp_path))
  path = tmp_path / "tools.yaml"
  path.write_text(f"tools:\n  - class_name: {module}.Exits\n    tool_schema: {{type: function, "
                  "function: {name: exits, description: d, parameters: {type: object}}}\n")

  class EveryTurnCalls:
    def parse(self, text):
      return tools_module.ParsedTurn((tools_module.ToolCall("exits", {}),), ())

  monkeypatch.setitem(tools_module.PARSERS, "every_turn_exits", EveryTurnCalls)
  c = get_config()
  c.data.builtin.update(data_source="arithmetic_tools")
  # 2 prompts x 2 samples a step: every call ends its worker, and each replacement is a
  # fresh interpreter (most of this test's time), so 8 calls a step rather than 16.
  c.data.update(max_prompt_length=160, max_response_length=200, train_batch_size=2)
  c.rollout.multi_turn.update(enable=True, max_assistant_turns=2, format="every_turn_exits",
                              max_turn_tokens=20, max_tool_response_length=160,
                              tool_config_path=str(path), tool_timeout_s=10)
  c.trainer.update(total_steps=2, run_dir=str(tmp_path / "run"))
  me = os.getpid()
  Trainer(c, log=lambda *_: None).fit()
  rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
  assert [r["step"] for r in rows] == [1, 2] and os.getpid() == me
  for row in rows:
    assert row["agent/tool_calls/mean"] == 2 and row["agent/tool_errors/mean"] == 2
    assert row["agent/tool_tokens/mean"] > 0  # the error message went back to the model
  assert module not in sys.modules


def test_the_config_check_names_the_field_for_a_class_that_kills_its_worker_at_import(
    tmp_path, monkeypatch):
  """The launcher's config check (before any device work) loads the tool file: a class whose
  module os._exits at import is one line naming rollout.multi_turn.tool_config_path."""
  from hflax.launch.config import validate
  from tiny_config import get_config
  module = f"exits_in_check_{os.getpid()}"
  (tmp_path / f"{module}.py").write_text("import os\nos._exit(0)\n")
  monkeypatch.syspath_prepend(str(tmp_path))
  path = tmp_path / "tools.yaml"
  path.write_text(f"tools:\n  - class_name: {module}.Tool\n")
  c = get_config()
  c.rollout.multi_turn.update(enable=True, tool_config_path=str(path))
  with pytest.raises(ValueError) as e:
    validate(c)
  text = str(e.value)
  assert "\n" not in text and text.startswith("config.rollout.multi_turn.tool_config_path: ")
  assert "ended its worker process (exit status 0" in text and module not in sys.modules


SCHEMA = {"type": "function", "function": {"name": "add", "description": "a + b + offset",
                                           "parameters": {"type": "object", "properties": {}}}}


def test_a_pool_process_other_than_0_renders_the_tools_without_building_them(setup,
                                                                            monkeypatch):
  """On a pool of several processes process 0 alone runs the tools (SharedToolsLoop), so
  process 1 holds their schemas only: no user class imported or built, no sandbox worker
  started, and the prompt it renders is process 0's. A user class there needs a
  tool_schema (refused in one line before any worker), and process 0 refuses an instance
  reporting another schema than the file's."""
  import jax
  import yaml
  from hflax.rollout.agents.rollout import MultiTurn, environments
  from hflax.rollout.agents.tools import SchemaOnlyTool
  from hflax.sandbox import pool
  root, tag = setup["root"], setup["tag"]

  def config(name, *entries):
    (root / name).write_text(yaml.safe_dump({"tools": list(entries)}))
    return str(root / name)
  adder = {"class_name": f"user_tools_{tag}.Adder", "config": {"offset": 1},
           "tool_schema": SCHEMA}
  both = config("both.yaml", adder, {"class_name": "calculator"})
  started = []
  real_init = pool.ProcessPool.__init__
  monkeypatch.setattr(pool.ProcessPool, "__init__",
                      lambda self, *a, **kw: started.append(1) or real_init(self, *a, **kw))
  imports = setup["imports"].read_text()
  process = {"index": 1}
  monkeypatch.setattr(jax.distributed, "is_initialized", lambda: True)
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  monkeypatch.setattr(jax, "process_index", lambda: process["index"])
  (env,) = environments(MultiTurn(tool_config_path=both, tool_timeout_s=TIMEOUT_S), ["x"])
  assert all(isinstance(t, SchemaOnlyTool) for t in env.tools.values())
  assert sorted(env.tools) == ["add", "calculator"]
  assert not started and setup["imports"].read_text() == imports  # no worker, no import
  with pytest.raises(RuntimeError, match="runs in process 0 of the pool"):
    env.tools["add"].execute({"a": 1, "b": 2})
  prompt = [{"role": "user", "content": "2 + 3?"}]

  process["index"] = 0  # process 0 builds the tools (a worker each) and renders the same
  tools = load_tools(both, timeout_s=TIMEOUT_S)
  try:
    assert isinstance(tools[0], PooledTool) and started
    assert ToolEnvironment(tools).reset({"prompt": prompt}) == env.reset({"prompt": prompt})
  finally:
    close_tools(tools)
  other = config("other.yaml", {**adder, "class_name": f"user_tools_{tag}.Hostile"})
  with pytest.raises(ValueError, match=r"^tool config .*, tool 0: user_tools_\d+\.Hostile's "
                                       r"instance reports the schema .*'hostile'.*, not its "
                                       r"tool_schema") as e:
    load_tools(other, timeout_s=TIMEOUT_S)
  assert "\n" not in str(e.value)

  started.clear()
  bare = config("bare.yaml", {"class_name": f"user_tools_{tag}.Adder"})
  for process["index"] in (1, 0):
    with pytest.raises(ValueError, match=r"^tool config .*, tool 0: user_tools_\d+\.Adder "
                                         r"needs a tool_schema on a pool of several processes"):
      load_tools(bare, timeout_s=TIMEOUT_S)
  assert not started
