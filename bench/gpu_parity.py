#!/usr/bin/env python
"""hflax's numerics on this host's accelerator against transformers (torch fp32 on the CPU).

SmolLM2-135M-Instruct's shape (30 layers, GQA 9/3 heads, tied 49152-id embeddings) with
random weights, saved as a transformers checkpoint and loaded by hflax: the shipped GGUF is
98 MB, more than a device machine takes in one call. Checks, each printed with its figure:

  (each figure is max |difference| / max |reference| over the real tokens)
  fp32 logits        hflax (float32, matmul precision "highest") vs transformers
  bf16 logits        bfloat16 compute vs hflax's float32 logits
  attention          every implementation the backend runs (reference, blockwise, and
                     cuDNN on GPU, which needs bfloat16) vs the reference, bf16 logits
  greedy tokens      hflax's sampler (float32) vs transformers' generate, 32 new tokens
  fused log-probs    the Pallas kernel vs the chunked path on the same hidden states (GPU)

  python bench/gpu_parity.py [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# hidden_log_probs is the chunked reference the kernel is checked against: never the kernel.
os.environ["HFLAX_LOGPROB_KERNEL"] = "0"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from flax import nnx  # noqa: E402

from hflax.models.logprobs import model_log_probs  # noqa: E402
from hflax.models import hf, logits_fn  # noqa: E402
from hflax.models.logprobs import hidden_log_probs  # noqa: E402
from hflax.models.transformer import forward  # noqa: E402
from hflax.rollout.sampler import SamplingParams, generate  # noqa: E402

from accelerator import SMOLLM2_SHAPE  # noqa: E402  (bench/ is this script's path)

SMOLLM2 = SMOLLM2_SHAPE.to_hf()  # the shape accelerator.py times, as transformers reads it
# Bounds on the largest difference over real tokens relative to the largest |reference|:
# fp32 is float32 rounding over 30 layers; bf16 an 8-bit mantissa over them.
FP32_TOL, BF16_TOL = 1e-4, 5e-2
# Triton may take float32 dots in TF32 (a 10-bit mantissa) whatever jax's matmul precision.
KERNEL_TOL = 1e-3


def reference_model(path: str):
  torch.manual_seed(0)
  config = transformers.LlamaConfig(**SMOLLM2)
  config._attn_implementation = "eager"
  model = transformers.LlamaForCausalLM(config).eval()
  model.save_pretrained(path)
  return model


def batch(T: int):
  ids = np.random.RandomState(0).randint(3, SMOLLM2["vocab_size"], size=(4, T))
  mask = np.ones_like(ids)
  mask[1, :T // 3] = 0  # left padding, as the sampler's prompts have
  mask[3, :5] = 0
  return ids, mask


def max_diff(a, b, mask):
  """max |a - b| / max |b| over the real tokens."""
  a, b = (np.asarray(x, np.float32)[mask > 0] for x in (a, b))
  return float(np.abs(a - b).max() / np.abs(b).max())


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--json", metavar="PATH")
  args = p.parse_args(argv)
  jax.config.update("jax_default_matmul_precision", "highest")
  backend = jax.default_backend()
  report = {"device": jax.devices()[0].device_kind, "backend": backend, "checks": {}}
  checks = report["checks"]
  path = tempfile.mkdtemp(prefix="smollm2-random-")
  ref = reference_model(path)
  ids, mask = batch(256)  # a multiple of 128: cuDNN's and splash's block size
  with torch.no_grad():
    ref_logits = ref(torch.tensor(ids), attention_mask=torch.tensor(mask)).logits.numpy()
  logits = jax.jit(logits_fn, static_argnums=0)

  _, graphdef, state = hf.load_checkpoint(path)
  fp32 = np.asarray(logits(graphdef, state, jnp.asarray(ids), jnp.asarray(mask)))
  checks["fp32 logits vs transformers"] = (max_diff(fp32, ref_logits, mask), FP32_TOL)

  impls = ["reference", "blockwise"] + (["cudnn"] if backend == "gpu" else [])
  bf16 = {}
  for impl in impls:
    _, g, s = hf.load_checkpoint(path, dtype="bfloat16", attention=impl)
    bf16[impl] = np.asarray(logits(g, s, jnp.asarray(ids), jnp.asarray(mask)), np.float32)
  checks["bf16 logits vs fp32"] = (max_diff(bf16["reference"], fp32, mask), BF16_TOL)
  for impl in impls[1:]:
    checks[f"bf16 attention {impl} vs reference"] = (
        max_diff(bf16[impl], bf16["reference"], mask), BF16_TOL)

  prompts = ids[:2, :48].tolist()
  sampling = SamplingParams(max_new_tokens=32, temperature=0.0)  # no end token
  ours = np.asarray(generate(graphdef, state, prompts, sampling)["responses"])
  with torch.no_grad():
    theirs = ref.generate(torch.tensor(ids[:2, :48]), max_new_tokens=32, do_sample=False,
                          eos_token_id=None, min_new_tokens=32).numpy()[:, 48:]
  agree = [int(np.argmin(np.append(a == b, False))) for a, b in zip(ours, theirs)]
  checks["greedy tokens equal to transformers' (of 32, per row)"] = (agree, None)

  if backend == "gpu":
    model = nnx.merge(graphdef, state)
    _, hidden = jax.jit(forward, static_argnums=0)(graphdef, state, jnp.asarray(ids),
                                                   jnp.asarray(mask))
    targets = jnp.asarray(np.roll(ids, -1, axis=1))
    fused = model_log_probs(model, hidden, targets)
    plain = hidden_log_probs(model, hidden, targets)
    checks["fused log-probs vs chunked"] = (
        max(max_diff(a, b, mask) for a, b in zip(fused, plain)), KERNEL_TOL)

  failed = []
  for name, (value, tol) in checks.items():
    ok = tol is None or value <= tol
    failed += [] if ok else [name]
    print(f"{name:55} {value if isinstance(value, list) else f'{value:.2e}'}"
          + ("" if tol is None else f"  (bound {tol:g}: {'ok' if ok else 'FAILED'})"))
  print(f"{report['device']} ({backend}): " + (f"FAILED {failed}" if failed else "all within"))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
