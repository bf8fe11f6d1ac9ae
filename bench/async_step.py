#!/usr/bin/env python
"""Step time of trainer.mode one_step_off against sync on a split placement.

The split (placement role "rollout", docs/async.md): of the CPU's two simulated devices,
one trains the actor and the other generates with the weights copied to it after each
update. In sync mode the two take turns; in one_step_off the batch of step k + 1 is
generated (by the weights before step k's update) while step k trains, so the two devices
work at the same time and a step costs about the longer of generation and training rather
than their sum. Both arms run the same placement, config and seed through
`python -m hflax.launch`, alternating which goes first; each run's step time is the median
of timing_s/step after its first step (which compiles), and the ratio is one_step_off /
sync over the medians of all runs of each arm. A run of each arm first fills a shared
compilation cache and is not counted. The matmul peak is read before and after, since the
machine's speed drifts.

With --accuracy every run validates once at its end (greedy, the recipe's held-out
prompts), and the held-out accuracy reached per training second (the sum of its
timing_s/step) is printed beside the step times.

  python bench/async_step.py                    # the SmolLM2 recipe (grpo_smollm2.py)
  python bench/async_step.py --repeats 3 --accuracy --out bench/results/DATE-async-vm.json
  python bench/async_step.py --quick            # smoke: the toy model, 3 steps, one repeat

Exit status 0 whether or not the target (one_step_off <= 0.65x sync) is met.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
ARMS = ("sync", "one_step_off")
TARGET = 0.65

# The job: the recipe, or the random byte-vocabulary model of the CLI tests (--quick),
# which bench/common.py defines for learning.py's smoke run too.
RECIPE = "from hflax.configs.grpo_smollm2 import get_config as job"
TOY = f"""\
import sys
sys.path.insert(0, {str(HERE)!r})
from common import toy_config as job
"""


def config_file(directory: pathlib.Path, toy: bool) -> pathlib.Path:
  """A launcher config: the job on the split placement (actor on pool "train", its
  generation on pool "rollout", one device each); the mode and steps come as flags."""
  path = directory / "async_step_config.py"
  path.write_text(textwrap.dedent(f"""\
      from hflax.launch.models import needed_roles
      from hflax.sharding.placement import split_rollout
      {RECIPE if not toy else ""}
      """) + (TOY if toy else "") + textwrap.dedent("""\

      def get_config():
        c = job()
        spec = split_rollout(needed_roles(c), train=1, rollout=1)
        c.placement.update(kind="custom", pools=spec["pools"], roles=spec["roles"])
        c.trainer.update(devices=2, val_every=0, val_before_train=False, save_every=1000,
                         export_hf=False, log=("jsonl",))
        return c
      """))
  return path


def run_arm(config: pathlib.Path, arm: str, steps: int, workdir: pathlib.Path,
            cache: pathlib.Path, tag: str, accuracy: bool) -> dict:
  run_dir = workdir / f"{arm}-{tag}"
  cmd = [sys.executable, "-m", "hflax.launch", "--config", str(config),
         f"--config.trainer.mode={arm}", f"--config.trainer.total_steps={steps}",
         f"--config.trainer.run_dir={run_dir}", f"--config.trainer.compile_cache_dir={cache}"]
  if accuracy:
    cmd.append(f"--config.trainer.val_every={steps}")
  env = {**os.environ, "HFLAX_CPU_DEVICES": "2"}
  start = time.perf_counter()
  done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE.parent)
  wall = time.perf_counter() - start
  if done.returncode != 0:
    raise SystemExit(f"{arm} failed:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}")
  steps_logged, acc = {}, None
  for line in (run_dir / "metrics.jsonl").read_text().splitlines():
    row = json.loads(line)
    if "timing_s/step" in row:
      steps_logged[row["step"]] = row
    acc = held_out_accuracy(row) if held_out_accuracy(row) is not None else acc
  rows = [steps_logged[s] for s in sorted(steps_logged)]
  return dict(wall_s=wall, step_s=[r["timing_s/step"] for r in rows],
              weight_sync_s=[r.get("timing_s/weight_sync", 0.0) for r in rows],
              weight_sync_bytes=rows[-1].get("rollout/weight_sync_bytes", 0.0),
              staleness_max=[r.get("rollout/staleness_max", 0.0) for r in rows],
              accuracy=acc)


def held_out_accuracy(row: dict) -> float | None:
  """val-core's acc mean@1 where the reward reports one, else its reward mean@1 (the
  recipe's reward is 0 or 1)."""
  for kind in ("acc", "reward"):
    keys = sorted(k for k in row if k.startswith("val-core/") and k.endswith(f"/{kind}/mean@1"))
    if keys:
      return float(row[keys[0]])
  return None


def median_after_first(step_s: list[float]) -> float:
  return statistics.median(step_s[1:] if len(step_s) > 1 else step_s)


