#!/usr/bin/env python
"""Prompts padded to a config's max_prompt_length: the sampler trimmed to the longest
row's bucket against the same program run on every column (the sampler before the trim).

SmolLM2-135M-Instruct (fp32, one device) decodes greedily from chat prompts left-padded
to --width columns, as the data loader pads them to data.max_prompt_length (verl's
GSM8K recipes use 512). Repetitions alternate; the medians, their ratio, whether the
tokens are identical and the largest log-prob difference are printed.

  python bench/prompt_padding.py                # 16 prompts x 64 tokens, width 512
  python bench/prompt_padding.py --quick        # smoke test: 2 prompts x 8 tokens, width 128
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
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402
from generate import chat_prompts  # noqa: E402
from hflax.models.decode_layout import for_decoding  # noqa: E402
from hflax.models.hf import load_checkpoint  # noqa: E402
from hflax.models.tokenizer import load_tokenizer  # noqa: E402
from hflax.rollout.decoding import decode_segments  # noqa: E402
from hflax.rollout.sampler import SamplingParams, _generate, generate, left_pad  # noqa: E402


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--prompts", type=int, default=16)
  parser.add_argument("--width", type=int, default=512, help="the padded prompt width")
  parser.add_argument("--new-tokens", type=int, default=64)
  parser.add_argument("--repeats", type=int, default=3)
  parser.add_argument("--quick", action="store_true")
  args = parser.parse_args(argv)
  if args.quick:
    args.prompts, args.width, args.new_tokens, args.repeats = 2, 128, 8, 1
  print(f"jax {jax.__version__} devices: {jax.devices()}; load average at start: "
        f"{common.load_average()}")
  path = common.real_model_dir()
  tokenizer = load_tokenizer(path)
  _, graphdef, state = load_checkpoint(path, dtype="float32", param_dtype="float32")
  prompts = chat_prompts(tokenizer, args.prompts)
  tokens, mask = left_pad(prompts, tokenizer.pad_id, args.width)
  params = SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0, eos_ids=(),
                          pad_id=tokenizer.pad_id)
  key = jax.random.key(0)

  def trimmed():
    return generate(graphdef, state, (tokens, mask), params, rng=key)

  def every_column():
    return _generate(*for_decoding(graphdef, state), jnp.asarray(tokens), jnp.asarray(mask),
                     key, params=params, segments=decode_segments(args.new_tokens))

  variants = {"trimmed": trimmed, "every column": every_column}
  out, times = {}, {name: [] for name in variants}
  for name, fn in variants.items():  # the first call compiles
    out[name] = jax.block_until_ready(fn())
  for _ in range(args.repeats):
    for name, fn in variants.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - start)
  same = np.array_equal(out["trimmed"]["responses"], out["every column"]["responses"])
  diff = float(np.max(np.abs(np.asarray(out["trimmed"]["rollout_log_probs"])
                             - np.asarray(out["every column"]["rollout_log_probs"]))))
  lengths = [len(p) for p in prompts]
  print(f"{args.prompts} chat prompts of {min(lengths)}-{max(lengths)} tokens padded to "
        f"{args.width}, {args.new_tokens} greedy tokens, fp32, medians of {args.repeats}:")
  for name, values in times.items():
    print(f"  {name:>12} | {statistics.median(values):8.2f} s | "
          + " ".join(f"{v:.2f}" for v in values))
  ratio = statistics.median(times["every column"]) / statistics.median(times["trimmed"])
  print(f"  trimmed is {ratio:.2f}x faster; same tokens: {same}; largest log-prob "
        f"difference {diff:.2e}; load average at end: {common.load_average()}")
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(main())
