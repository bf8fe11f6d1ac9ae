#!/usr/bin/env python
"""Held-out accuracy against wall-clock on the SmolLM2 recipe (hflax/configs/grpo_smollm2.py):
hflax with trainer.mode sync, one_step_off and async, then TRL's GRPOTrainer on the same
model, data, reward, batch, samples per prompt and learning rate, one after another in one
process.

  python bench/learning.py --machine zen4     # 12 steps each, the table, JSON and plot
  python bench/learning.py --toy --steps 1 --json /tmp/l.json   # smoke run, hflax only

Each run's curve is (seconds, held-out greedy accuracy) at step 0 and every --val-every
steps. The seconds are the run's wall-clock from its start (building the model and
compiling included) less the time its validations took, so both frameworks are charged for
training only; validation is the recipe's (greedy, data.val_batch_size prompts) on both
sides (TRL's by transformers' generate on the same prompts, scored by the same reward).

  * hflax: hflax.launch.trainer.Trainer on the recipe's config, checkpoints, export and
    console logging off; async and one_step_off take trainer.max_staleness (--max-staleness).
  * TRL: GRPOTrainer on the recipe's model written as an HF directory (bench/common.py),
    the recipe's training rows (TRL's sampler shuffles them in its own order), the
    recipe's reward (the answer's last integer against the ground truth), lr 1e-5,
    temperature 1.0, no KL term (the recipe's actor has none), one optimizer step per
    batch in the recipe's micro-batches.

The table prints, per run, its final accuracy, its total seconds and the seconds at which
it first reaches each of --accuracies; then the goal: the best hflax mode reaching TRL's
final accuracy in at most a third of TRL's seconds to it. The float32 and bfloat16 matmul
peaks are measured before and after the runs (the machine's speed in the same minutes).
The JSON (bench/results/<date>-learning-<machine>.json with --machine, or --json) holds
the curves, and the PNG beside it plots them when matplotlib is installed.

Exit status is 0 whether or not the goal is met.
"""
from __future__ import annotations

import os

