"""Supervised warm-up: teaches a fresh policy the answer format of its task (prompt ->
ground truth + end token), so that RL starts from a policy with something to improve.

It stops after `steps`, or earlier once the mean loss of the last LOSS_WINDOW steps reaches
`target_loss` (when set; so never before step LOSS_WINDOW). On the built-in arithmetic
task the loss falls in one sharp drop whose timing depends on the seed: after a fixed 300
steps one seed started RL at 3% held-out accuracy (and RL never took off) and another at
47%; a loss target starts every seed from a similar, partly trained policy.

The result is cached as an HF checkpoint directory keyed by everything that determines
it, so repeated runs (and resumed ones) skip it.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import optax

from hflax.controller.training import train_compiler_options
from hflax.launch.config import tokenizer_spec
from hflax.launch.sft_tools import TOOL_SOURCES, tool_use_example
from hflax.models import hf
from hflax.models.logprobs import sequence_log_probs

LOSS_WINDOW = 20


def _file_digest(path: str) -> str | None:
  """The contents' hash: the same path edited in place must not reuse a stale warm-up."""
  if not os.path.isfile(path):
    return None  # "builtin:..." (its rows follow from the data config)
  digest = hashlib.sha256()
  with open(path, "rb") as f:
    for block in iter(functools.partial(f.read, 1 << 20), b""):
      digest.update(block)
  return digest.hexdigest()


def warmup_cache_dir(cfg, model_cfg) -> str:
  """Keyed by what the warm-up reads, and only that: batch sizes, validation data or the
  cache's own location do not change its result, so they do not repeat it."""
  d = cfg.data
  sft = {k: v for k, v in cfg.trainer.sft_warmup.to_dict().items() if k != "cache_dir"}
  key = {"model": model_cfg.to_hf(), "dtypes": (str(model_cfg.dtype), str(model_cfg.param_dtype)),
         "sft": sft, "tokenizer": tokenizer_spec(cfg),
         "seed": cfg.trainer.seed, "path": cfg.model.path, "train_files": d.train_files,
         "lengths": (d.max_prompt_length, d.max_response_length),
         "chat_template_kwargs": d.chat_template_kwargs.to_dict()}
  if d.filter_overlong_prompts:  # fewer rows; only then, so other runs keep their key
    key["filter_overlong_prompts"] = True
  digest = _file_digest(d.train_files)
  if digest:
    key["train_files_sha256"] = digest
  else:  # the built-in task's rows follow from its settings and the data seed
    key["builtin"], key["data_seed"] = d.builtin.to_dict(), d.seed
  key = json.dumps(key, sort_keys=True, default=str)
  root = cfg.trainer.sft_warmup.cache_dir or os.path.join(
      os.path.expanduser("~"), ".cache", "hflax", "sft")
  return os.path.join(root, hashlib.sha256(key.encode()).hexdigest()[:16])


def _examples(rows, tokenizer, max_prompt: int, max_answer: int, template=None):
  """Left-padded prompt + answer + end token; the loss mask covers the answer part (for
  the tool task, its model turns: sft_tools)."""
  eos = tokenizer.eos_ids[0]
  seqs, loss = [], []
  for row in rows:
    if row.get("data_source") in TOOL_SOURCES:  # a whole tool conversation (sft_tools)
      prompt, answer, answer_loss = tool_use_example(row, tokenizer, template)
      prompt, answer = prompt[-max_prompt:], answer[:max_answer]
      answer_loss = answer_loss[:max_answer]
    else:
      prompt = tokenizer.encode_chat(row["prompt"], **(template or {}))[-max_prompt:]
      answer = (tokenizer.encode(str(row["reward_model"]["ground_truth"])) + [eos])[:max_answer]
      answer_loss = [1] * len(answer)
    seqs.append(prompt + answer)
    loss.append([0] * len(prompt) + answer_loss)
  width = max_prompt + max_answer
  tokens = np.full((len(seqs), width), tokenizer.pad_id, np.int32)
  mask, loss_mask = np.zeros((len(seqs), width), bool), np.zeros((len(seqs), width), bool)
  for i, (s, m) in enumerate(zip(seqs, loss)):
    tokens[i, width - len(s):], mask[i, width - len(s):] = s, True
    loss_mask[i, width - len(s):] = m
  return tokens, mask, loss_mask


def sft_warmup(cfg, policy, tokenizer, rows, log=print):
  """Returns the warmed-up policy (model config, graphdef, state); cached on disk."""
  model_cfg, graphdef, state = policy
  sft = cfg.trainer.sft_warmup
  cache = warmup_cache_dir(cfg, model_cfg)
  if os.path.isfile(os.path.join(cache, "config.json")):
    log(f"sft warm-up: reusing {cache}")
    try:
      return hf.load_checkpoint(cache, param_dtype=model_cfg.param_dtype,
                                dtype=model_cfg.dtype, remat=model_cfg.remat)
    except (OSError, ValueError, KeyError) as e:
      why = e.args[0] if isinstance(e, KeyError) and e.args else e
      raise ValueError(f"config.trainer.sft_warmup.cache_dir: the cached warm-up {cache} "
                       f"cannot be loaded ({why}); remove that directory to warm up "
                       "again") from None
  tokens, mask, loss_mask = _examples(rows, tokenizer, cfg.data.max_prompt_length,
                                      cfg.data.max_response_length,
                                      cfg.data.chat_template_kwargs.to_dict())
  tx = optax.adam(sft.lr)
  opt_state = tx.init(state)

  @functools.partial(jax.jit, compiler_options=train_compiler_options(jax.devices()[:1],
                                                                   model_cfg.dtype))
  def step(state, opt_state, tokens, mask, loss_mask):
    def loss_fn(state):
      logp, _ = sequence_log_probs(graphdef, state, tokens, mask)
      return -(logp * loss_mask).sum() / jnp.maximum(loss_mask.sum(), 1)
    loss, grads = jax.value_and_grad(loss_fn)(state)
    updates, opt_state = tx.update(grads, opt_state, state)
    return optax.apply_updates(state, updates), opt_state, loss

  rng = np.random.default_rng(cfg.trainer.seed)
  recent = collections.deque(maxlen=LOSS_WINDOW)
  for i in range(sft.steps):
    idx = rng.choice(len(tokens), size=min(sft.batch_size, len(tokens)), replace=False)
    state, opt_state, loss = step(state, opt_state, tokens[idx], mask[idx], loss_mask[idx])
    if (i + 1) % max(1, sft.steps // 5) == 0:
      log(f"sft warm-up: step {i + 1}/{sft.steps} loss {float(loss):.4f}")
    if sft.target_loss:
      recent.append(float(loss))
      if len(recent) == LOSS_WINDOW and np.mean(recent) <= sft.target_loss:
        log(f"sft warm-up: mean loss {np.mean(recent):.4f} of the last {LOSS_WINDOW} steps "
            f"reached target_loss={sft.target_loss} at step {i + 1}")
        break
  os.makedirs(os.path.dirname(cache), exist_ok=True)
  tmp = cache + f".tmp{os.getpid()}"
  hf.export_checkpoint(tmp, model_cfg, state)
  os.replace(tmp, cache) if not os.path.exists(cache) else None
  return model_cfg, graphdef, state
