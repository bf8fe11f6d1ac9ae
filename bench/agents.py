"""Multi-turn agent rollouts: does decoding go on while tools run, and what does the kept
KV cache save? Side by side in one run, on SmolLM2-135M-Instruct (or --toy):

  instant    every trajectory's tool answers at once
  slow tools each tool call takes --tool-ms (default 100 ms) on a host thread
  re-prefill instant tools, but each turn prefills its whole context afresh instead of
             continuing the trajectory's kept cache with the new tokens only

Each trajectory is `--turns` greedy model turns (each ending at the end token or after
--turn-tokens), a tool message after each but the last. Greedy decoding makes the three
runs sample the same tokens (counted and compared); the ratios are wall-clock times.

  python bench/agents.py                     # 64 trajectories x 3 turns on SmolLM2
  python bench/agents.py --toy --quick       # a smoke run
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/common.py

from hflax.platforms.cpu.process import keep_freed_memory  # noqa: E402

keep_freed_memory()

import jax  # noqa: E402

import common  # noqa: E402
from hflax.models import ModelConfig, create  # noqa: E402
from hflax.models.tokenizer import ByteTokenizer, load_tokenizer  # noqa: E402
from hflax.rollout import RolloutEngine, SamplingParams  # noqa: E402
from hflax.rollout.agents import AgentLoop, Observation, Turn  # noqa: E402

QUESTIONS = ["What is {a} times {b}?", "Add {a} and {b}, then explain.",
             "Is {a} larger than {b}? Say why.", "Write a haiku about the number {a}."]


class ToolEcho:
  """A tool message after every model turn but the last, each after `seconds`."""

  def __init__(self, turns: int, seconds: float):
    self.turns, self.seconds = turns, seconds

  def reset(self, sample):
    return [{"role": "user", "content": sample}]

  def step(self, turn: Turn) -> Observation:
    if turn.index + 1 >= self.turns:
      return Observation([], reward=1.0, done=True)
    time.sleep(self.seconds)
    return Observation([{"role": "tool", "content": f"result: {len(turn.text) * 37}"}],
                       counts={"tool_calls": 1, "tool_seconds": self.seconds})


def load(toy: bool):
  if toy:
    tokenizer = ByteTokenizer()
    cfg = ModelConfig(vocab_size=264, hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2)
    return tokenizer, create(cfg, seed=0)
  from hflax.models.hf import load_checkpoint
  _, graphdef, state = load_checkpoint(common.real_model_dir(), dtype="float32",
                                       param_dtype="float32")
  return load_tokenizer(common.real_model_dir()), (graphdef, state)


def run(model, tokenizer, args, tool_s: float, reuse_cache: bool) -> dict:
  params = SamplingParams(max_new_tokens=args.turn_tokens, temperature=0,
                          eos_ids=tuple(tokenizer.eos_ids), pad_id=tokenizer.pad_id)
  context = args.prompt_len + args.turns * (args.turn_tokens + args.tool_tokens)
  engine = RolloutEngine(*model, params, slots=args.slots, steps_per_call=args.steps_per_call,
                         max_prompt_len=args.prompt_len if reuse_cache else context,
                         max_turn_len=args.tool_tokens, max_context_len=context)
  loop = AgentLoop(engine, tokenizer, max_turns=args.turns, reuse_cache=reuse_cache)
  samples = [QUESTIONS[i % len(QUESTIONS)].format(a=100 + 7 * i, b=13 + i)
             for i in range(args.trajectories)]
  start = time.perf_counter()
  trajectories, metrics = loop.run([ToolEcho(args.turns, tool_s) for _ in samples], samples)
  seconds = time.perf_counter() - start
  return {"seconds": seconds, "metrics": metrics,
          "model_tokens": sum(sum(t.model_mask) for t in trajectories),
          "tokens": [t.token_ids for t in trajectories]}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--toy", action="store_true", help="a random 2-layer byte-level model")
  parser.add_argument("--quick", action="store_true", help="8 trajectories, short turns")
  parser.add_argument("--trajectories", type=int, default=64)
  parser.add_argument("--turns", type=int, default=3)
  parser.add_argument("--turn-tokens", type=int, default=48, help="most tokens a model turn")
  parser.add_argument("--tool-tokens", type=int, default=32, help="most tokens a tool turn")
  parser.add_argument("--prompt-len", type=int, default=64)
  parser.add_argument("--tool-ms", type=float, default=100.0)
  parser.add_argument("--slots", type=int, default=32)
  parser.add_argument("--steps-per-call", type=int, default=8)
  parser.add_argument("--json", default="", help="also write the figures to this file")
  args = parser.parse_args(argv)
  if args.quick:
    args.trajectories, args.turn_tokens, args.slots = 8, 16, 8
  if args.toy:
    args.prompt_len = max(args.prompt_len, 96)
  print(f"jax {jax.__version__} devices {jax.devices()}; load {common.load_average()}")
  tokenizer, model = load(args.toy)
  runs = {"instant": (0.0, True), "slow tools": (args.tool_ms / 1e3, True),
          "re-prefill": (0.0, False)}
  for setting in runs.values():  # each run's admissions compile their own prefill shapes
    run(model, tokenizer, args, *setting)
  results = {name: run(model, tokenizer, args, *setting) for name, setting in runs.items()}
  base = results["instant"]
  print(f"{args.trajectories} trajectories x {args.turns} turns, {base['model_tokens']} model "
        f"tokens, tools {args.tool_ms:g} ms in 'slow tools'")
  for name, r in results.items():
    same = r["tokens"] == base["tokens"]
    print(f"  {name:10s} {r['seconds']:7.2f} s  {r['seconds'] / base['seconds']:5.2f}x instant  "
          f"decode {r['metrics']['timing_s/agent_decode_seconds']:6.2f} s  same tokens: {same}")
  figures = {name: {"seconds": r["seconds"], "vs_instant": r["seconds"] / base["seconds"],
                    "same_tokens": r["tokens"] == base["tokens"]} for name, r in results.items()}
  if args.json:
    with open(args.json, "w") as f:
      json.dump({"args": vars(args), "figures": figures}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
