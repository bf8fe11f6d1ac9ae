#!/usr/bin/env python
"""On-policy distillation against GRPO alone, from the same weak start, on the built-in task.

Issue 74's must-show on a CPU: the student's held-out accuracy per step and per second of
training, distilled from a teacher, against GRPO's from identical weights, with the
teacher's accuracy as the ceiling. Everything runs through `python -m hflax.launch
--config grpo.py` (the tiny byte-vocabulary Llama on 2-digit addition):

  1. teacher: the shipped job as it is (the default supervised warm-up to its loss target,
     then GRPO), at --teacher-seed, exported as an HF directory (trainer.export_hf); its
     final held-out accuracy is the ceiling;
  2. start: a short supervised warm-up (--start-steps, no loss target) at --seed, cached in
     the bench's own trainer.sft_warmup.cache_dir; a val_only run writes the cache and reads
     the start's accuracy. Both arms then find the same cache key and load the same
     checkpoint, so they start from identical weights (checked: their step-0 accuracies
     must be equal);
  3. the arms, same seed, data order, batch and validation: "grpo" (the job's GRPO) and
     "distill" (distill.teacher_path = the teacher, distill.coef 1, task_reward_coef 0 by
     default: distillation alone, docs/distillation.md). They alternate in chunks of
     --chunk steps (each chunk resumes its run from the previous chunk's checkpoint), so
     a load that drifts over the run falls on both alike.

Accuracy is the job's held-out greedy exact match (val-core/arithmetic/reward/mean@1, 500
questions) every --val-every steps. Training seconds are the sum of `timing_s/step` up
to a step: validation, start-up and checkpoint writes are outside it; the first step of
each resumed chunk, which reads the compiled programs back, counts as the arm's median
step (a run of each arm first fills the compilation cache and is not counted). Per-step
curves do not depend on the machine's load; seconds do (the load is printed and recorded).

  python bench/distill.py                      # teacher, start, 120 steps per arm
  python bench/distill.py --quick              # smoke: tiny steps everywhere
  python bench/distill.py --job smollm2 --teacher-steps 12 --steps 12 --chunk 6 --val-every 2

With --job smollm2 the same comparison runs on the real-model recipe (grpo_smollm2.py):
the teacher is the recipe's own GRPO run and export, and both arms start from the model as
shipped (no warm-up: --start-steps is unused).
  python bench/distill.py --out bench/results/DATE-distill-MACHINE.json --machine vm

Exit status 0 whether or not distillation reaches 0.5 first.
"""
from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # for bench/common.py
ARMS = ("grpo", "distill")
# --job: the launcher config, its held-out accuracy metric, and whether the common start is
# a cached supervised warm-up (the tiny job) or the model as shipped (SmolLM2).
JOBS = {
    "grpo": dict(config="grpo.py", acc="val-core/arithmetic/reward/mean@1", warmup=True),
    "smollm2": dict(config="grpo_smollm2.py", acc="val-core/arithmetic_chat/reward/mean@1",
                    warmup=False),
}
ACC = JOBS["grpo"]["acc"]
CONFIG = JOBS["grpo"]["config"]
# Each launch writes metrics.jsonl only (no console table, no TensorBoard, no plot needs).
QUIET = ["--config.trainer.log=('jsonl',)"]


def launch(run_dir: pathlib.Path, settings: list[str], log: pathlib.Path) -> float:
  """One `python -m hflax.launch --config CONFIG` run; returns its wall seconds."""
  cmd = [sys.executable, "-m", "hflax.launch", "--config", CONFIG, *QUIET,
         f"--config.trainer.run_dir={run_dir}", *settings]
  start = time.perf_counter()
  with open(log, "a") as out:
    done = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, text=True)
  if done.returncode != 0:
    raise SystemExit(f"{run_dir.name} failed (exit {done.returncode}); its output:\n"
                     + log.read_text()[-4000:])
  return time.perf_counter() - start