for _var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE",
             "HF_HUB_DISABLE_TELEMETRY"):
  os.environ.setdefault(_var, "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as rl_step.py: TRL's best on shared cores
os.environ["JAX_PLATFORMS"] = "cpu"  # TRL runs on torch's CPU backend

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/common.py

import common  # noqa: E402

MODES = ("sync", "one_step_off", "async")
TARGET = 3.0  # TRL's seconds to its final accuracy over the best hflax mode's


# ----------------------------------------------------------------------------- hflax side

def hflax_config(args, mode: str, run_dir: str, model_dir: str | None):
  if args.toy:  # the random byte-vocabulary model of the CLI tests: seconds a step
    c = common.toy_config(args.val_prompts)
  else:
    from hflax.configs.grpo_smollm2 import get_config
    c = get_config()
    c.model.update(path=model_dir, tokenizer=model_dir)
    c.data.builtin.num_val = args.val_prompts
  c.data.val_batch_size = args.val_prompts
  c.trainer.update(total_steps=args.steps, val_every=args.val_every, val_before_train=True,
                   save_every=args.steps, keep=1, run_dir=run_dir, log=("jsonl",),
                   export_hf=False, mode=mode)
  if mode != "sync":
    c.trainer.max_staleness = args.max_staleness
    # Rollout correction of the stale rows (docs/async.md), off unless --correction.
    c.algorithm.rollout_correction.rollout_is = getattr(args, "correction", None)
  return c


def val_accuracy(metrics: dict) -> float | None:
  """The held-out accuracy among validation metrics: val-core's acc mean@1 where the
  reward reports one, else its reward mean@1 (the recipe's reward is 0 or 1)."""
  for kind in ("acc", "reward"):
    keys = sorted(k for k in metrics if k.startswith("val-core/") and
                  k.endswith(f"/{kind}/mean@1"))
    if keys:
      return float(metrics[keys[0]])
  return None


def run_hflax(args, mode: str, model_dir: str | None) -> dict:
  from hflax.launch.trainer import Trainer
  with tempfile.TemporaryDirectory() as tmp:
    start = time.perf_counter()
    trainer = Trainer(hflax_config(args, mode, os.path.join(tmp, "run"), model_dir),
                      log=lambda *_: None)
    spent = {"validation": 0.0}
    validate = trainer.validate

    def timed_validate(step=None):
      began = time.perf_counter()
      out = validate(step)
      spent["validation"] += time.perf_counter() - began
      return out
    trainer.validate = timed_validate
    curve = []

    def record(info):
      acc = val_accuracy(info.metrics)
      if acc is not None:
        curve.append({"step": info.step, "accuracy": acc,
                      "seconds": time.perf_counter() - start - spent["validation"]})
    trainer.add_hook(record)
    try:
      result = trainer.fit()
    finally:
      trainer.close()
  before = val_accuracy(result["before"] or {})
  curve.insert(0, {"step": 0, "accuracy": before, "seconds": 0.0})
  correction = getattr(args, "correction", None) if mode != "sync" else None
  corrected = f" (TIS {correction})" if correction else ""
  return {"name": f"hflax {mode}{corrected}", "curve": curve}


# ----------------------------------------------------------------------------- TRL side

def run_trl(args, model_dir: str) -> dict:
  import torch
  from datasets import Dataset
  from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
  from trl import GRPOConfig, GRPOTrainer

  from hflax.launch.inputs import load_datasets
  from hflax.rewards.rules import arithmetic_last_integer

  cfg = hflax_config(args, "sync", "/nonexistent", model_dir)
  train, val = load_datasets(cfg)
  d, a = cfg.data, cfg.actor
  rows = [train[i] for i in range(len(train))]
  held_out = [val[i] for i in range(len(val))]
  start = time.perf_counter()
  model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
  tokenizer = AutoTokenizer.from_pretrained(model_dir)
  tokenizer.padding_side = "left"

  def reward(prompts, completions, ground_truth, **kwargs):
    return [arithmetic_last_integer(c[-1]["content"] if isinstance(c, list) else c, g)
            for c, g in zip(completions, ground_truth)]

  def accuracy() -> float:
    scores = []
    for i in range(0, len(held_out), 50):
      chunk = held_out[i:i + 50]
      texts = [tokenizer.apply_chat_template(r["prompt"], tokenize=False,
                                             add_generation_prompt=True) for r in chunk]
      enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
      with torch.no_grad():
        out = model.generate(**enc, do_sample=False, max_new_tokens=d.max_response_length,
                             pad_token_id=tokenizer.pad_token_id)
      answers = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:],
                                       skip_special_tokens=True)
      scores += [arithmetic_last_integer(t, r["reward_model"]["ground_truth"])
                 for t, r in zip(answers, chunk)]
    return sum(scores) / len(scores)

  spent = {"validation": 0.0}
  curve = []

  def evaluate(step: int):
    began = time.perf_counter()
    model.eval()
    acc = accuracy()
    model.train()
    spent["validation"] += time.perf_counter() - began
    curve.append({"step": step, "accuracy": acc,
                  "seconds": time.perf_counter() - start - spent["validation"]})

  class Validation(TrainerCallback):
    def on_step_end(self, _args, state, control, **kw):
      if state.global_step % args.val_every == 0 or state.global_step == args.steps:
        evaluate(state.global_step)

  rows_per_step = d.train_batch_size * cfg.rollout.n
  micro = min(a.ppo_micro_batch_size or rows_per_step, rows_per_step)
  accumulate = rows_per_step // micro
  config = GRPOConfig(
      output_dir=tempfile.mkdtemp(), use_cpu=True, bf16=False, fp16=False,
      gradient_checkpointing=False, per_device_train_batch_size=micro,
      gradient_accumulation_steps=accumulate, steps_per_generation=accumulate,
      num_iterations=1, num_generations=cfg.rollout.n,
      max_completion_length=d.max_response_length, temperature=cfg.rollout.temperature,
      top_p=1.0, top_k=0, learning_rate=a.optim.lr, lr_scheduler_type="constant",
      warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2,
      loss_type="dapo", scale_rewards="group", max_steps=args.steps, logging_steps=10**6,
      save_strategy="no", eval_strategy="no", report_to="none", disable_tqdm=True, seed=0,
      dataloader_num_workers=0, log_completions=False)
  dataset = Dataset.from_list([{"prompt": r["prompt"],
                                "ground_truth": r["reward_model"]["ground_truth"]} for r in rows])
  trainer = GRPOTrainer(model=model, reward_funcs=[reward], args=config, train_dataset=dataset,
                        processing_class=tokenizer, callbacks=[Validation()])
  evaluate(0)
  trainer.train()
  return {"name": "TRL GRPOTrainer", "curve": curve}


