"""GRPO on the built-in arithmetic task: groups of samples per prompt, KL as a loss."""
from hflax.launch.config import base_config


def get_config():
  c = base_config()
  c.algorithm.name, c.algorithm.adv_estimator = "grpo", "grpo"
  c.actor.use_kl_loss, c.actor.kl_loss_coef = True, 0.001
  c.rollout.n = 8
  c.placement.kind = "custom"
  c.placement.update({"pools": {"policy": 1, "reference": 1},
                     "roles": {"actor": {"pool": "policy"}, "ref": {"pool": "reference"}}})
  c.trainer.run_dir = "runs/grpo"
  return c
