"""GRPO on the built-in arithmetic task: groups of samples per prompt, KL as a loss.

The default run (no arguments) warms a tiny policy up with a supervised phase (cached)
that stops at a loss target, then RL raises held-out exact-match accuracy on 2-digit
addition, whatever the seed (README.md's quick start shows a run).
"""
from hflax.configs import packing_defaults
from hflax.launch.config import base_config


def get_config():
  c = base_config()
  c.algorithm.name, c.algorithm.adv_estimator = "grpo", "grpo"
  c.actor.use_kl_loss, c.actor.kl_loss_coef = True, 0.001
  c.actor.optim.lr = 2e-4
  c.rollout.n, c.rollout.temperature = 8, 0.7
  c.data.train_batch_size = 32
  c.actor.ppo_mini_batch_size = c.critic.ppo_mini_batch_size = 16
  c.data.val_batch_size = 100
  c.trainer.update(total_steps=100, val_every=25, save_every=50)
  c.trainer.sft_warmup.update(steps=2000, lr=2e-3, target_loss=0.5)
  c.placement.kind = "custom"
  c.placement.update({"pools": {"policy": 1, "reference": 1},
                      "roles": {"actor": {"pool": "policy"}, "ref": {"pool": "reference"}}})
  c.trainer.run_dir = "runs/grpo"
  packing_defaults(c)
  return c
