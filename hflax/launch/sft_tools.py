"""Supervised warm-up conversations for the tool task: what a model that uses the
calculator says, so that RL on `arithmetic_tools` starts from a policy that calls it.

SmolLM2-135M-Instruct as shipped answers the question in its head and never writes a
tool call, so every trajectory scores 0 and GRPO has nothing to compare. Each warm-up
example is the whole exchange a rollout would hold, rendered exactly as the agent loop
renders it: the prompt with the tools in the system message (ToolEnvironment.reset), a
turn calling the calculator on the question's expression, the tool's message as the
template renders it after a turn (MessageDelta), then the answer. The loss covers the
two model turns (each ending at the end token), never the prompt or the tool's message.
"""
from __future__ import annotations

import json
import re

from hflax.rollout.agents.chat import MessageDelta
from hflax.rollout.agents.environment import ToolEnvironment
from hflax.rollout.agents.tool_config import Calculator

QUESTION = re.compile(r"What is (\d+)\s*([-+*])\s*(\d+)\?")
# data sources whose rows warm up as tool conversations
TOOL_SOURCES = ("arithmetic_tools",)


def tool_use_example(row: dict, tokenizer, template: dict | None = None):
  """(prompt ids, answer ids, answer loss mask) of a tool task row: the answer part is
  the calculator call, the tool's message (masked out) and the final answer."""
  text = row["prompt"][-1]["content"]
  found = QUESTION.search(text)
  if found is None:
    raise ValueError(f"sft warm-up: no 'What is <a><op><b>?' question in {text!r}")
  expression = "".join(found.groups())
  calculator = Calculator()
  messages = ToolEnvironment([calculator]).reset(row)
  prompt = tokenizer.encode_chat(messages, add_generation_prompt=True, **(template or {}))
  eos = tokenizer.eos_ids[0]
  call = json.dumps({"name": "calculator", "arguments": {"expression": expression}})
  first = tokenizer.encode(f"<tool_call>{call}</tool_call>") + [eos]
  result = {"role": "tool", "content": calculator.execute({"expression": expression})}
  between = MessageDelta(tokenizer, **(template or {})).ids([result])
  final = tokenizer.encode(str(row["reward_model"]["ground_truth"])) + [eos]
  answer = first + between + final
  return prompt, answer, [1] * len(first) + [0] * len(between) + [1] * len(final)
