"""Tools from a config file in verl's format, and hflax's built-in tools.

verl's multi-turn rollout reads a YAML file of tools:

    tools:
      - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool
        config: {type: native, ...}
        tool_schema: {type: function, function: {name: code_interpreter, ...}}

Here `class_name` is one of hflax's own tools (BUILTIN, or Calculator by its path), one
of verl's tool classes that hflax has an equivalent of (VERL_EQUIVALENTS, which then
takes the file's schema: its name and description are what the model sees), or a user's
class whose instances have `schema` and `execute(arguments) -> str`
(hflax.rollout.agents.tools.Tool), built as `cls(config=..., tool_schema=...)`. hflax's
own tools run in the trainer; a user's class is imported, built and executed only in
worker processes (hflax.sandbox.class_tool), so its crashes, hangs and memory come back
to the model as the tool's error. An entry may add hflax's `sandbox:` settings for those
workers: `workers` (calls at once, default 2) and `memory_limit_gb` (each worker's
address space, default 4); a call's time limit is rollout.multi_turn.tool_timeout_s.

On a pool of several processes (a jax.distributed job) process 0 alone runs the tools
(hflax.rollout.agents.shared_tools); the others need only the schemas their prompts
render, so they hold SchemaOnlyTools: no user class built, no sandbox worker started.
Their schema is the file's tool_schema, so a user class there needs one, and process 0
refuses an instance reporting another (every process must render the same prompt).
"""
from __future__ import annotations

import ast
import operator
import os

from hflax.rollout.agents.tools import SchemaOnlyTool, Tool, tool_name
from hflax.sandbox.class_tool import PooledTool, close_tools


