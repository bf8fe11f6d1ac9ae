"""Tools a policy can call: OpenAI-style schemas, Hermes-style call parsing, and the
system-prompt rendering for chat templates that carry no tools.

A tool is a function schema (name, description, JSON-schema parameters) and an `execute`
that takes the parsed arguments and returns text; `execute` may run on any thread (the
agent loop runs tools while other trajectories decode). A model calls tools by writing
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes format Qwen2.5 and
Qwen3 are trained on); a parser turns a turn's text into calls and the text's errors.
"""
from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Callable, Protocol


@dataclasses.dataclass(frozen=True)
class ToolCall:
  name: str
  arguments: dict


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
  """A model turn read for tool calls: the calls, and one message per call that could
  not be read (bad JSON, no name, arguments that are not an object)."""
  calls: tuple[ToolCall, ...]
  errors: tuple[str, ...]


class Tool(Protocol):
  schema: dict  # {"type": "function", "function": {"name", "description", "parameters"}}

  def execute(self, arguments: dict) -> str:
    ...


@dataclasses.dataclass
class FunctionTool:
  """A Python function as a tool. `fn(**arguments)` returns the observation (str() of it);
  parameters: the JSON schema of its arguments."""
  fn: Callable[..., Any]
  name: str
  description: str
  parameters: dict

  @property
  def schema(self) -> dict:
    return {"type": "function", "function": {"name": self.name, "description": self.description,
                                             "parameters": self.parameters}}

  def execute(self, arguments: dict) -> str:
    return str(self.fn(**arguments))


@dataclasses.dataclass(frozen=True)
class SchemaOnlyTool:
  """A tool's schema without the tool: what a process that renders prompts but runs no
  tools holds (a pool's processes other than 0, hflax.rollout.agents.shared_tools), so
  it starts no sandbox worker and builds no instance."""
  schema: dict

  def execute(self, arguments: dict) -> str:
    raise RuntimeError(f"tool {tool_name(self)!r} runs in process 0 of the pool; this "
                       "process holds its schema only")


def tool_name(tool: Tool) -> str:
  return tool.schema["function"]["name"]


class HermesParser:
  """`<tool_call>{json}</tool_call>` blocks, in order; text outside them is the turn's."""
  pattern = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)

  def parse(self, text: str) -> ParsedTurn:
    calls, errors = [], []
    for body in self.pattern.findall(text):
      try:
        call = json.loads(body)
      except json.JSONDecodeError as e:
        errors.append(f"tool call is not valid JSON ({e.msg} at character {e.pos})")
        continue
      if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        errors.append("tool call needs a string \"name\"")
        continue
      arguments = call.get("arguments", {})
      if isinstance(arguments, str):  # some models write the arguments JSON as a string
        try:
          arguments = json.loads(arguments)
        except json.JSONDecodeError:
          pass
      if not isinstance(arguments, dict):
        errors.append(f"tool call {call['name']!r}: \"arguments\" must be a JSON object")
        continue
      calls.append(ToolCall(call["name"], arguments))
    return ParsedTurn(tuple(calls), tuple(errors))


PARSERS = {"hermes": HermesParser}


def tools_system_prompt(tools: list[Tool]) -> str:
  """For chat templates that render no tools (SmolLM2's, Llama 2's): the tools and the
  call format, written into the system message the way Hermes-trained templates do."""
  listed = "\n".join(json.dumps(t.schema, ensure_ascii=False) for t in tools)
  return ("You may call one or more functions to help with the user's request. The "
          "functions are listed in <tools></tools>:\n<tools>\n" + listed + "\n</tools>\n"
          "To call a function, reply with a JSON object of its name and arguments inside "
          "<tool_call></tool_call> tags, for example:\n<tool_call>\n"
          '{"name": "<function-name>", "arguments": {"<argument>": "<value>"}}\n'
          "</tool_call>")