def summary(runs: dict) -> dict:
  """Per arm, each run's median step time; the ratio one_step_off / sync of their medians;
  held-out accuracy per training second where the runs validated."""
  medians = {arm: [median_after_first(r["step_s"]) for r in runs[arm]] for arm in runs}
  ratio = statistics.median(medians["one_step_off"]) / statistics.median(medians["sync"])
  rate = {arm: [r["accuracy"] / sum(r["step_s"]) for r in runs[arm] if r["accuracy"] is not None]
          for arm in runs}
  return dict(medians=medians, ratio=ratio, accuracy_per_s=rate)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--steps", type=int, default=8, help="RL steps per run")
  parser.add_argument("--repeats", type=int, default=2, help="runs of each arm")
  parser.add_argument("--accuracy", action="store_true",
                      help="validate at each run's end: held-out accuracy per second")
  parser.add_argument("--quick", action="store_true",
                      help="smoke: the toy model, 3 steps, one repeat, no warm-up runs")
  parser.add_argument("--out", default="", help="write a bench/results/ file here")
  parser.add_argument("--machine", default="vm", help="the machine's key in --out's file")
  args = parser.parse_args(argv)
  if args.quick:
    args.steps, args.repeats = 3, 1

  from common import matmul_peaks  # noqa: PLC0415
  from common import cpu_description  # noqa: PLC0415
  peak = lambda: matmul_peaks()["float32"] / 1e9  # noqa: E731
  peak_before, load_before = peak(), os.getloadavg()[0]
  runs = {arm: [] for arm in ARMS}
  with tempfile.TemporaryDirectory(prefix="hflax-async-step-") as tmp:
    workdir = pathlib.Path(tmp)
    config, cache = config_file(workdir, args.quick), workdir / "jax-cache"
    if not args.quick:
      for arm in ARMS:  # fill the compilation cache; not counted
        run_arm(config, arm, 2, workdir, cache, "warm", False)
    for r in range(args.repeats):
      for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):  # alternate which arm goes first
        runs[arm].append(run_arm(config, arm, args.steps, workdir, cache, str(r), args.accuracy))
        print(f"  {arm} #{r}: median step {median_after_first(runs[arm][-1]['step_s']):.3f} s, "
              f"weight sync {statistics.median(runs[arm][-1]['weight_sync_s']):.3f} s",
              flush=True)
  for run in runs["one_step_off"]:
    if max(run["staleness_max"][1:], default=1.0) != 1.0:
      raise SystemExit(f"one_step_off: batches after the first should lag one version, got "
                       f"{run['staleness_max']}")
  result = summary(runs)
  peak_after, load_after = peak(), os.getloadavg()[0]

  print(f"\n{cpu_description()}; load {load_before:.2f} -> {load_after:.2f}; fp32 matmul "
        f"peak {peak_before:.0f} -> {peak_after:.0f} GFLOP/s")
  job = "toy model" if args.quick else "grpo_smollm2.py"
  print(f"{job}, split placement (1 training + 1 rollout device), {args.steps} steps x "
        f"{args.repeats} runs per arm")
  for arm in ARMS:
    rate = result["accuracy_per_s"][arm]
    print(f"  {arm:13s} {statistics.median(result['medians'][arm]):8.3f} s/step" +
          (f"   held-out accuracy per training second {statistics.median(rate):.4f}"
           if rate else ""))
  met = "met" if result["ratio"] <= TARGET else "not met"
  print(f"  one_step_off / sync: {result['ratio']:.3f}  (target <= {TARGET}: {met})")
  if args.out:
    write_record(args, result, runs, (peak_before, peak_after), (load_before, load_after))
  return result


def write_record(args, result: dict, runs: dict, peaks, loads) -> None:
  """One file of bench/results/ (bench/results_table.py's schema)."""
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=HERE).stdout.strip()
  from common import cpu_description  # noqa: PLC0415
  figure = dict(target="async_step", unit="s per step (median over runs of each run's "
                "median after its first step)",
                hflax=result["medians"]["one_step_off"], peer=result["medians"]["sync"],
                peer_name="trainer.mode = sync on the same split placement",
                ratio=round(result["ratio"], 4), ratio_is="one_step_off / sync (median step)",
                note=f"{args.repeats} runs x {args.steps} steps per arm")
  record = dict(
      script="bench/async_step.py", command=" ".join(["python", *sys.argv]), commit=commit,
      date=time.strftime("%Y-%m-%d"), machine=args.machine, cpu=cpu_description(),
      load=f"{loads[0]:.2f} at the start, {loads[1]:.2f} at the end", figures=[figure],
      notes=f"fp32 matmul peak {peaks[0]:.0f} GFLOP/s before, {peaks[1]:.0f} after; "
            "held-out accuracy per training second: " + json.dumps(result["accuracy_per_s"]) +
            "; step times and weight-sync times per run: " + json.dumps(
                {arm: [{"step_s": r["step_s"], "weight_sync_s": r["weight_sync_s"]}
                       for r in runs[arm]] for arm in runs}))
  pathlib.Path(args.out).write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
  main()