def read_metrics(run_dir: pathlib.Path) -> dict[int, dict]:
  """step -> that step's metrics, merged over the rows a run (and its resumptions) wrote."""
  rows: dict[int, dict] = {}
  for line in (run_dir / "metrics.jsonl").read_text().splitlines():
    row = json.loads(line)
    rows.setdefault(row["step"], {}).update(row)
  return rows


def curve(rows: dict[int, dict], chunk: int | None = None) -> list[dict]:
  """[{step, train_s, acc}] for each validated step; train_s sums timing_s/step up to the
  step. With `chunk`, the first step of each resumed chunk (reading the run's compiled
  programs back: the bench's alternation, not the arm's cost) counts as the arm's median
  step; the run's own first step counts as measured, as any run pays for it."""
  out, spent = [], 0.0
  median = median_step_s(rows, chunk) if chunk else None
  for step in sorted(rows):
    resumed = chunk and step > 1 and (step - 1) % chunk == 0 and "timing_s/step" in rows[step]
    spent += median if resumed else rows[step].get("timing_s/step", 0.0)
    if ACC in rows[step]:
      out.append(dict(step=step, train_s=round(spent, 3), acc=rows[step][ACC]))
  return out


def median_step_s(rows: dict[int, dict], chunk: int) -> float:
  """The median of timing_s/step over the steps that do not start a chunk (those also
  read the run's compiled programs back): what a step of the arm costs."""
  import statistics  # noqa: PLC0415
  timed = {step: r["timing_s/step"] for step, r in rows.items() if "timing_s/step" in r}
  later = [t for step, t in timed.items() if (step - 1) % chunk]
  return statistics.median(later or timed.values())  # chunks of 1 step: every step


def late_mean(points: list[dict], count: int = 10) -> float:
  """Mean held-out accuracy over the last `count` validations: one validation swings by
  several points from the next, the mean of the run's tail does not."""
  tail = points[-count:]
  return round(sum(p["acc"] for p in tail) / len(tail), 4)


def first_reaching(points: list[dict], level: float) -> dict | None:
  return next((p for p in points if p["acc"] >= level), None)


def arm_settings(args, arm: str, sft_cache: pathlib.Path, teacher: str) -> list[str]:
  s = [f"--config.trainer.seed={args.seed}",
       f"--config.trainer.val_every={args.val_every}", "--config.trainer.export_hf=False",
       "--config.trainer.keep=1"]
  if JOBS[args.job]["warmup"]:
    s += [f"--config.trainer.sft_warmup.steps={args.start_steps}",
          "--config.trainer.sft_warmup.target_loss=0.0",
          f"--config.trainer.sft_warmup.cache_dir={sft_cache}"]
  if arm == "distill":
    s += [f"--config.distill.teacher_path={teacher}", f"--config.distill.coef={args.coef}",
          f"--config.distill.task_reward_coef={args.task_reward_coef}"]
  return s


def make_teacher(args, work: pathlib.Path) -> tuple[str, float]:
  """The teacher's HF directory and its final held-out accuracy."""
  run_dir = work / "teacher"
  settings = [f"--config.trainer.seed={args.teacher_seed}",
              f"--config.trainer.total_steps={args.teacher_steps}",
              f"--config.trainer.val_every={args.teacher_steps}",
              f"--config.trainer.save_every={args.teacher_steps}"]
  if JOBS[args.job]["warmup"]:
    settings.append(f"--config.trainer.sft_warmup.cache_dir={work / 'sft'}")
  if args.quick and JOBS[args.job]["warmup"]:
    settings += ["--config.trainer.sft_warmup.steps=20", "--config.trainer.sft_warmup.target_loss=0.0"]
  wall = launch(run_dir, settings, work / "teacher.log")
  rows = read_metrics(run_dir)
  acc = rows[max(s for s in rows if ACC in rows[s])][ACC]
  print(f"teacher: {args.teacher_steps} GRPO steps of {CONFIG} as shipped (seed "
        f"{args.teacher_seed}), held-out accuracy {rows[0][ACC]:.3f} -> {acc:.3f} ({wall:.0f} s)",
        flush=True)
  return str(run_dir / "hf_actor"), acc


