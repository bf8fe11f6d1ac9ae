"""Tools from a config file in verl's format, and hflax's built-in tools.

verl's multi-turn rollout reads a YAML file of tools:

    tools:
      - class_name: verl.tools.sandbox_fusion_tools.SandboxFusionTool
        config: {type: native, ...}
        tool_schema: {type: function, function: {name: code_interpreter, ...}}

Here `class_name` is a class hflax can import whose instances have `schema` and
`execute(arguments) -> str` (hflax.rollout.agents.tools.Tool), built as
`cls(config=..., tool_schema=...)`, or one of verl's tool classes that hflax has an
equivalent of (VERL_EQUIVALENTS), which then takes the file's schema (its name and
description are what the model sees).
"""
from __future__ import annotations

import ast
import importlib
import operator
import os

from hflax.rollout.agents.tools import Tool, tool_name


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


BUILTIN = {"calculator": Calculator, "python": _python_tool}
# verl's tool classes -> hflax's tool doing the same job.
VERL_EQUIVALENTS = {
    "verl.tools.sandbox_fusion_tools.SandboxFusionTool": _python_tool,
    "verl.tools.gsm8k_tool.Gsm8kTool": Calculator,
}


def load_tools(path: str) -> list[Tool]:
  """The tools a verl-format YAML file lists (module docstring); one-line errors."""
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
  tools = [_tool(entry, f"tool config {path!r}, tool {i}") for i, entry in enumerate(entries)]
  names = [tool_name(t) for t in tools]
  if len(set(names)) != len(names):
    raise ValueError(f"tool config {path!r}: tool names repeat: {names}")
  return tools


def _tool(entry, where: str) -> Tool:
  if not isinstance(entry, dict) or not isinstance(entry.get("class_name"), str):
    raise ValueError(f"{where}: needs a class_name")
  name, config, schema = entry["class_name"], entry.get("config") or {}, entry.get("tool_schema")
  if schema is not None and not (isinstance(schema, dict) and
                                 isinstance(schema.get("function", {}).get("name"), str)):
    raise ValueError(f"{where}: tool_schema needs function.name")
  make = BUILTIN.get(name) or VERL_EQUIVALENTS.get(name)
  if make is None:
    module, _, attr = name.rpartition(".")
    try:
      make = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError) as e:
      raise ValueError(f"{where}: cannot import class_name {name!r} ({e})") from None
  tool = make(config=config, tool_schema=schema)
  if not callable(getattr(tool, "execute", None)) or not isinstance(getattr(tool, "schema", None),
                                                                    dict):
    raise ValueError(f"{where}: {name} has no schema and execute(arguments)")
  return tool
