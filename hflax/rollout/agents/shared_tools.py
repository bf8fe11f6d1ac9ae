"""The agent loop of an engine spanning several processes (a Ray pool's jax.distributed
job), where every process runs the same loop over the same requests.

A tool is a side effect whose result and latency may differ between processes (a
sandbox's timeout, a service's answer), so process 0 alone runs the environment steps
and, after each engine step, picks the ones due (as AgentLoop._ready does, lockstep or
not) and broadcasts them with their observations: every process then admits the same
continuations at the same engine step, and each tool runs once. The synchronous
multi-turn rollout and the asynchronous stream both take their loop from `agent_loop`.
"""
from __future__ import annotations

import concurrent.futures
import pickle
from typing import Hashable

import jax

from hflax.rollout.agents.environment import Observation
from hflax.rollout.agents.loop import AgentLoop
from hflax.rollout.host import broadcast_bytes


def agent_loop(engine, tokenizer, **settings) -> AgentLoop:
  """AgentLoop in a single process; SharedToolsLoop over several (module docstring)."""
  loop_class = AgentLoop if jax.process_count() == 1 else SharedToolsLoop
  return loop_class(engine, tokenizer, **settings)


class SharedToolsLoop(AgentLoop):
  """An AgentLoop run by every process of a jax.distributed job over one engine (each
  reads the engine's tokens with a collective, so all hold the same requests); process 0
  alone runs the tools (module docstring)."""

  def _run_environment(self, step) -> concurrent.futures.Future:
    if jax.process_index() == 0:
      return super()._run_environment(step)
    return concurrent.futures.Future()  # stands for process 0's step; never run here

  def _ready(self, stepped: bool) -> list[tuple[Hashable, int, Observation]]:
    if not self._pending:  # the same pending steps on every process: none to broadcast
      return []
    if jax.process_index() != 0:
      status, value = pickle.loads(broadcast_bytes(None))
      if status != "ok":
        raise RuntimeError(f"the agent loop's environment step failed in process 0: {value}")
      by_step = {step: future for future, step in self._pending.items()}
      for i, turn, _ in value:
        del self._pending[by_step[i, turn]]
      return value
    try:
      ready = super()._ready(stepped)
      payload = pickle.dumps(("ok", ready))
    except Exception as e:  # the others wait in the broadcast: they raise too
      broadcast_bytes(pickle.dumps(("error", f"{type(e).__name__}: {e}")))
      raise
    broadcast_bytes(payload)
    return ready
