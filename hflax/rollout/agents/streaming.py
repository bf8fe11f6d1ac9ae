"""Agent trajectories as the samples of an asynchronous rollout stream.

hflax.rollout.stream runs prompt groups through a rollout engine with a staleness bound;
`Trajectories` makes each of a group's samples a multi-turn trajectory of the agent loop
(AgentLoop's incremental interface) instead of one request. The stream's engine steps
are the loop's `advance`: one engine step, then the environment steps due. With the loop
in lockstep (each environment step waited for after the engine step it ran beside), the
engine step at which a trajectory's next turn starts, and so the weights that sample it,
follow the calls made and not timing: an asynchronous run is reproducible.

A trajectory spanning a weight update keeps every token's version: turns in flight
decode on with the new weights (a partial rollout), later turns sample with them, and
the stream ages the trajectory by its oldest model token (loop.sampled_versions while it
runs). Trajectory j of a group samples turn t as row (first_row + j) * max_turns + t with
the group's key: sample i * n + j of multi_turn_rollout's batch, so a group gets the
tokens the synchronous rollout gives the same prompt and key.

On an engine spanning several processes (a Ray rollout pool's jax.distributed job), each
process runs the same loop, kept equal by hflax.rollout.agents.shared_tools.

Checkpoints hold finished trajectories whole (ids, loss mask, log-probs, versions, turns,
rewards, stop, counts, segments); an unfinished one is started again from its prompt.
"""
from __future__ import annotations

import dataclasses
from typing import Hashable

import jax
import numpy as np

from hflax.rollout.agents.loop import AgentLoop, Trajectory, model_versions
from hflax.rollout.agents.rollout import MultiTurn, environments


class Trajectories:
  """hflax.rollout.stream's samples as agent trajectories on `loop` (its engine the
  stream's). A group's context: {"raw_prompt": messages, "data_source": its tools' source,
  "max_tokens": a trajectory's token limit}."""

  def __init__(self, loop: AgentLoop, settings: MultiTurn):
    self.loop, self.settings = loop, settings

  @property
  def busy(self) -> int:
    return self.loop.busy

  def submit(self, group, j: int):
    context = group.context
    env = environments(self.settings, [context["data_source"]])[0]
    self.loop.submit((group.index, j), env, {"prompt": list(context["raw_prompt"])},
                     row=(group.first_row + j) * self.loop.max_turns,
                     key=jax.random.wrap_key_data(group.key), max_tokens=context["max_tokens"])

  def step(self) -> list[tuple[Hashable, Trajectory]]:
    return [(t.index, t) for t in self.loop.advance()]

  def versions(self, trajectory: Trajectory) -> list[int]:
    return model_versions(trajectory)

  def sampled_versions(self, sample_id: Hashable) -> list[int]:
    return self.loop.sampled_versions(sample_id)

  def abort(self, sample_id: Hashable):
    self.loop.abort(sample_id)

  def to_state(self, t: Trajectory) -> dict:
    return trajectory_state(t)

  def from_state(self, sample_id: Hashable, group, d: dict) -> Trajectory:
    return trajectory_from_state(sample_id, d)


def trajectory_state(t: Trajectory) -> dict:
  """A finished trajectory as checkpoint host values (log-probs as float32, exactly)."""
  return {"token_ids": list(t.token_ids), "model_mask": list(t.model_mask),
          "log_probs": np.asarray(t.log_probs, np.float32), "versions": list(t.versions),
          "prompt_len": t.prompt_len, "turns": list(t.turns), "rewards": list(t.rewards),
          "stop": t.stop, "metrics": dict(t.metrics),
          "segments": [trajectory_state(s) for s in t.segments]}


def trajectory_from_state(index: Hashable, d: dict) -> Trajectory:
  t = Trajectory(index, [int(x) for x in d["token_ids"]], [bool(m) for m in d["model_mask"]],
                 [float(x) for x in np.asarray(d["log_probs"])], [int(v) for v in d["versions"]],
                 int(d["prompt_len"]))
  return dataclasses.replace(t, turns=list(d["turns"]), rewards=[float(r) for r in d["rewards"]],
                             stop=d["stop"], metrics=dict(d["metrics"]),
                             segments=[trajectory_from_state(index, s) for s in d["segments"]])


def tools_overhead(settings: MultiTurn, tokenizer) -> int:
  """The most tokens an environment's tools add to a chat prompt (the tools' system
  message, against the template's own), over the tool sets a run may use: a stream's
  engine, built before any prompt is seen, holds data.max_prompt_length plus this."""
  from hflax.rollout.agents.rollout import BUILTIN_TOOLS
  sources = [""] if settings.tool_config_path else sorted(BUILTIN_TOOLS)
  most = 0
  for source in sources:
    env = environments(settings, [source])[0]
    for messages in ([{"role": "user", "content": "?"}],
                     [{"role": "system", "content": "?"}, {"role": "user", "content": "?"}]):
      plain = tokenizer.encode_chat(messages, add_generation_prompt=True)
      tooled = tokenizer.encode_chat(env.reset({"prompt": messages}), add_generation_prompt=True)
      most = max(most, len(tooled) - len(plain))
  return most
