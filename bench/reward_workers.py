#!/usr/bin/env python
"""Step time with the reward in a worker process against the reward in the trainer.

A user's reward function (reward.custom_fn) runs in a worker process of hflax.sandbox's
pool, so that its crash, hang or memory bomb ends the worker and not the run; the
built-in rules run in the trainer's process. This benchmark runs the same job twice over,
alternating, through `python -m hflax.launch`:

  * "in_process": the job as it ships (its data source's built-in rule);
  * "worker": the same rule, loaded from a file as reward.custom_fn, so that every
    batch's scoring crosses to the worker process and back.

Everything else (seed, data, sampling) is the same, so both arms see the same responses
and must log the same rewards (checked: a difference is a bug, not noise). Each run's
step time is the median of `timing_s/step` over its steps after the first (which
compiles; a shared compilation cache also serves the later runs); the ratio is
worker / in_process over the medians of all runs of each arm. A run of each arm first
fills the compilation cache and is not counted. The matmul peak is measured before and
after, since the machine's speed drifts.

  python bench/reward_workers.py                      # the default job (ppo.py) and the SmolLM2 recipe
  python bench/reward_workers.py --jobs ppo.py --repeats 3
  python bench/reward_workers.py --quick              # smoke: 2 steps, one repeat

Exit status 0 whether or not the target (worker within 5% of in_process) is met.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import platform
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
RULES = HERE.parent / "hflax" / "rewards" / "rules.py"

# Each job: its config, the settings that keep it to the step loop (no validation, no
# checkpoints, no export), and the rule its data source uses.
JOBS = {
    "ppo.py": dict(rule="arithmetic_exact_match",
                   settings=["--config.trainer.sft_warmup.steps=200"]),
    "grpo_smollm2.py": dict(rule="arithmetic_last_integer", settings=[]),
}
TARGETS = {"ppo.py": "reward_worker_default", "grpo_smollm2.py": "reward_worker_recipe"}
COMMON = ["--config.trainer.val_every=0", "--config.trainer.val_before_train=False",
          "--config.trainer.save_every=1000", "--config.trainer.export_hf=False",
          "--config.trainer.log=('jsonl',)"]


def reward_file(directory: pathlib.Path, rule: str) -> pathlib.Path:
  """A custom_fn file that scores with the built-in rule, loaded from its source file (not
  through the hflax package, whose import pulls JAX into the worker)."""
  path = directory / "reward_in_worker.py"
  path.write_text(textwrap.dedent(f"""\
      import importlib.util
      _spec = importlib.util.spec_from_file_location("hflax_rules", {str(RULES)!r})
      _rules = importlib.util.module_from_spec(_spec)
      _spec.loader.exec_module(_rules)

      def compute_score(data_source, solution_str, ground_truth, extra_info=None):
        return _rules.{rule}(solution_str, ground_truth, extra_info)
      """))
  return path


def run_job(job: str, arm: str, steps: int, workdir: pathlib.Path, cache: pathlib.Path,
            tag: str) -> dict:
  spec = JOBS[job]
  run_dir = workdir / f"{pathlib.Path(job).stem}-{arm}-{tag}"
  cmd = [sys.executable, "-m", "hflax.launch", "--config", job, *COMMON, *spec["settings"],
         f"--config.trainer.total_steps={steps}", f"--config.trainer.run_dir={run_dir}",
         f"--config.trainer.compile_cache_dir={cache}"]
  if arm == "worker":
    cmd.append(f"--config.reward.custom_fn.path={reward_file(workdir, spec['rule'])}")
  start = time.perf_counter()
  done = subprocess.run(cmd, capture_output=True, text=True)
  wall = time.perf_counter() - start
  if done.returncode != 0:
    raise SystemExit(f"{job} ({arm}) failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
  rows = {}
  for line in (run_dir / "metrics.jsonl").read_text().splitlines():
    row = json.loads(line)
    if "timing_s/step" in row:
      rows[row["step"]] = row
  steps_logged = [rows[s] for s in sorted(rows)]
  return dict(wall_s=wall, step_s=[r["timing_s/step"] for r in steps_logged],
              rewards=[r.get("critic/score/mean", r.get("reward/mean")) for r in steps_logged])




def median_after_first(step_s: list[float]) -> float:
  return statistics.median(step_s[1:] if len(step_s) > 1 else step_s)


def bench_job(job: str, steps: int, repeats: int, workdir: pathlib.Path) -> dict:
  cache = workdir / "jax-cache"
  arms = ("in_process", "worker")
  for arm in arms:  # fill the compilation cache; not counted
    run_job(job, arm, 2, workdir, cache, "warm")
  runs = {arm: [] for arm in arms}
  for r in range(repeats):
    order = arms if r % 2 == 0 else arms[::-1]  # alternate which arm goes first
    for arm in order:
      runs[arm].append(run_job(job, arm, steps, workdir, cache, str(r)))
      print(f"  {job} {arm} #{r}: median step "
            f"{median_after_first(runs[arm][-1]['step_s']):.3f} s", flush=True)
  for a, b in zip(runs["in_process"], runs["worker"]):
    if None in a["rewards"]:
      raise SystemExit(f"{job}: critic/score/mean missing from the metrics")
    if a["rewards"] != b["rewards"]:
      raise SystemExit(f"{job}: the two arms logged different rewards: {a['rewards']} vs "
                       f"{b['rewards']}")
  medians = {arm: [median_after_first(x["step_s"]) for x in runs[arm]] for arm in arms}
  ratio = statistics.median(medians["worker"]) / statistics.median(medians["in_process"])
  return dict(medians=medians, ratio=ratio, runs=runs)


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--jobs", nargs="+", default=list(JOBS), choices=list(JOBS))
  parser.add_argument("--steps", type=int, default=6, help="RL steps per run")
  parser.add_argument("--repeats", type=int, default=2, help="runs of each arm")
  parser.add_argument("--quick", action="store_true", help="smoke: 2 steps, one repeat")
  parser.add_argument("--out", default="", help="write a bench/results/ file here")
  parser.add_argument("--machine", default="vm", help="the machine's key in --out's file")
  args = parser.parse_args()
  if args.quick:
    args.steps, args.repeats = 2, 1

  from common import cpu_description, matmul_peaks  # noqa: PLC0415
  matmul_peak_gflops = lambda: matmul_peaks()["float32"] / 1e9  # noqa: E731
  peak_before = matmul_peak_gflops()
  load_before = os.getloadavg()[0]
  results = {}
  with tempfile.TemporaryDirectory(prefix="hflax-reward-workers-") as tmp:
    for job in args.jobs:
      results[job] = bench_job(job, args.steps, args.repeats, pathlib.Path(tmp))
  peak_after, load_after = matmul_peak_gflops(), os.getloadavg()[0]

  print(f"\n{cpu_description()}; load {load_before:.2f} -> {load_after:.2f}; fp32 matmul "
        f"peak {peak_before:.0f} -> {peak_after:.0f} GFLOP/s")
  print(f"{'job':18s} {'in_process (s/step)':>22s} {'worker (s/step)':>18s} {'ratio':>7s}")
  for job, r in results.items():
    print(f"{job:18s} {statistics.median(r['medians']['in_process']):22.3f} "
          f"{statistics.median(r['medians']['worker']):18.3f} {r['ratio']:7.3f}"
          f"  (target <= 1.05)")
  if args.out:  # one file of bench/results/ (bench/results_table.py's schema)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=HERE).stdout.strip()
    figures = [dict(target=TARGETS[job], unit="s per step (median over runs of each run's "
                    "median after its first step)",
                    hflax=r["medians"]["worker"], peer=r["medians"]["in_process"],
                    peer_name="the same rule in the trainer's process",
                    ratio=round(r["ratio"], 4), ratio_is="worker / in-process (median step)",
                    note=f"{args.repeats} runs x {args.steps} steps per arm")
               for job, r in results.items()]
    record = dict(
        script="bench/reward_workers.py", command=" ".join(["python", *sys.argv]),
        commit=commit, date=time.strftime("%Y-%m-%d"), machine=args.machine,
        cpu=cpu_description(),
        load=f"{load_before:.2f} at the start, {load_after:.2f} at the end",
        figures=figures,
        notes=f"fp32 matmul peak {peak_before:.0f} GFLOP/s before, {peak_after:.0f} after; "
              "step times per run: " + json.dumps(
                  {job: {arm: [x["step_s"] for x in r["runs"][arm]] for arm in r["runs"]}
                   for job, r in results.items()}))
    pathlib.Path(args.out).write_text(json.dumps(record, indent=1) + "\n")

if __name__ == "__main__":
  main()