def run_arms(args, work: pathlib.Path, teacher: str) -> dict[str, list[dict]]:
  sft_cache = work / "sft"
  start_dir = work / "start"
  launch(start_dir, arm_settings(args, "grpo", sft_cache, teacher)
         + ["--config.trainer.val_only=True"], work / "start.log")
  start_acc = read_metrics(start_dir)[0][ACC]
  what = (f"{args.start_steps} supervised warm-up steps" if JOBS[args.job]["warmup"]
          else "the model as shipped")
  print(f"start: {what} (seed {args.seed}), held-out accuracy {start_acc:.3f}", flush=True)
  for arm in ARMS:  # fill the compilation cache with each arm's programs; not counted
    launch(work / f"warm-{arm}", arm_settings(args, arm, sft_cache, teacher)
           + ["--config.trainer.total_steps=2", "--config.trainer.val_before_train=False"],
           work / f"warm-{arm}.log")
  done = 0
  while done < args.steps:
    upto = min(done + args.chunk, args.steps)
    order = ARMS if (done // args.chunk) % 2 == 0 else ARMS[::-1]
    for arm in order:
      launch(work / arm, arm_settings(args, arm, sft_cache, teacher)
             + [f"--config.trainer.total_steps={upto}", f"--config.trainer.save_every={upto}"],
             work / f"{arm}.log")
    done = upto
    accs = {arm: read_metrics(work / arm).get(upto, {}).get(ACC) for arm in ARMS}
    print(f"  step {upto}: " + ", ".join(f"{a} {v:.3f}" if v is not None else f"{a} -"
                                          for a, v in accs.items()), flush=True)
  curves = {arm: curve(read_metrics(work / arm), args.chunk) for arm in ARMS}
  args.step_s = {arm: round(median_step_s(read_metrics(work / arm), args.chunk), 4)
                 for arm in ARMS}
  for arm in ARMS:
    if not curves[arm] or curves[arm][0]["step"] != 0 or curves[arm][0]["acc"] != start_acc:
      raise SystemExit(f"{arm}: its step-0 accuracy {curves[arm][:1]} is not the start's "
                       f"{start_acc}: the arms did not start from the same weights")
  return curves


def reached_text(point: dict | None, steps: int) -> str:
  if point is None:
    return f"not within {steps} steps"
  return f"step {point['step']} ({point['train_s']:.1f} s of training)"


def report(curves: dict[str, list[dict]], teacher_acc: float, steps: int, level: float):
  by_step = {arm: {p["step"]: p for p in points} for arm, points in curves.items()}
  print(f"\nheld-out accuracy (teacher: {teacher_acc:.3f}, the ceiling)")
  print(f"{'step':>5} | {'train s grpo':>12} | {'acc grpo':>8} | {'train s distill':>15} | "
        f"{'acc distill':>11}")
  for step in sorted(set(by_step["grpo"]) | set(by_step["distill"])):
    g, d = by_step["grpo"].get(step), by_step["distill"].get(step)
    cell = lambda p, key, fmt: format(p[key], fmt) if p else "-"  # noqa: E731
    print(f"{step:>5} | {cell(g, 'train_s', '12.1f')} | {cell(g, 'acc', '8.3f')} | "
          f"{cell(d, 'train_s', '15.1f')} | {cell(d, 'acc', '11.3f')}")
  reach = {arm: first_reaching(curves[arm], level) for arm in ARMS}
  for arm in ARMS:
    print(f"{arm} reaches {level}: {reached_text(reach[arm], steps)}")
  return reach


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--job", choices=sorted(JOBS), default="grpo",
                      help="grpo: the tiny job; smollm2: the SmolLM2 recipe (grpo_smollm2.py)")
  parser.add_argument("--steps", type=int, default=120, help="RL steps per arm")
  parser.add_argument("--chunk", type=int, default=40, help="steps per alternation")
  parser.add_argument("--val-every", type=int, default=2, help="validation interval (steps)")
  parser.add_argument("--start-steps", type=int, default=300,
                      help="supervised warm-up steps of the common start")
  parser.add_argument("--seed", type=int, default=0, help="the arms' trainer.seed")
  parser.add_argument("--teacher-steps", type=int, default=100)
  parser.add_argument("--teacher-seed", type=int, default=2)
  parser.add_argument("--teacher", default="", help="an existing teacher HF directory (skips 1)")
  parser.add_argument("--teacher-acc", type=float, default=None,
                      help="with --teacher: its held-out accuracy")
  parser.add_argument("--coef", type=float, default=1.0, help="distill.coef")
  parser.add_argument("--task-reward-coef", type=float, default=0.0,
                      help="distill.task_reward_coef")
  parser.add_argument("--level", type=float, default=0.5, help="the accuracy to reach")
  parser.add_argument("--workdir", default="", help="keep the runs here (default: a temp dir)")
  parser.add_argument("--quick", action="store_true", help="smoke: tiny steps everywhere")
  parser.add_argument("--out", default="", help="write a bench/results/ file here")
  parser.add_argument("--machine", default="vm", help="the machine's key in --out's file")
  parser.add_argument("--refigure", default="",
                      help="recompute an earlier run's figures from its record's curves (with "
                      "--workdir: its step times from the runs kept there) and write --out")
  args = parser.parse_args()
  global ACC, CONFIG  # noqa: PLW0603 (one job per process)
  ACC, CONFIG = JOBS[args.job]["acc"], JOBS[args.job]["config"]
  if args.refigure:
    return refigure(args)
  if args.teacher and args.teacher_acc is None:
    parser.error("--teacher needs --teacher-acc (its held-out accuracy, the ceiling)")
  if min(args.steps, args.chunk, args.val_every) < 1 or args.chunk % args.val_every:
    parser.error("--steps, --chunk and --val-every must be >= 1, --chunk a multiple of "
                 "--val-every")
  if args.quick:
    args.steps, args.chunk, args.val_every = 2, 2, 1
    args.start_steps, args.teacher_steps = 10, 2

  load_before = os.getloadavg()
  started = time.perf_counter()
  with tempfile.TemporaryDirectory(prefix="hflax-distill-") as tmp:
    work = pathlib.Path(args.workdir or tmp)
    work.mkdir(parents=True, exist_ok=True)
    if args.teacher:
      teacher, teacher_acc = args.teacher, args.teacher_acc
    else:
      teacher, teacher_acc = make_teacher(args, work)
    curves = run_arms(args, work, teacher)
  load_after = os.getloadavg()
  reach = report(curves, teacher_acc, args.steps, args.level)
  load = (f"{load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} at the start, "
          f"{load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f} at the end (1/5/15 "
          f"min, {os.cpu_count()} cores)")
  print("median step (each chunk's first step left out): " + ", ".join(
      f"{arm} {args.step_s[arm]:.3f} s" for arm in ARMS))
  print(f"load average: {load}; the whole bench took {time.perf_counter() - started:.0f} s")
  if args.out:
    write_results(args, curves, teacher_acc, reach, load)


