#!/usr/bin/env python
"""LoRA against full fine-tuning, side by side in one process: what the actor keeps in
memory and how long its update and its generation take.

One random Llama-style model (about 29M parameters by default) is built once; two actor
workers start from it on the same device: one trains every weight, one trains rank-r
adapters on every linear layer (`model.lora_rank`). Each gets the same rollout batch and
advantages, and the two alternate: an update (`update_actor`, two mini-batches of the
batch) and a generation (`generate_sequences`, which for LoRA merges the adapters first),
after one warm-up round each (compilation). Reported: trainable parameters, optimizer
state bytes, parameter bytes, median update and generation times, and their ratios.

  python bench/lora.py            # ~1 minute on 2 cores
  python bench/lora.py --quick    # smoke run
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from hflax.algorithms import aggregate_loss, ppo_clip_loss  # noqa: E402
from hflax.controller.batch import Batch  # noqa: E402
from hflax.controller.training import OptimConfig, UpdateConfig  # noqa: E402
from hflax.controller.actor import ActorRolloutWorker  # noqa: E402
from hflax.models import ModelConfig, create  # noqa: E402
from hflax.models.lora import add_adapters, lora_config  # noqa: E402
from hflax.rollout import SamplingParams, left_pad  # noqa: E402
from hflax.sharding.placement import build_placement, colocated  # noqa: E402


def loss(logp, entropy, f):
  del entropy
  per_token, metrics = ppo_clip_loss(logp, f["old_log_probs"], f["advantages"], f["response_mask"])
  return aggregate_loss(per_token, f["response_mask"]), metrics


def nbytes(tree) -> int:
  return sum(x.nbytes for x in jax.tree.leaves(tree))


def main():
  parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  parser.add_argument("--rank", type=int, default=16)
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args()
  hidden, layers, rounds = (64, 2, 2) if args.quick else (512, 8, args.rounds)
  cfg = ModelConfig(vocab_size=4096, hidden_size=hidden, intermediate_size=hidden * 3,
                    num_layers=layers, num_heads=8, num_kv_heads=4)
  sampling = SamplingParams(max_new_tokens=32, temperature=1.0, n=2, eos_ids=(), pad_id=0)
  graphdef, state = create(cfg, seed=0)
  placed = build_placement(colocated(["actor"], 1))
  common = dict(sampling=sampling, loss_fn=loss, optim=OptimConfig(lr=1e-4),
                update=UpdateConfig(mini_batch_size=16))
  actors = {"full": ActorRolloutWorker(placed["actor"], graphdef, state, **common),
            "lora": ActorRolloutWorker(placed["actor"], *add_adapters(
                lora_config(cfg, args.rank, 2.0 * args.rank, "all-linear"), state, seed=0),
                **common)}
  rs = np.random.RandomState(0)
  tokens, mask = left_pad([rs.randint(3, cfg.vocab_size, 64).tolist() for _ in range(16)], 0)
  prompts = Batch({"prompts": jnp.asarray(tokens), "prompt_mask": jnp.asarray(mask)})
  batch = actors["full"].generate_sequences(prompts)
  batch = batch.union(Batch({"old_log_probs": batch["rollout_log_probs"], "advantages":
                             jnp.asarray(rs.randn(*batch["responses"].shape), jnp.float32)}))
  times = {(name, what): [] for name in actors for what in ("update", "generate")}
  for i in range(rounds + 1):  # round 0 compiles
    for name, actor in actors.items():
      for what, run in (("update", lambda: actor.update_actor(batch).meta["metrics"]),
                        ("generate", lambda: actor.generate_sequences(prompts)["responses"])):
        start = time.perf_counter()
        jax.block_until_ready(run())
        if i:
          times[name, what].append(time.perf_counter() - start)
  print(f"model: {cfg.num_params / 1e6:.1f}M parameters ({layers} layers, hidden {hidden}); "
        f"LoRA rank {args.rank} on all linear layers; batch {len(batch)} rows of "
        f"{batch['input_ids'].shape[1]} tokens; medians of {rounds} alternating rounds")
  rows = {}
  for name, actor in actors.items():
    trainable = cfg.num_params if name == "full" else actor.cfg.num_lora_params
    rows[name] = dict(trainable=trainable, optimizer=nbytes(actor.opt_state),
                      params=nbytes(actor.params),
                      update=statistics.median(times[name, "update"]),
                      generate=statistics.median(times[name, "generate"]))
    r = rows[name]
    print(f"  {name:4s}: trainable {r['trainable'] / 1e6:7.3f}M  optimizer state "
          f"{r['optimizer'] / 2**20:7.1f} MiB  params {r['params'] / 2**20:6.1f} MiB  "
          f"update {r['update'] * 1e3:7.1f} ms  generate {r['generate'] * 1e3:6.1f} ms")
  f, lo = rows["full"], rows["lora"]
  print(f"ratios lora/full: optimizer state {lo['optimizer'] / f['optimizer']:.3f}, "
        f"params {lo['params'] / f['params']:.3f}, update time {lo['update'] / f['update']:.2f}, "
        f"generate time {lo['generate'] / f['generate']:.2f}")


if __name__ == "__main__":
  main()
