#!/usr/bin/env python
"""Auto-mapper check on 8 CPU devices: predicted vs measured step time.

For a small PPO config (actor, critic, reference; a rule reward on the host), the
auto-mapper ranks every plan with a profile calibrated on these devices. The top 5 and 5
random other feasible plans are then run for a few steps each, alternating, and their
measured step times printed beside the predictions, with the rank correlation and how far
the auto-mapper's choice is from the best measured plan.

The best of ten noisy measurements is biased low (its own noise helped it win), so when
another plan measured best, the two are run again, alternating, for --confirm more steps,
and the choice is judged on that head-to-head.

The profile is the one calibrate() cached under ~/.cache/hflax/ for this host, these
devices and this JAX version (measured on the first run); the script prints its path and
age, and --recalibrate measures it afresh (and replaces the cache).

  python bench/automap.py [--steps 9] [--random 5] [--seed 0] [--confirm 15] [--recalibrate]
"""
import argparse
import os
import statistics
import sys
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=8").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from hflax.algorithms.drivers import get_algorithm, init_state  # noqa: E402
from hflax.controller.batch import Batch  # noqa: E402
from hflax.launch.config import base_config  # noqa: E402
from hflax.launch.plan import ranked_plans  # noqa: E402
from hflax.launch.roles import build_roles, policy_model, step_config  # noqa: E402
from hflax.models.tokenizer import ByteTokenizer  # noqa: E402
from hflax.rollout import left_pad  # noqa: E402
from hflax.sharding.automap import calibrate  # noqa: E402
from hflax.sharding.automap.calibration import default_cache_path  # noqa: E402

PPO = get_algorithm("ppo").step


def config():
  c = base_config()
  c.algorithm.name, c.algorithm.adv_estimator = "ppo", "gae"
  c.algorithm.use_kl_in_reward = True
  c.rollout.n = 2
  c.data.train_batch_size, c.data.max_response_length = 16, 16
  c.actor.ppo_mini_batch_size = c.critic.ppo_mini_batch_size = 8
  c.model.builtin.update(hidden_size=128, intermediate_size=384, num_layers=4, num_heads=8,
                         num_kv_heads=4)
  c.trainer.stage_timing = False
  return c


def parity_reward(batch):
  tokens, mask = batch["responses"], batch["response_mask"]
  return ((tokens % 2 == 0) * mask).sum(1) / np.maximum(mask.sum(1), 1)


def spearman(a, b):
  ra, rb = np.argsort(np.argsort(a)), np.argsort(np.argsort(b))
  return float(np.corrcoef(ra, rb)[0, 1])


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--steps", type=int, default=9)
  parser.add_argument("--random", type=int, default=5)
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--confirm", type=int, default=15,
                      help="head-to-head steps of the choice and the best measured plan")
  parser.add_argument("--recalibrate", action="store_true",
                      help="measure the device profile afresh instead of reading its cache")
  args = parser.parse_args()
  tokenizer, devices = ByteTokenizer(), jax.devices()[:8]
  cfg = config()
  policy = policy_model(cfg, tokenizer.vocab_size, tokenizer)
  # ranked_plans has no refresh argument: calibrating here first leaves in the cache the
  # profile it then reads (calibrate also measures when the cached one lacks fields).
  path = default_cache_path(devices)
  before = os.path.getmtime(path) if os.path.exists(path) else None
  calibrate(devices, refresh=args.recalibrate)
  written = os.path.getmtime(path)
  age = ("measured now" if written != before
         else f"cached {(time.time() - written) / 3600:.1f} h ago")
  print(f"device profile: {path} ({age}; --recalibrate measures it again)")
  start = time.perf_counter()
  plans = ranked_plans(cfg, policy[0], devices, top=1000)
  search_s = time.perf_counter() - start
  rng = np.random.default_rng(args.seed)
  others = list(rng.choice(np.arange(5, len(plans)), size=min(args.random, len(plans) - 5),
                           replace=False)) if len(plans) > 5 else []
  chosen = list(range(min(5, len(plans)))) + [int(i) for i in others]
  rs = np.random.RandomState(0)
  prompts = [rs.randint(10, 256, size=rs.randint(8, 24)).tolist() for _ in range(16)]
  tokens, mask = left_pad(prompts, tokenizer.pad_id)
  batch = Batch({"prompts": tokens, "prompt_mask": mask})

  runs = {}
  for i in chosen:
    cfg_i = config()
    cfg_i.placement.kind = "custom"
    cfg_i.placement.update(plans[i].to_config())
    cfg_i.rollout.generate_tensor = plans[i].generate_tensor
    roles = build_roles(cfg_i, policy, tokenizer=tokenizer, reward_fn=parity_reward,
                        devices=devices)
    state = init_state(cfg_i.algorithm)
    for _ in range(2):  # compile, then one more: a plan's first steps run slower
      jax.block_until_ready(PPO(roles, batch, step_config(cfg_i), state).arrays)
    runs[i] = (roles, cfg_i, state, [])
  time_steps(runs, list(runs), args.steps, batch)
  predicted = np.array([plans[i].step_time for i in chosen])
  measured = np.array([statistics.median(runs[i][3]) for i in chosen])
  print(f"devices: {len(devices)} x {devices[0].platform}; {len(plans)} feasible plans ranked in "
        f"{search_s:.1f} s; model {policy[0].num_params / 1e6:.1f}M params; median of "
        f"{args.steps} steps per plan")
  print(f"{'rank':>4} | {'predicted s':>11} | {'measured s':>10} | plan")
  for i, p, m in zip(chosen, predicted, measured):
    print(f"{i + 1:>4} | {p:>11.3f} | {m:>10.3f} | {plans[i].describe().split('  ', 1)[1][:110]}")
    if os.environ.get("HFLAX_BENCH_VERBOSE"):
      print("       steps: " + ", ".join(f"{t:.3f}" for t in runs[i][3]))
  best = int(np.argmin(measured))
  gap = measured[0] / measured[best] - 1
  print(f"auto-mapper's choice (rank 1) measured {measured[0]:.3f} s; best measured "
        f"{measured[best]:.3f} s (rank {chosen[best] + 1}): {gap:+.1%}")
  print(f"Spearman rank correlation, predicted vs measured: {spearman(predicted, measured):.2f}")
  if best == 0:
    print("the choice measured best (target: within 15%)")
    return
  pair = [chosen[0], chosen[best]]
  for i in pair:
    runs[i][3].clear()
  time_steps(runs, pair, args.confirm, batch)
  choice, other = (statistics.median(runs[i][3]) for i in pair)
  print(f"head-to-head over {args.confirm} more steps each, alternating: choice {choice:.3f} s, "
        f"rank {pair[1] + 1} {other:.3f} s: {choice / other - 1:+.1%} (target: within 15%)")


def time_steps(runs, order, steps, batch):
  """Appends `steps` step times to each plan in `order`, alternating plans (rotated each
  round) so that load changes hit all of them alike."""
  for step in range(steps):
    for i in order[step % len(order):] + order[:step % len(order)]:
      roles, cfg_i, state, times = runs[i]
      began = time.perf_counter()
      out = PPO(roles, batch, step_config(cfg_i), state)
      jax.block_until_ready((out.arrays, out.meta["metrics"]))
      times.append(time.perf_counter() - began)


if __name__ == "__main__":
  main()