class Calculator:
  """Arithmetic on integers and decimals: + - * / // % ** and parentheses, evaluated from
  the expression's syntax tree (never eval), numbers below 10**12 and powers up to 10."""
  OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
         ast.Div: operator.truediv, ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
         ast.Pow: operator.pow}

  def __init__(self, config: dict | None = None, tool_schema: dict | None = None):
    self.schema = tool_schema or {"type": "function", "function": {
        "name": "calculator", "description": "Evaluates an arithmetic expression, e.g. 347*29.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]}}}

  def execute(self, arguments: dict) -> str:
    expression = arguments.get("expression")
    if not isinstance(expression, str):
      raise ValueError('calculator needs {"expression": "<arithmetic>"}')
    value = self._eval(ast.parse(expression, mode="eval").body)
    return str(int(value) if float(value).is_integer() else round(value, 6))

  def _eval(self, node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
      value = node.value
    elif isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
      value = self._eval(node.operand) * (-1 if isinstance(node.op, ast.USub) else 1)
    elif isinstance(node, ast.BinOp) and type(node.op) in self.OPS:
      left, right = self._eval(node.left), self._eval(node.right)
      if isinstance(node.op, ast.Pow) and abs(right) > 10:
        raise ValueError("powers above 10 are not supported")
      value = self.OPS[type(node.op)](left, right)
    else:
      raise ValueError(f"unsupported expression: {ast.unparse(node)!r}")
    if abs(value) >= 10 ** 12:
      raise ValueError("the result is too large")
    return value


def _python_tool(config: dict | None = None, tool_schema: dict | None = None):
  from hflax.sandbox.python_tool import Limits, PythonTool
  tool = PythonTool(Limits(**{k: v for k, v in (config or {}).items()
                              if k in Limits.__dataclass_fields__}))
  if tool_schema:
    tool.name = tool_schema["function"]["name"]
  return tool


BUILTIN = {"calculator": Calculator, "python": _python_tool,
           f"{__name__}.Calculator": Calculator}
# verl's tool classes -> hflax's tool doing the same job.
VERL_EQUIVALENTS = {
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": _python_tool,
    "verl.tools.gsm8k_tool.Gsm8kTool": Calculator,
}


def load_tools(path: str, timeout_s: float = 30.0) -> list[Tool]:
  """The tools a verl-format YAML file lists (module docstring); one-line errors.
  timeout_s: a call's limit for user classes, which run in worker processes."""
  import yaml
  if not os.path.isfile(path):
    raise ValueError(f"tool config {path!r}: no such file")
  with open(path, encoding="utf-8") as f:
    try:
      spec = yaml.safe_load(f) or {}
    except yaml.YAMLError as e:
      raise ValueError(f"tool config {path!r}: not valid YAML ({' '.join(str(e).split())})")
  entries = spec.get("tools") if isinstance(spec, dict) else None
  if not isinstance(entries, list) or not entries:
    raise ValueError(f"tool config {path!r}: needs a non-empty 'tools:' list")
  tools = []
  process = _pool_process()
  try:
    for i, entry in enumerate(entries):
      tools.append(_tool(entry, f"tool config {path!r}, tool {i}", timeout_s, process))
    names = [tool_name(t) for t in tools]
    if len(set(names)) != len(names):
      raise ValueError(f"tool config {path!r}: tool names repeat: {names}")
  except BaseException:
    close_tools(tools)  # the workers of the tools already built
    raise
  return tools


def _pool_process() -> int | None:
  """This process's index in a jax.distributed job of several processes, else None (not
  asked of JAX otherwise: a launcher's check must not start its backend)."""
  import jax
  if not jax.distributed.is_initialized() or jax.process_count() == 1:
    return None
  return jax.process_index()


def _tool(entry, where: str, timeout_s: float, process: int | None = None) -> Tool:
  if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
    raise ValueError(f"{where}: needs a class_name")
  name, config, schema = entry["class_name"], entry.get("config") or {}, entry.get("tool_schema")
  if schema is not None and not (isinstance(schema, dict) and
                                 isinstance(schema.get("function", {}).get("name"), str)):
    raise ValueError(f"{where}: tool_schema needs function.name")
  if not isinstance(config, dict):
    raise ValueError(f"{where}: config must be a mapping, got {type(config).__name__}")
  make = BUILTIN.get(name) or VERL_EQUIVALENTS.get(name)
  if make is None:  # a user's class: never imported here (module docstring)
    workers, memory_gb = _sandbox_settings(entry.get("sandbox"), where)
    if process is not None and schema is None:
      raise ValueError(f"{where}: {name} needs a tool_schema on a pool of several processes "
                       "(processes other than 0 render it without building the class)")
    if process:
      return SchemaOnlyTool(schema)
    try:
      tool = PooledTool(name, config, schema, timeout_s=timeout_s, workers=workers,
                        memory_limit_bytes=int(memory_gb * 2**30))
    except ValueError as e:
      raise ValueError(f"{where}: {e}") from None
    if process is not None and tool.schema != schema:
      tool.close()
      raise ValueError(f"{where}: {name}'s instance reports the schema {tool.schema!r}, not "
                       "its tool_schema, which the pool's other processes render")
    return tool
  tool = make(config=config, tool_schema=schema)
  if not callable(getattr(tool, "execute", None)) or not isinstance(getattr(tool, "schema", None),
                                                                    dict):
    raise ValueError(f"{where}: {name} has no schema and execute(arguments)")
  return SchemaOnlyTool(tool.schema) if process else tool


def _sandbox_settings(sandbox, where: str) -> tuple[int, float]:
  """(workers, memory_limit_gb) from an entry's `sandbox:` mapping (module docstring)."""
  sandbox = {} if sandbox is None else sandbox
  if not isinstance(sandbox, dict) or set(sandbox) - {"workers", "memory_limit_gb"}:
    raise ValueError(f"{where}: sandbox takes only workers and memory_limit_gb, got {sandbox!r}")
  workers, memory_gb = sandbox.get("workers", 2), sandbox.get("memory_limit_gb", 4)
  if not (isinstance(workers, int) and not isinstance(workers, bool) and workers >= 1):
    raise ValueError(f"{where}: sandbox.workers must be an integer >= 1, got {workers!r}")
  if not (isinstance(memory_gb, (int, float)) and not isinstance(memory_gb, bool)
          and memory_gb > 0):
    raise ValueError(f"{where}: sandbox.memory_limit_gb must be > 0, got {memory_gb!r}")
  return workers, float(memory_gb)
