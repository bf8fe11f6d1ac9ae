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
