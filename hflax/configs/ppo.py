"""PPO on the built-in arithmetic task: actor, critic, reference (KL in the reward).

Actor and reference share one device; the critic has its own (per-model meshes on the 2
simulated CPU devices of the default run). The default run (no arguments) warms a tiny
policy up with a supervised phase (cached) that stops at a loss target, then RL raises
held-out exact-match accuracy on 2-digit addition (from grpo.py's cached warm-up).
"""
from hflax.configs import packing_defaults
from hflax.launch.config import base_config


def get_config():
  c = base_config()
  c.algorithm.name, c.algorithm.adv_estimator = "ppo", "gae"
  c.algorithm.use_kl_in_reward = True
  c.algorithm.kl_ctrl.kl_coef = 0.001
  c.algorithm.lam = 0.95
  c.actor.optim.lr, c.critic.optim.lr = 2e-4, 1e-3
  c.rollout.n, c.rollout.temperature = 4, 0.7
  c.data.train_batch_size = 64
  c.actor.ppo_mini_batch_size = c.critic.ppo_mini_batch_size = 32
  c.data.val_batch_size = 100
  c.trainer.update(total_steps=100, val_every=25, save_every=50)
  c.trainer.sft_warmup.update(steps=2000, lr=2e-3, target_loss=0.5)
  c.placement.kind = "custom"
  c.placement.update({"pools": {"policy": 1, "value": 1},
                      "roles": {"actor": {"pool": "policy"}, "ref": {"pool": "policy"},
                                "critic": {"pool": "value"}}})
  c.trainer.run_dir = "runs/ppo"
  packing_defaults(c)
  return c
