#!/usr/bin/env python
"""Fused log-prob kernel vs the chunked pure-JAX path, forward and forward+backward, on a GPU.

For each vocabulary size and head layout (untied lm_head [D, V], tied embedding [V, D])
it times both paths of `hidden_log_probs` on the same bf16 inputs, alternating repetitions
after warm-up, and reports the median times, their ratio, each program's scratch memory
(XLA's compiled memory analysis, temp bytes: what the program allocates beyond its
arguments and outputs) and the largest absolute difference between the two results (bf16
gradients: expect about one bf16 ulp of the largest entry).

  python bench/logprob_kernel.py                       # N=8192 tokens, D=4096, V=128256 and 32000
  python bench/logprob_kernel.py --tokens 2048 --vocab 32000
  python bench/logprob_kernel.py --tiles 64,128,64,4,3 128,128,64,8,3   # tile sweep

Without a GPU it says so, runs the interpret-mode correctness check on tiny shapes, and
exits 0. `--interpret` runs the table anyway, kernel interpreted (a smoke test of this
script: its timings mean nothing).
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# hidden_log_probs itself is the fallback here; the kernel is called directly.
os.environ["HFLAX_LOGPROB_KERNEL"] = "0"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402

from hflax.models.logprobs import model_log_probs  # noqa: E402
from hflax.models import ModelConfig, create  # noqa: E402
from hflax.models.logprobs import hidden_log_probs  # noqa: E402


def head_model(vocab, d, tied, dtype):
  """A DecoderLM with no layers: just the output projection that `logits` uses."""
  cfg = ModelConfig(vocab_size=vocab, hidden_size=d, intermediate_size=d, num_layers=0,
                    num_heads=1, num_kv_heads=1, tie_word_embeddings=tied, dtype=dtype,
                    param_dtype=dtype)
  return create(cfg)


def programs(graphdef, targets, temperature, **kernel_cfg):
  """{(path, pass): fn(state, hidden)} for path in fallback/kernel, pass in fwd/fwd+bwd."""
  def fallback(state, hidden):
    return hidden_log_probs(nnx.merge(graphdef, state), hidden, targets,
                            temperature=temperature)

  def kernel(state, hidden):
    return model_log_probs(nnx.merge(graphdef, state), hidden, targets, temperature,
                                   **kernel_cfg)

  def train(fn):
    def loss(state, hidden):
      logp, ent = fn(state, hidden)
      return jnp.sum(logp) + 0.01 * jnp.sum(ent)
    return jax.grad(loss, argnums=(0, 1))

  return {(name, kind): jax.jit(f if kind == "fwd" else train(f))
          for name, f in (("fallback", fallback), ("kernel", kernel))
          for kind in ("fwd", "fwd+bwd")}


def tile_config(spec):
  """"rows,vocab,d,warps,stages" -> the kernel's Config fields."""
  names = ("block_rows", "block_vocab", "block_d", "num_warps", "num_stages")
  return dict(zip(names, map(int, spec.split(","))))


def max_diff(a, b):
  return max(float(jnp.max(jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32))))
             for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def check_on_cpu():
  """The kernel in Pallas interpret mode against the fallback on tiny shapes."""
  for tied in (False, True):
    graphdef, state = head_model(100, 48, tied, "float32")
    k = jax.random.split(jax.random.key(0), 2)
    hidden = jax.random.normal(k[0], (2, 19, 48))
    targets = jax.random.randint(k[1], (2, 19), 0, 100)
    fns = programs(graphdef, targets, 0.7, block_rows=16, block_vocab=16, block_d=16,
                   interpret=True)
    for kind in ("fwd", "fwd+bwd"):
      diff = max_diff(fns["kernel", kind](state, hidden), fns["fallback", kind](state, hidden))
      print(f"interpret check  tied={tied!s:5} {kind:8} max |kernel - fallback| = {diff:.2e}")
      assert diff < 1e-4, diff


def timed(fn, args, reps):
  jax.block_until_ready(fn(*args))  # warm-up: first-run allocations, autotuning
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return times


def bench(args):
  dev = jax.devices()[0]
  per = math.ceil(args.reps / args.rounds)  # timed runs per path and round
  print(f"device: {dev.device_kind} ({jax.device_count()} visible), jax {jax.__version__}")
  print(f"N={args.tokens} tokens as [{args.batch}, {args.tokens // args.batch}], D={args.d}, "
        f"{args.dtype}, temperature {args.temperature}; median of {args.rounds * per} "
        f"({args.rounds} alternating rounds of {per})\n")
  print("| V | head | pass | kernel tiles | fallback ms | kernel ms | speed-up "
        "| fallback temp MiB | kernel temp MiB | max diff |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for vocab in args.vocab:
    for tied in (False, True):
      graphdef, state = head_model(vocab, args.d, tied, args.dtype)
      k = jax.random.split(jax.random.key(0), 2)
      hidden = jax.random.normal(k[0], (args.batch, args.tokens // args.batch, args.d),
                                 args.dtype)
      targets = jax.random.randint(k[1], hidden.shape[:2], 0, vocab)
      for tiles, kind in [(t, p) for t in args.tiles for p in ("fwd", "fwd+bwd")]:
        fns = programs(graphdef, targets, args.temperature, interpret=args.interpret,
                       **tile_config(tiles))
        pair = {name: fns[name, kind].lower(state, hidden).compile()
                for name in ("fallback", "kernel")}
        temp = {name: fn.memory_analysis().temp_size_in_bytes for name, fn in pair.items()}
        diff = max_diff(pair["kernel"](state, hidden), pair["fallback"](state, hidden))
        times = {name: [] for name in pair}
        for _ in range(args.rounds):  # alternate, so drift hits both paths alike
          for name, fn in pair.items():
            times[name] += timed(fn, (state, hidden), per)
        ms = {name: 1e3 * statistics.median(t) for name, t in times.items()}
        print(f"| {vocab} | {'tied' if tied else 'untied'} | {kind} | {tiles} "
              f"| {ms['fallback']:.2f} "
              f"| {ms['kernel']:.2f} | {ms['fallback'] / ms['kernel']:.2f}x "
              f"| {temp['fallback'] / 2**20:.0f} | {temp['kernel'] / 2**20:.0f} "
              f"| {diff:.2e} |", flush=True)
      del state, hidden
  stats = dev.memory_stats() or {}
  if "peak_bytes_in_use" in stats:
    print(f"\nprocess peak_bytes_in_use: {stats['peak_bytes_in_use'] / 2**30:.2f} GiB")


def main():
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--tokens", type=int, default=8192)
  p.add_argument("--batch", type=int, default=8, help="rows of the fallback's [B, T] layout")
  p.add_argument("--d", type=int, default=4096)
  p.add_argument("--vocab", type=int, nargs="+", default=[128256, 32000])
  p.add_argument("--dtype", default="bfloat16")
  p.add_argument("--temperature", type=float, default=1.0)
  p.add_argument("--reps", type=int, default=10)
  p.add_argument("--rounds", type=int, default=2)
  p.add_argument("--tiles", nargs="+", default=["64,128,64,4,3"],
                 help="kernel tile configs: rows,vocab,d,warps,stages (powers of 2, >= 16)")
  p.add_argument("--interpret", action="store_true", help="smoke-test the table off-GPU")
  args = p.parse_args()
  if jax.default_backend() != "gpu" and not args.interpret:
    print(f"bench/logprob_kernel.py needs a GPU (found {jax.default_backend()}); "
          "running the interpret-mode check on tiny shapes instead.")
    check_on_cpu()
    return
  bench(args)


if __name__ == "__main__":
  main()
