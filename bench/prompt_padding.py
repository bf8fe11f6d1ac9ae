#!/usr/bin/env python
"""Prompts padded to a config's max_prompt_length: the sampler and the padded log-prob
pass trimmed to the longest row's bucket against the same programs run on every column
(before the trims).

SmolLM2-135M-Instruct (fp32, one device) decodes greedily from chat prompts left-padded
to --width columns, as the data loader pads them to data.max_prompt_length (verl's
GSM8K recipes use 512), then scores the samples with the log-prob function of the padded
(use_remove_padding=False) passes, on the columns the workers keep
(protocol.without_shared_padding) and on all of them. Repetitions alternate; the
medians, their ratios, whether the tokens are identical and the largest log-prob
differences are printed.

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
from hflax.controller.batch import Batch  # noqa: E402
from hflax.controller.protocol import without_shared_padding  # noqa: E402
from hflax.platforms.decoding import for_decoding  # noqa: E402
from hflax.models.logprobs import sequence_log_probs  # noqa: E402
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

  lengths = [len(p) for p in prompts]
  print(f"{args.prompts} chat prompts of {min(lengths)}-{max(lengths)} tokens padded to "
        f"{args.width}, {args.new_tokens} greedy tokens, fp32, medians of {args.repeats}:")
  out = compare("generation", {"trimmed": trimmed, "every column": every_column},
                args.repeats)
  same = np.array_equal(out["trimmed"]["responses"], out["every column"]["responses"])
  print(f"  same tokens: {same}; largest log-prob difference "
        f"{max_difference(out, 'rollout_log_probs'):.2e}")

  sample = Batch({k: out["trimmed"][k] for k in ("input_ids", "attention_mask", "responses")})
  kept = without_shared_padding(sample)
  score = jax.jit(lambda s, ids, m: sequence_log_probs(graphdef, s, ids, m,
                                                       last=args.new_tokens)[0])
  scored = compare(
      f"log-probs of the samples ({sample['input_ids'].shape[1]} columns, "
      f"{kept['input_ids'].shape[1]} kept)",
      {"trimmed": lambda: score(state, kept["input_ids"], kept["attention_mask"]),
       "every column": lambda: score(state, sample["input_ids"], sample["attention_mask"])},
      args.repeats)
  print(f"  largest log-prob difference {max_difference(scored):.2e}; load average at end: "
        f"{common.load_average()}")
  return 0 if same else 1


def compare(what: str, variants: dict, repeats: int) -> dict:
  """Each variant once to compile, then `repeats` alternating timed runs; prints medians."""
  out = {name: jax.block_until_ready(fn()) for name, fn in variants.items()}
  times = {name: [] for name in variants}
  for _ in range(repeats):
    for name, fn in variants.items():
      start = time.perf_counter()
      jax.block_until_ready(fn())
      times[name].append(time.perf_counter() - start)
  print(f" {what}:")
  for name, values in times.items():
    print(f"  {name:>12} | {statistics.median(values):8.3f} s | "
          + " ".join(f"{v:.3f}" for v in values))
  ratio = statistics.median(times["every column"]) / statistics.median(times["trimmed"])
  print(f"  trimmed is {ratio:.2f}x faster")
  return out


def max_difference(out: dict, key: str | None = None) -> float:
  a, b = (out[name] if key is None else out[name][key] for name in ("trimmed", "every column"))
  return float(np.max(np.abs(np.asarray(a) - np.asarray(b))))


if __name__ == "__main__":
  sys.exit(main())
