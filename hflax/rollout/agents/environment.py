"""Environments a trajectory talks to, and the tool-calling one.

An environment gives the first messages of a trajectory (`reset(sample)`) and answers
each model turn (`step(turn)`) with the messages that follow it (tool results, a user's or
an environment's reply), an optional reward for the turn, and whether the trajectory is
done. One environment object serves one trajectory; `step` may run on any thread.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import time
from typing import Any, Callable, Protocol, Sequence

from hflax.rollout.agents.tools import PARSERS, Tool, tool_name, tools_system_prompt


@dataclasses.dataclass(frozen=True)
class Turn:
  """A model turn: its text (special tokens dropped), its sampled ids, its index from 0."""
  text: str
  token_ids: tuple[int, ...]
  index: int


@dataclasses.dataclass
class Observation:
  messages: list[dict]
  reward: float | None = None
  done: bool = False
  # Counts the loop sums into the trajectory's metrics: tool_calls, tool_errors,
  # tool_timeouts, tool_seconds.
  counts: dict = dataclasses.field(default_factory=dict)
  # The whole conversation the next turn continues from (`messages` included), where the
  # environment rewrites its history (a compacted context, a dropped reasoning); None:
  # the history so far, the turn and `messages`. The loop starts a new segment when its
  # rendering is not the kept ids plus the new messages' (hflax.rollout.agents.segments).
  context: list[dict] | None = None


class Environment(Protocol):
  def reset(self, sample: Any) -> list[dict]:
    ...

  def step(self, turn: Turn) -> Observation:
    ...


class ToolEnvironment:
  """A task whose model turns may call tools: a turn with calls gets one "tool" message
  per call (the result, or the error as text: an unknown tool, bad arguments, a raise, a
  timeout); a turn without calls is the final answer, scored by `reward_fn(text, sample)`.

  sample: {"prompt": [messages]} (verl's schema) or a list of messages. tools_in_template:
  the chat template renders the tools itself (Qwen2.5, Qwen3, Llama 3: pass them to the
  tokenizer as template_vars tools=[schemas]); otherwise they go into the system message
  (tools_system_prompt). tool_timeout_s: a call that runs longer is reported to the model
  as timed out (the thread is left to finish: tools that must be stopped run in a
  sandboxed process, which kills them).
  """

  def __init__(self, tools: Sequence[Tool], *, reward_fn: Callable[[str, Any], float] | None = None,
               parser: str = "hermes", tools_in_template: bool = False,
               tool_timeout_s: float | None = None, executor=None):
    if parser not in PARSERS:
      raise ValueError(f"ToolEnvironment: parser must be one of {sorted(PARSERS)}, got {parser!r}")
    self.tools = {tool_name(t): t for t in tools}
    self.parser = PARSERS[parser]()
    self.reward_fn, self.tools_in_template = reward_fn, tools_in_template
    self.tool_timeout_s = tool_timeout_s
    self._executor = executor
    self.sample = None

  def reset(self, sample: Any) -> list[dict]:
    self.sample = sample
    messages = list(sample["prompt"] if isinstance(sample, dict) else sample)
    if self.tools and not self.tools_in_template:
      system = tools_system_prompt(list(self.tools.values()))
      if messages and messages[0]["role"] == "system":
        messages[0] = {**messages[0], "content": messages[0]["content"] + "\n\n" + system}
      else:
        messages.insert(0, {"role": "system", "content": system})
    return messages

  def step(self, turn: Turn) -> Observation:
    parsed = self.parser.parse(turn.text)
    if not parsed.calls and not parsed.errors:
      reward = self.reward_fn(turn.text, self.sample) if self.reward_fn else None
      return Observation([], reward=reward, done=True)
    counts = {"tool_calls": len(parsed.calls) + len(parsed.errors),
              "tool_errors": len(parsed.errors), "tool_timeouts": 0, "tool_seconds": 0.0}
    messages = [{"role": "tool", "content": f"Error: {e}"} for e in parsed.errors]
    for call in parsed.calls:
      start = time.perf_counter()
      text, error, timed_out = self._call(call.name, call.arguments)
      counts["tool_seconds"] += time.perf_counter() - start
      counts["tool_errors"] += error
      counts["tool_timeouts"] += timed_out
      messages.append({"role": "tool", "content": text})
    return Observation(messages, counts=counts)

  def _call(self, name: str, arguments: dict) -> tuple[str, bool, bool]:
    """(observation text, whether it is an error, whether it timed out)."""
    tool = self.tools.get(name)
    if tool is None:
      return f"Error: unknown tool {name!r}; the tools are {sorted(self.tools)}", True, False
    if self.tool_timeout_s is None or getattr(tool, "limits_itself", False):
      return _run(tool, arguments)  # a pooled tool kills its own worker at its limit
    executor = self._executor or _shared_executor()
    future = executor.submit(_run, tool, arguments)
    try:
      return future.result(timeout=self.tool_timeout_s)
    except concurrent.futures.TimeoutError:
      return f"Error: tool {name!r} timed out after {self.tool_timeout_s} s", True, True


def _run(tool: Tool, arguments: dict) -> tuple[str, bool, bool]:
  try:
    return str(tool.execute(arguments)), False, False
  except TimeoutError as e:  # a tool that limits itself (hflax.sandbox.class_tool)
    return f"Error: {e}", True, True
  except Exception as e:  # noqa: BLE001  a tool's failure is the model's observation
    return f"Error: {type(e).__name__}: {e}", True, False


_EXECUTOR = None


def _shared_executor():
  global _EXECUTOR
  if _EXECUTOR is None:
    _EXECUTOR = concurrent.futures.ThreadPoolExecutor(max_workers=16,
                                                      thread_name_prefix="hflax-tool")
  return _EXECUTOR