def refigure(args):
  """Figures again from a recorded run (its command, commit, date, machine and load kept)."""
  record = json.loads(pathlib.Path(args.refigure).read_text())
  notes = record["notes"]
  for key in ("job", "coef", "task_reward_coef", "start_steps", "teacher_steps", "teacher_seed",
              "seed", "val_every", "chunk", "level"):
    if key in notes:
      setattr(args, key, notes[key])
  global ACC, CONFIG  # noqa: PLW0603
  ACC, CONFIG = JOBS[args.job]["acc"], JOBS[args.job]["config"]
  curves = notes["curves"]
  if args.workdir:  # the seconds again from the runs' metrics; the accuracies must agree
    again = {arm: curve(read_metrics(pathlib.Path(args.workdir) / arm), args.chunk)
             for arm in ARMS}
    if any([p["acc"] for p in again[arm]] != [p["acc"] for p in curves[arm]] for arm in ARMS):
      raise SystemExit(f"--workdir {args.workdir} holds other runs than {args.refigure}")
    curves = again
  args.steps = curves["grpo"][-1]["step"]
  args.step_s = notes.get("median_step_s")
  if args.step_s is None and args.workdir:
    args.step_s = {arm: round(median_step_s(read_metrics(pathlib.Path(args.workdir) / arm),
                                            args.chunk), 4) for arm in ARMS}
  reach = report(curves, notes["teacher_acc"], args.steps, args.level)
  args.machine = record["machine"]
  args.out = args.out or args.refigure
  write_results(args, curves, notes["teacher_acc"], reach, record["load"])
  fresh = json.loads(pathlib.Path(args.out).read_text())
  fresh.update({k: record[k] for k in ("command", "commit", "date", "cpu")})
  fresh["refigured_by"] = " ".join(["python", *sys.argv])
  pathlib.Path(args.out).write_text(json.dumps(fresh, indent=1) + "\n")


