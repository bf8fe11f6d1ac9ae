#!/usr/bin/env python
"""Continuous batching (slots) against the wave sampler on skewed and uniform lengths.

A small random Llama-style model decodes greedily. The skewed workload is found, not
forced: from greedy decodes of a pool of random prompts it picks an end token and
prompts so that 1 row in 8 never emits it within --long tokens and the others emit it
after about --short tokens. The uniform workload has no end token (every row runs to
--uniform-tokens). Each workload is timed, repetitions alternating, for:

  waves:       today's sampler with at most --slots rows at once (waves of --slots rows,
               as the actor runs under rollout.max_num_seqs)
  continuous:  --slots decode slots, each refilled as its row ends
  one wave:    today's sampler with every row at once (no cap)

(Slots for every row would run the one-wave program itself: no row would ever wait.)

and the medians, the ratios and whether the tokens are identical are printed.

  python bench/continuous.py            # about a minute or two on an idle CPU
  python bench/continuous.py --quick    # smoke test
"""
from __future__ import annotations

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from hflax.models import ModelConfig, create  # noqa: E402
from hflax.rollout.sampler import (SamplingParams, _rows_mesh, generate,  # noqa: E402
                                   generate_over_rows, left_pad)

VOCAB = 512


def model_config() -> ModelConfig:
  return ModelConfig(family="llama", vocab_size=VOCAB, hidden_size=128, intermediate_size=344,
                     num_layers=2, num_heads=4, num_kv_heads=2)


def skewed_workload(model, rows: int, long: int, short: int, pool: int, seed: int = 0):
  """(prompts, end tokens): rows // 8 prompts reach no end token within `long` greedy
  tokens, the others reach one after short * 3/4 .. 5/4 tokens.

  End tokens are added one at a time, each the one that brings the most prompts into
  that window while enough prompts still never end."""
  rs = np.random.RandomState(seed)
  candidates = [rs.randint(1, VOCAB, size=rs.randint(4, 17)).tolist() for _ in range(pool)]
  free = np.asarray(generate(*model, candidates, SamplingParams(max_new_tokens=long,
                                                                 temperature=0))["responses"])
  # first[t, p]: the response length of prompt p were t the end token (long + 1: never)
  hit = free[None] == np.arange(VOCAB)[:, None, None]
  first = np.where(hit.any(-1), hit.argmax(-1) + 1, long + 1)
  lo, hi, want_long = short * 3 // 4, short * 5 // 4, rows // 8
  ends, length = [], np.full(pool, long + 1)
  while True:
    trial = np.minimum(length[None], first)
    fits = ((trial >= lo) & (trial <= hi)).sum(1)
    fits[(trial > long).sum(1) < want_long] = -1
    token = int(fits.argmax())
    if fits[token] <= ((length >= lo) & (length <= hi)).sum():
      break
    ends.append(token)
    length = trial[token]
  close = np.flatnonzero((length >= lo) & (length <= hi))
  never = np.flatnonzero(length > long)[:want_long]
  if len(close) < rows - want_long:
    raise SystemExit(f"{len(close)} of {pool} prompts end near {short} tokens, "
                     f"{rows - want_long} needed: raise --pool")
  close = list(close[np.argsort(np.abs(length[close] - short), kind="stable")]
               [:rows - want_long])
  never = list(never)
  order = [never.pop() if i % 8 == 7 else close.pop() for i in range(rows)]  # mixed
  return [candidates[i] for i in order], tuple(ends)


def compare(name, model, prompts, params, slots, reps):
  tokens, mask = left_pad(prompts, 0)
  mesh = _rows_mesh(jax.devices()[:1])
  runs = {  # today's sampler and continuous batching, at the same cap and with none
      "waves": lambda: generate_over_rows(*model, tokens, mask, jax.random.key(0), params, mesh,
                                          wave_rows=slots),
      "continuous": lambda: generate(*model, prompts, params, slots=slots),
      "one wave": lambda: generate(*model, prompts, params),
  }
  against = {"waves": "continuous", "one wave": "continuous"}
  times = {k: [] for k in runs}
  outs = {}
  for k, fn in runs.items():  # compile
    jax.block_until_ready(fn())
  for _ in range(reps):  # alternate, so that load from elsewhere falls on all of them
    for k, fn in runs.items():
      t, outs[k] = _once(fn)
      times[k].append(t)
  lengths = np.asarray(outs["continuous"]["response_length"])
  print(f"\n{name}: {len(prompts)} rows, response lengths min {lengths.min()} median "
        f"{int(np.median(lengths))} max {lengths.max()}, {lengths.sum()} tokens in all; "
        f"medians of {reps}; waves and continuous: {slots} rows at once, one wave: all")
  med = {k: statistics.median(v) for k, v in times.items()}
  for k in runs:
    line = f"  {k:<11} {med[k]:8.3f} s  ({', '.join(f'{t:.2f}' for t in times[k])})"
    if k in against:
      line += f"  {against[k]} {med[k] / med[against[k]]:.2f}x faster"
    if k != "one wave":  # today's sampler with no cap: the reference
      same = all(np.array_equal(np.asarray(outs[k][f]), np.asarray(outs["one wave"][f]))
                 for f in ("responses", "response_mask", "response_length"))
      logp = np.abs(np.asarray(outs[k]["rollout_log_probs"]) -
                    np.asarray(outs["one wave"]["rollout_log_probs"])).max()
      line += f"; tokens as one wave's: {same}, max |log-prob diff| {logp:.1e}"
    print(line)
  return med


def _once(fn):
  """Seconds of one call, and its result."""
  start = time.perf_counter()
  out = fn()
  jax.block_until_ready(out)
  return time.perf_counter() - start, out


def main():
  ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  ap.add_argument("--rows", type=int, default=64)
  ap.add_argument("--slots", type=int, default=16)
  ap.add_argument("--long", type=int, default=512)
  ap.add_argument("--short", type=int, default=32)
  ap.add_argument("--uniform-tokens", type=int, default=128)
  ap.add_argument("--pool", type=int, default=256, help="candidate prompts for the skew")
  ap.add_argument("--reps", type=int, default=3)
  ap.add_argument("--quick", action="store_true")
  args = ap.parse_args()
  if args.quick:
    args.rows, args.slots, args.long, args.short = 16, 4, 128, 16
    args.uniform_tokens, args.pool, args.reps = 32, 128, 1
  model = create(model_config(), seed=0)
  print(f"model: {model_config()}")
  print(f"jax {jax.__version__} on {jax.devices()[0].platform}; load {os.getloadavg()}")
  prompts, ends = skewed_workload(model, args.rows, args.long, args.short, args.pool)
  skew = compare(f"skewed (end tokens {ends})", model, prompts,
                 SamplingParams(max_new_tokens=args.long, temperature=0, eos_ids=ends),
                 args.slots, args.reps)
  uniform = compare("uniform (no end token)", model, prompts,
                    SamplingParams(max_new_tokens=args.uniform_tokens, temperature=0),
                    args.slots, args.reps)
  print(f"\nload after: {os.getloadavg()}")
  for name, med in (("skewed", skew), ("uniform", uniform)):
    print(f"{name}: continuous {med['waves'] / med['continuous']:.2f}x the waves of {args.slots}"
          f", {med['one wave'] / med['continuous']:.2f}x one wave")
  print("targets: skewed >= 2x; uniform: no regression against the waves of the same cap")

if __name__ == "__main__":
  main()
