"""PPO on SmolLM2-135M-Instruct: grpo_smollm2.py's model, task and batches, with a critic
and GAE instead of group baselines.

The critic starts from the same pretrained model with a fresh value head (verl's default),
so each step adds a 135M forward and update to GRPO's. Install as for grpo_smollm2.py.
"""
import importlib.util
import os


def _grpo_config():
  # Config files are loaded by path, not as a package: read the sibling the same way.
  spec = importlib.util.spec_from_file_location(
      "grpo_smollm2", os.path.join(os.path.dirname(os.path.abspath(__file__)), "grpo_smollm2.py"))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module.get_config()


def get_config():
  c = _grpo_config()
  c.algorithm.update(name="ppo", adv_estimator="gae", gamma=1.0, lam=1.0)
  c.rollout.n = 4  # the critic, not a group of samples, gives the baseline
  c.data.train_batch_size = 16
  c.actor.update(ppo_mini_batch_size=16, ppo_micro_batch_size=16)
  c.critic.update(ppo_mini_batch_size=16, ppo_micro_batch_size=16)
  c.critic.optim.lr = 1e-5
  c.trainer.run_dir = "runs/ppo_smollm2"
  return c