def reach_figure(target: str, unit: str, key: str, reach: dict, curves: dict, steps: int):
  """GRPO's / distillation's steps (or seconds) to the level. An arm that does not reach it
  within the run counts as its whole run, which makes the ratio a bound (ratio_is says
  which); None where neither arm reaches it."""
  got = {arm: reach[arm][key] if reach[arm] else None for arm in ARMS}
  if got["grpo"] is None and got["distill"] is None:
    return None
  whole = {arm: got[arm] if got[arm] is not None else curves[arm][-1][key] for arm in ARMS}
  how = "GRPO / distillation"
  if got["grpo"] is None:
    how += f" (a lower bound: GRPO did not reach it within {steps} steps, its whole run counted)"
  elif got["distill"] is None:
    how += (f" (an upper bound: distillation did not reach it within {steps} steps, its "
            "whole run counted)")
  return dict(target=target, unit=unit, hflax=got["distill"], peer=got["grpo"],
              peer_name="GRPO alone from the same start", ratio_is=how,
              ratio=round(whole["grpo"] / whole["distill"], 4) if whole["distill"] else None,
              note="hflax: on-policy distillation; null: not reached within the run")


def write_results(args, curves, teacher_acc, reach, load):
  """One file of bench/results/ (bench/results_table.py's schema)."""
  from common import cpu_description  # noqa: PLC0415
  commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, cwd=HERE).stdout.strip()
  late = {arm: late_mean(curves[arm]) for arm in ARMS}
  job = getattr(args, "job", "grpo")
  prefix = "distill_" if job == "grpo" else f"distill_{job}_"  # a row of its own per job
  figures = [
      reach_figure(f"{prefix}steps_to_half", f"RL steps to held-out accuracy {args.level}",
                   "step", reach, curves, args.steps),
      reach_figure(f"{prefix}seconds_to_half", "training seconds (sum of timing_s/step) to "
                   f"held-out accuracy {args.level}", "train_s", reach, curves, args.steps),
      dict(target=f"{prefix}final_acc", unit="mean held-out accuracy over the run's last 10 "
           f"validations (steps {curves['grpo'][-10:][0]['step']}-{args.steps})",
           hflax=late["distill"], peer=late["grpo"], peer_name="GRPO alone from the same start",
           ratio=round(late["distill"] / late["grpo"], 4) if late["grpo"] else None,
           ratio_is="hflax/peer: distillation / GRPO",
           note=f"teacher (the ceiling) {teacher_acc:.3f}, start {curves['grpo'][0]['acc']:.3f}"),
  ]
  record = dict(
      script="bench/distill.py", command=" ".join(["python", *sys.argv]), commit=commit,
      date=time.strftime("%Y-%m-%d"), machine=args.machine, cpu=cpu_description(), load=load,
      figures=[f for f in figures if f is not None],
      notes=dict(job=job, teacher_acc=teacher_acc, coef=args.coef,
                 task_reward_coef=args.task_reward_coef,
                 start_steps=args.start_steps, teacher_steps=args.teacher_steps,
                 teacher_seed=args.teacher_seed, seed=args.seed, val_every=args.val_every,
                 chunk=args.chunk, level=args.level,
                 median_step_s=getattr(args, "step_s", None), curves=curves))
  pathlib.Path(args.out).write_text(json.dumps(record, indent=1) + "\n")




if __name__ == "__main__":
  main()
