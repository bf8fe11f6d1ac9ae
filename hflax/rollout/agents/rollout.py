"""Multi-turn rollouts of a batch of prompts, for the trainer: the agent loop on a rollout
engine over the generation weights, its trajectories as the batch sampler's fields.

The actor calls `multi_turn_rollout` in place of the batch sampler when the run's
`rollout.multi_turn.enable` is set. Each of a prompt's n samples is a trajectory of its
own (GRPO's group is the prompt's n trajectories). A trajectory's row: "prompts" its
first prompt (the chat messages with the tools rendered), "responses" every later token
(the model's turns and the messages between them) up to the response width,
"response_mask" the model's tokens only. Each row's extra_info gains the trajectory's
turns, tool calls, errors, stop reason and final turn's text, for reward functions.

With rewrite_history a trajectory whose template rewrites its history (Qwen3's drops
earlier reasoning) is several rows, its segments (hflax.rollout.agents.segments); the
fields then carry "segment_owner", each row's trajectory, and segment_fields pads them to
a row count the update takes and marks which rows make one trajectory.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Sequence

import numpy as np

from hflax.models.tokenizer import Tokenizer
from hflax.rollout.agents.environment import ToolEnvironment
from hflax.rollout.agents.loop import to_batch_fields
from hflax.rollout.agents.shared_tools import agent_loop
from hflax.rollout.agents.segments import trajectory_rows
from hflax.rollout.agents.tool_config import Calculator, load_tools
from hflax.rollout.decoding import SamplingParams
from hflax.rollout.engine import RolloutEngine
from hflax.rollout.sampler import length_bucket
from hflax.sandbox.class_tool import close_tools

# data sources whose tools are built in (used when no tool config file is given)
BUILTIN_TOOLS = {"arithmetic_tools": lambda: [Calculator()]}


@dataclasses.dataclass(frozen=True)
class MultiTurn:
  """rollout.multi_turn: max_turns model turns a trajectory; max_turn_len the most tokens
  the messages after one turn may add; tool_config_path a verl-format tool file (empty:
  the data source's built-in tools); format the tool-call parser; tool_timeout_s a call's
  limit; slots the engine's decode slots (0: every trajectory at once); turn_tokens the
  most tokens one model turn samples (0: as many as the response width leaves);
  rewrite_history: re-render the conversation after each turn and, where the template
  rewrote it, continue as a new segment (AgentLoop's rewrite_history)."""
  max_turns: int = 4
  max_turn_len: int = 256
  turn_tokens: int = 0
  tool_config_path: str = ""
  format: str = "hermes"
  tool_timeout_s: float = 30.0
  slots: int = 0
  rewrite_history: bool = False


# A tool config file's tools, kept across steps: (path, timeout) -> ((mtime_ns, size), tools).
_LOADED: dict[tuple[str, float], tuple[tuple[int, int], list]] = {}


def config_tools(path: str, timeout_s: float = 30.0) -> list:
  """load_tools(path, timeout_s), read once per run: every later step gets the same tool
  objects (a Python tool's sandbox pool, a user class's worker processes, a client's
  connection are built once) until the file changes on disk (its modification time or
  size), when it is read again and the old tools' workers end."""
  path = os.path.abspath(path)
  try:
    st = os.stat(path)
  except OSError:
    return load_tools(path, timeout_s=timeout_s)  # its one-line error
  stamp = (st.st_mtime_ns, st.st_size)
  cached = _LOADED.get((path, timeout_s))
  if cached is None or cached[0] != stamp:
    if cached is not None:
      close_tools(cached[1])
    _LOADED[path, timeout_s] = cached = (stamp, load_tools(path, timeout_s=timeout_s))
  return cached[1]


def environments(settings: MultiTurn, data_sources: Sequence[str]) -> list[ToolEnvironment]:
  """One tool environment per trajectory, with the config file's tools (loaded once, see
  config_tools) or the data source's built-in ones."""
  shared = (config_tools(settings.tool_config_path, settings.tool_timeout_s)
            if settings.tool_config_path else None)
  out = []
  for source in data_sources:
    if shared is None and source not in BUILTIN_TOOLS:
      raise ValueError(f"rollout.multi_turn: data source {source!r} has no built-in tools; set "
                       f"rollout.multi_turn.tool_config_path (built in: {sorted(BUILTIN_TOOLS)})")
    tools = shared if shared is not None else BUILTIN_TOOLS[source]()
    out.append(ToolEnvironment(tools, parser=settings.format,
                               tool_timeout_s=settings.tool_timeout_s))
  return out


def multi_turn_rollout(graphdef, state, *, version: int, mesh, sampling: SamplingParams,
                       settings: MultiTurn, tokenizer: Tokenizer, raw_prompts: Sequence,
                       data_sources: Sequence[str], extra_info: Sequence, rng,
                       response_width: int) -> tuple[dict, list[dict], dict]:
  """Trajectories for every prompt x sampling.n on (graphdef, state), the generation
  weights of `version` on `mesh`. Returns (the sampler's fields as numpy arrays, one row
  per trajectory in prompt-major order, each trajectory's extra_info, the loop's
  metrics). Where a history was rewritten the rows are the segments, in the same order,
  and fields["segment_owner"] gives each row's trajectory."""
  n = sampling.n
  rows = len(raw_prompts) * n
  raw = [p for p in raw_prompts for _ in range(n)]
  envs, prompts = chat_prompts(settings, tokenizer, raw,
                               [s for s in data_sources for _ in range(n)])
  samples = [{"prompt": list(p)} for p in raw]
  width = length_bucket(max(len(p) for p in prompts))
  replicas = mesh.shape.get("data", 1) if mesh is not None else 1
  slots = settings.slots or rows
  slots += -slots % replicas
  shape = engine_widths(settings, width, response_width)
  engine = RolloutEngine(graphdef, state, dataclasses.replace(
      sampling, n=1, max_new_tokens=shape.pop("max_new_tokens")), slots=slots, **shape,
      mesh=mesh, version=version, key=rng)
  # Over several processes (a Ray pool's), process 0 runs the tools for all.
  loop = agent_loop(engine, tokenizer, max_turns=settings.max_turns,
                    max_tokens=width + response_width, rewrite_history=settings.rewrite_history)
  trajectories, metrics = loop.run(envs, samples)
  fields, infos = trajectory_fields(trajectories, [x for x in extra_info for _ in range(n)],
                                    pad_id=tokenizer.pad_id, prompt_width=width,
                                    response_width=response_width)
  return fields, infos, metrics


def chat_prompts(settings: MultiTurn, tokenizer: Tokenizer, raw_prompts: Sequence,
                 data_sources: Sequence[str]) -> tuple[list, list[list[int]]]:
  """Each prompt's environment (its data source's tools) and its ids: the chat messages
  with the tools rendered, ready for the model's first turn."""
  envs = environments(settings, list(data_sources))
  ids = [tokenizer.encode_chat(env.reset({"prompt": list(p)}), add_generation_prompt=True)
         for env, p in zip(envs, raw_prompts)]
  return envs, ids


def engine_widths(settings: MultiTurn, width: int, response_width: int) -> dict:
  """An agent engine's widths (RolloutEngine's keywords) for rendered prompts up to `width`
  tokens and trajectories of response_width more, and a turn's new-token limit."""
  # A new segment's context is a fresh request's prompt: as long as a whole trajectory.
  prompt_len = width + response_width if settings.rewrite_history else width
  return {"max_prompt_len": prompt_len, "max_turn_len": settings.max_turn_len,
          "max_context_len": prompt_len + response_width,
          "max_new_tokens": min(settings.turn_tokens or response_width, response_width)}


def trajectory_fields(trajectories: Sequence, extra_info: Sequence, *, pad_id: int,
                      prompt_width: int, response_width: int) -> tuple[dict, list[dict]]:
  """The trajectories as the sampler's fields (one row each, or one a segment where a
  history was rewritten, with fields["segment_owner"]) and each one's extra_info with its
  agent record (turns, stop, final turn, tool counts): what multi_turn_rollout and the
  asynchronous stream (hflax.launch.async_mode) hand the trainer."""
  segments, owner = trajectory_rows(trajectories)
  if len(segments) == len(trajectories):  # every history append-only: one row a trajectory
    fields = to_batch_fields(trajectories, pad_id, prompt_width=prompt_width,
                             response_width=response_width)
  else:  # a segment's prompt is its shared prefix, so its rest may outgrow the response
    longest = max(len(r.token_ids) - r.prompt_len for r in segments)
    fields = to_batch_fields(segments, pad_id, prompt_width=prompt_width,
                             response_width=max(response_width, longest))
    fields["segment_owner"] = np.asarray(owner, np.int32)
  infos = []
  for t, info in zip(trajectories, extra_info, strict=True):
    agent = {"turns": len(t.turns), "stop": t.stop, "final_turn": t.turns[-1] if t.turns else "",
             **{k: t.metrics.get(k, 0) for k in ("tool_calls", "tool_errors", "tool_timeouts")}}
    infos.append({**(info or {}), "agent": agent})
  return fields, infos


def segment_fields(fields: dict, owner, multiple: int) -> tuple[dict, np.ndarray]:
  """Segment rows for the update: padded to a multiple of `multiple` rows (the
  mini-batch) with copies of the last row whose loss mask is empty, and "segment_head",
  each row's index of its trajectory's last segment row (-1 on padding rows: see
  hflax.algorithms.segmented). Returns (the fields, each row's trajectory)."""
  owner = np.asarray(owner)
  rows = len(owner)
  pad = -rows % max(multiple, 1)
  index = np.concatenate([np.arange(rows), np.full(pad, rows - 1)])
  out = {k: np.asarray(v)[index] for k, v in fields.items()}
  out["response_mask"][rows:] = False
  last = {o: r for r, o in enumerate(owner)}
  out["segment_head"] = np.asarray([last[o] for o in owner] + [-1] * pad, np.int32)
  return out, owner[index]
