"""Per-step overhead of the Ray backend vs the local backend, side by side.

The same tiny PPO job (actor, critic, reference; every role colocated on 2 devices) runs
as three trainers in this process: the local backend on 2 simulated devices here, and the
Ray backend with the pool as 1 process x 2 devices and as 2 processes x 1 device. After
warm-up (compilation), their steps alternate, so load changes on the machine hit all of
them alike; the table gives the median step time and the difference to local.

Ray runs on loopback only: run this inside the loopback-only namespace,

  ../shared/bin/netless python bench/ray_overhead.py [--steps 10] [--warmup 2]
"""
import argparse
import os
import statistics
import sys
import tempfile
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           " --xla_force_host_platform_device_count=2").strip()
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

from hflax.algorithms.drivers import get_algorithm  # noqa: E402
from hflax.algorithms.drivers.common import step_metrics, timed_roles  # noqa: E402
from hflax.launch.roles import step_config  # noqa: E402
from hflax.launch.config import base_config  # noqa: E402


def tiny(run_dir, backend: str, processes: int = 0):
  c = base_config()
  c.algorithm.name, c.algorithm.adv_estimator = "ppo", "gae"
  c.algorithm.use_kl_in_reward = True  # brings the reference model in
  c.rollout.n = 2
  c.data.train_batch_size, c.data.max_response_length = 4, 8
  c.actor.ppo_mini_batch_size = c.critic.ppo_mini_batch_size = 2
  c.data.builtin.update(num_train=256, num_val=8)
  c.model.builtin.update(hidden_size=64, intermediate_size=192, num_layers=2)
  c.trainer.update(total_steps=1000, val_every=0, val_before_train=False, devices=2,
                   log=(), export_hf=False, run_dir=run_dir, save_every=1000)
  c.cluster.update(backend=backend, processes_per_pool=processes, require_loopback=True,
                   log_to_driver=False)
  return c


class Runner:
  def __init__(self, name, trainer):
    self.name, self.trainer, self.times, self.stages, self.noop = name, trainer, [], [], []
    self.prompts = trainer.prompt_batches()
    self.driver = get_algorithm(trainer.cfg.algorithm.name).step

  def step(self, record: bool):
    """One training step (stages timed as the trainer times them), then one no-op call
    (actor.old_log_probs hands back the rollout's log-probs): transport alone."""
    t, stages = self.trainer, {}
    start = time.perf_counter()
    batch = self.driver(timed_roles(t.roles, stages), next(self.prompts), step_config(t.cfg),
                        t.state)
    # Everything the step computed, updates' metrics included (local dispatch is async).
    jax.block_until_ready((step_metrics(batch, t.cfg.data.max_response_length), batch.meta))
    elapsed = time.perf_counter() - start
    t.state.step += 1
    start = time.perf_counter()
    jax.block_until_ready(t.roles.actor.old_log_probs(batch).arrays)
    if record:
      self.times.append(elapsed)
      self.stages.append(stages)
      self.noop.append(time.perf_counter() - start)


def main():
  parser = argparse.ArgumentParser()
  parser.add_argument("--steps", type=int, default=10)
  parser.add_argument("--warmup", type=int, default=2)
  args = parser.parse_args()
  from hflax.controller.ray_backend import loopback_only_reason
  reason = loopback_only_reason()
  if reason:
    sys.exit(f"run this under shared/bin/netless: {reason}")
  from hflax.launch.trainer import Trainer
  quiet = lambda *_: None  # noqa: E731
  tmp = tempfile.mkdtemp(prefix="hflax-bench-")
  runners = [Runner("local (2 devices, 1 process)", Trainer(tiny(f"{tmp}/l", "local"), quiet))]
  ray_trainers = []
  try:
    for procs in (1, 2):
      trainer = Trainer(tiny(f"{tmp}/r{procs}", "ray", procs), quiet)
      ray_trainers.append(trainer)
      runners.append(Runner(f"ray ({procs} process{'es' if procs > 1 else ''} x "
                            f"{2 // procs} device{'s' if procs == 1 else ''})", trainer))
    for _ in range(args.warmup):
      for r in runners:
        r.step(record=False)
    for _ in range(args.steps):
      for r in runners:
        r.step(record=True)
  finally:
    for t in ray_trainers:
      t.close()
  base = statistics.median(runners[0].times)
  print(f"tiny PPO step (actor + critic + reference, 4 prompts x 2 samples, 8 new tokens), "
        f"median of {args.steps} alternating steps after {args.warmup} warm-up steps")
  print(f"{'backend':32s} {'ms/step':>8s} {'min':>7s} {'max':>7s} {'overhead':>9s} "
        f"{'no-op call':>10s}")
  for r in runners:
    med = statistics.median(r.times)
    print(f"{r.name:32s} {med * 1e3:8.1f} {min(r.times) * 1e3:7.1f} {max(r.times) * 1e3:7.1f} "
          f"{(med - base) * 1e3:+7.1f}ms {statistics.median(r.noop) * 1e3:8.1f}ms")
  keys = [k for k in runners[0].stages[0] if k.startswith("timing_s/") and k != "timing_s/reshard"]
  print("\nmedian ms per stage (each waits for its results, as trainer.stage_timing does)")
  print(f"{'backend':32s} " + " ".join(f"{k[9:]:>13s}" for k in keys))
  for r in runners:
    print(f"{r.name:32s} " + " ".join(
        f"{statistics.median(s.get(k, 0.0) for s in r.stages) * 1e3:13.1f}" for k in keys))

if __name__ == "__main__":
  main()
