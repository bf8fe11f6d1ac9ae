"""Writes a checkpoint hflax reads (a .gguf file, a shipped model's name, an HF directory)
as an HF directory that transformers and TRL load: safetensors weights, config.json,
tokenizer and chat template. Peers can then run on the very same weights:

  python -m hflax.models.convert smollm2-135m-instruct /tmp/smollm2-hf
"""
from __future__ import annotations

import argparse
import sys

from hflax.models import hf
from hflax.models.tokenizer import load_tokenizer, save_tokenizer


def convert(source: str, out: str, dtype: str = "float32") -> None:
  tokenizer = load_tokenizer(source)  # first: a bad source fails before any weights load
  cfg, _, state = hf.load_checkpoint(source)
  hf.export_checkpoint(out, cfg, state, dtype=dtype)
  save_tokenizer(tokenizer, out)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m hflax.models.convert", description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("source", help="a .gguf file, a shipped model's name, or an HF directory")
  parser.add_argument("out", help="the HF directory to write")
  parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
  args = parser.parse_args(argv)
  try:
    convert(args.source, args.out, args.dtype)
  except (OSError, ValueError, ImportError) as e:
    print(f"error: {e}", file=sys.stderr)
    return 2
  print(f"wrote {args.out}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