# ----------------------------------------------------------------------------- report

def first_reaching(curve: list[dict], accuracy: float) -> float | None:
  """The seconds at which the curve first reaches `accuracy` (None: never)."""
  return next((p["seconds"] for p in curve if p["accuracy"] is not None
               and p["accuracy"] >= accuracy - 1e-9), None)


def per_step_figure(runs: list[dict]) -> dict | None:
  """Without TRL: a stale mode's curve per step against sync's, as the mean held-out
  accuracy over the validations after step 0 (the same steps on both curves), the first
  stale hflax run against sync; None without both."""
  sync = next((r for r in runs if r["name"] == "hflax sync"), None)
  stale = next((r for r in runs if r["name"].startswith("hflax ") and r is not sync), None)
  if sync is None or stale is None:
    return None
  steps = ({q["step"] for q in sync["curve"]} & {q["step"] for q in stale["curve"]}) - {0}
  if not steps:
    return None
  mean = lambda r: sum(q["accuracy"] for q in r["curve"] if q["step"] in steps) / len(steps)  # noqa: E731
  hflax, peer = mean(stale), mean(sync)
  return {"target": "learning_stale_per_step", "unit": "mean held-out accuracy at steps "
          + ", ".join(map(str, sorted(steps))), "hflax": round(hflax, 4), "hflax_name":
          stale["name"], "peer": round(peer, 4), "peer_name": "hflax sync",
          "ratio": round(hflax / peer, 4) if peer else None, "ratio_is": "hflax/peer"}


def report(runs: list[dict], accuracies: list[float]) -> tuple[str, dict | None]:
  """The table, and the goal's figure (without a TRL run: per_step_figure's)."""
  head = "run | final acc | seconds | " + " | ".join(f"s to {x:.2f}" for x in accuracies)
  lines = [head, "-" * len(head)]
  for r in runs:
    last = r["curve"][-1]
    cells = [f"{'-' if t is None else f'{t:.1f}'}" for t in
             (first_reaching(r["curve"], x) for x in accuracies)]
    lines.append(f"{r['name']} | {last['accuracy']:.3f} | {last['seconds']:.1f} | "
                 + " | ".join(cells))
  trl = next((r for r in runs if r["name"].startswith("TRL")), None)
  if trl is None:
    return "\n".join(lines), per_step_figure(runs)
  goal = trl["curve"][-1]["accuracy"]
  trl_s = first_reaching(trl["curve"], goal)
  reached = [(first_reaching(r["curve"], goal), r["name"]) for r in runs if r is not trl]
  reached = sorted((s, n) for s, n in reached if s is not None)
  figure = {"target": "learning_trl_time", "unit": "s", "peer": trl_s,
            "peer_name": f"TRL GRPOTrainer to its final accuracy {goal:.3f}",
            "ratio_is": "peer/hflax"}
  if reached:
    best_s, best = reached[0]
    figure.update(hflax=best_s, hflax_name=best, ratio=trl_s / best_s if best_s else 0.0)
    verdict = "PASS" if figure["ratio"] >= TARGET else "MISS"
    lines.append(f"goal: {best} reaches TRL's final accuracy {goal:.3f} at {best_s:.1f} s, "
                 f"TRL at {trl_s:.1f} s: {figure['ratio']:.2f}x (>= {TARGET:.0f}x: {verdict})")
  else:
    figure.update(hflax=None, ratio=0.0, ratio_checked=False)
    lines.append(f"goal: no hflax mode reached TRL's final accuracy {goal:.3f} (MISS)")
  return "\n".join(lines), figure


