"""A tiny GRPO job for CLI tests: small model, few prompts, seconds per step."""
from hflax.launch.config import base_config


def get_config():
  c = base_config()
  c.algorithm.name, c.algorithm.adv_estimator = "grpo", "grpo"
  c.actor.use_kl_loss = True
  c.rollout.n = 2
  c.data.train_batch_size, c.data.val_batch_size = 4, 8
  c.actor.ppo_mini_batch_size = c.critic.ppo_mini_batch_size = 2
  c.data.builtin.update(num_train=64, num_val=8)
  c.model.builtin.update(hidden_size=32, intermediate_size=64, num_layers=1)
  c.trainer.update(total_steps=6, save_every=2, val_every=0, val_before_train=False, devices=2,
                   log=("jsonl",), run_dir="/tmp/hflax-tiny")
  c.trainer.sft_warmup.update(steps=0)
  return c


# -- the trainer.mode tests' runs (test_async_modes.py, test_async_stream.py) ----------------
# Metrics that measure time, not the run.
TIMED = ("timing_s/", "perf/throughput", "perf/time")


def mode_config(tmp_path, run, mode, **trainer):
  """The tiny job for 3 steps in `mode`, its run directory tmp_path / run, every
  checkpoint kept; `trainer` overrides more trainer fields."""
  c = get_config()
  c.trainer.update(total_steps=3, run_dir=str(tmp_path / run), mode=mode, keep=None)
  c.trainer.update(**trainer)
  return c


def run_metrics(tmp_path, run) -> dict:
  """step -> that step's logged metrics, those measuring time left out."""
  import json
  rows = [json.loads(line) for line in (tmp_path / run / "metrics.jsonl").open()]
  return {r["step"]: {k: v for k, v in r.items() if not k.startswith(TIMED)} for r in rows}


def fit(c, *hooks):
  """A trainer for `c`, silent, with `hooks` added, after its fit()."""
  from hflax.launch.trainer import Trainer
  trainer = Trainer(c, log=lambda *_: None)
  for hook in hooks:
    trainer.add_hook(hook)
  trainer.fit()
  return trainer
