"""PPO on the built-in arithmetic task: actor, critic, reference (KL in the reward).

Actor and reference share one device; the critic has its own (per-model meshes on the
2 simulated CPU devices of the default run).
"""
from hflax.launch.config import base_config


def get_config():
  c = base_config()
  c.algorithm.name, c.algorithm.adv_estimator = "ppo", "gae"
  c.algorithm.use_kl_in_reward = True
  c.algorithm.kl_ctrl.kl_coef = 0.001
  c.algorithm.lam = 0.95
  c.rollout.n = 4
  c.placement.kind = "custom"
  c.placement.update({"pools": {"policy": 1, "value": 1},
                     "roles": {"actor": {"pool": "policy"}, "ref": {"pool": "policy"},
                               "critic": {"pool": "value"}}})
  c.trainer.run_dir = "runs/ppo"
  return c