def plot(runs: list[dict], path: str) -> str:
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    return "no plot: matplotlib is not installed"
  fig, ax = plt.subplots(figsize=(7, 4.5))
  for r in runs:
    points = [p for p in r["curve"] if p["accuracy"] is not None]
    ax.plot([p["seconds"] for p in points], [p["accuracy"] for p in points], marker="o",
            label=r["name"])
  ax.set_xlabel("wall-clock seconds (validation excluded)")
  ax.set_ylabel("held-out greedy accuracy")
  ax.legend()
  ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return f"plot: {path}"


def cpu_name() -> str:
  try:
    with open("/proc/cpuinfo") as f:
      return next((line.split(":", 1)[1].strip() for line in f
                   if line.startswith("model name")), "unknown")
  except OSError:
    return "unknown"


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  p.add_argument("--steps", type=int, default=12)
  p.add_argument("--val-every", type=int, default=2)
  p.add_argument("--val-prompts", type=int, default=200)
  p.add_argument("--max-staleness", type=int, default=1)
  p.add_argument("--correction", choices=("token", "sequence"), default=None,
                 help="one_step_off and async: truncated importance sampling of stale rows "
                 "(algorithm.rollout_correction.rollout_is); default off")
  p.add_argument("--modes", default=",".join(MODES) + ",trl",
                 help="comma-separated: sync, one_step_off, async, trl")
  p.add_argument("--accuracies", default="0.3,0.4,0.5,0.6")
  p.add_argument("--toy", action="store_true", help="the random tiny model; no TRL run")
  p.add_argument("--machine", default="", help="a bench/results_table.py MACHINES key: "
                 "writes bench/results/<date>-learning-<machine>.json")
  p.add_argument("--json", default="", help="where the JSON goes (overrides --machine's)")
  args = p.parse_args(argv)
  modes = [m.strip() for m in args.modes.split(",") if m.strip()]
  bad = [m for m in modes if m not in (*MODES, "trl")]
  if bad:
    p.error(f"--modes: {bad} not among {MODES + ('trl',)}")
  if args.toy and "trl" in modes:
    modes.remove("trl")  # TRL needs an HF model directory; the toy model has none
  model_dir = None if args.toy else common.real_model_dir()
  peaks_before = common.matmul_peaks()
  print(f"matmul peak before: {peaks_before}; load {common.load_average()}", flush=True)
  runs = []
  for mode in modes:
    run = run_trl(args, model_dir) if mode == "trl" else run_hflax(args, mode, model_dir)
    print(f"{run['name']}: " + ", ".join(f"step {q['step']} {q['accuracy']:.3f} at "
                                         f"{q['seconds']:.1f} s" for q in run["curve"]),
          flush=True)
    runs.append(run)
  peaks_after = common.matmul_peaks()
  print(f"matmul peak after: {peaks_after}; load {common.load_average()}")
  table, figure = report(runs, [float(x) for x in args.accuracies.split(",")])
  print(table)
  date = datetime.date.today().isoformat()
  kind = f"learning-tis-{args.correction}" if args.correction else "learning"
  path = args.json or (os.path.join(ROOT, "bench", "results", f"{date}-{kind}-{args.machine}"
                                    ".json") if args.machine else "")
  if path:
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                            text=True).stdout.strip() or "0000000"
    out = {"script": "bench/learning.py", "command": " ".join(["python", *sys.argv]),
           "commit": commit, "date": date, "machine": args.machine or "vm", "cpu": cpu_name(),
           "load": common.load_average(), "figures": [figure] if figure else [],
           "runs": runs, "matmul_peaks": {"before": peaks_before, "after": peaks_after},
           "notes": "held-out greedy accuracy against wall-clock less validation time"}
    with open(path, "w") as f:
      json.dump(out, f, indent=1)
    print(f"json: {path}; " + plot(runs, os.path.splitext(path)[0] + ".png"))


if __name__ == "__main__":
  main()
