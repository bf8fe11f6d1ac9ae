"""Helpers the CPU benchmarks share: the real model as an HF directory both sides load,
matmul peaks in fp32 and bf16 measured beside the workload, peak RSS and load average.

Importing this module imports neither jax nor torch: the scripts set their environment
first."""
from __future__ import annotations

import os
import resource
import statistics
import time

REAL_MODEL = "smollm2-135m-instruct"
# A converted copy is reused across runs: writing 135M fp32 weights is slow.
CACHE_DIR = os.path.join(os.path.expanduser("~"), ".cache", "hflax", "bench")


def toy_config(val_prompts: int = 8):
  """The random byte-vocabulary GRPO job of the CLI tests (seconds a step), which the
  benchmarks' smoke runs train: learning.py --toy and async_step.py --quick."""
  from hflax.launch.config import base_config
  c = base_config()
  c.algorithm.name, c.algorithm.adv_estimator = "grpo", "grpo"
  c.model.builtin.update(hidden_size=32, intermediate_size=64, num_layers=1)
  c.data.update(train_batch_size=4, max_response_length=8)
  c.actor.ppo_mini_batch_size = 4
  c.rollout.n = 2
  c.data.builtin.update(num_train=64, num_val=val_prompts)
  c.data.val_batch_size = val_prompts
  c.trainer.sft_warmup.update(steps=0)
  return c


def real_model_dir(name: str = REAL_MODEL) -> str:
  """An HF directory (fp32 weights, tokenizer, chat template) of a shipped model, written
  once from its GGUF by hflax.models.convert and reused while the GGUF is unchanged."""
  from hflax.models.convert import convert
  from hflax.models.gguf import SHIPPED, resolve
  if name not in SHIPPED:
    raise ValueError(f"model: {name!r} is not one of the shipped models {sorted(SHIPPED)}")
  source = resolve(name)
  stamp = f"{os.path.getsize(source)}-{int(os.path.getmtime(source))}"
  out = os.path.join(CACHE_DIR, f"{name}-{stamp}")
  if not os.path.exists(os.path.join(out, "done")):
    convert(name, out)
    with open(os.path.join(out, "done"), "w") as f:
      f.write(source + "\n")
  return out


def widening_dot(a, b):
  """a @ b accumulated and returned in float32: for bfloat16 inputs the form XLA:CPU runs
  fastest (its library path, AMX where the CPU has it: several times a bfloat16 result),
  and the one hflax's bfloat16 matmuls use (hflax/models/matmul.py)."""
  import jax.numpy as jnp
  return jnp.dot(a, b, preferred_element_type=jnp.float32)


def matmul_peaks(n: int = 1024, repeats: int = 5) -> dict[str, float]:
  """FLOP/s of a jitted [n, n] x [n, n] matmul in float32 and with bfloat16 inputs
  (widening_dot; median of `repeats`, one CPU device): the ceilings each precision's
  achieved FLOP/s are read against."""
  import jax
  import jax.numpy as jnp
  peaks = {}
  for dtype in ("float32", "bfloat16"):
    dot = jax.jit(widening_dot)
    a = jax.random.normal(jax.random.key(1), (n, n), dtype)
    b = jax.random.normal(jax.random.key(2), (n, n), dtype)
    jax.block_until_ready(dot(a, b))
    spent = []
    for _ in range(repeats):
      t0 = time.perf_counter()
      jax.block_until_ready(dot(a, b))
      spent.append(time.perf_counter() - t0)
    peaks[dtype] = 2 * n ** 3 / statistics.median(spent)
  return peaks


def peak_rss_mib() -> float:
  """The process's peak resident memory so far (both frameworks share the process)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def minor_faults() -> int:
  return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def kernel_usage() -> tuple[float, int]:
  """(seconds this process has spent in the kernel, its minor page faults) so far."""
  r = resource.getrusage(resource.RUSAGE_SELF)
  return r.ru_stime, r.ru_minflt


def kernel_since(start: tuple[float, int]) -> dict:
  """kernel_s and minor_faults since a kernel_usage() reading."""
  now = kernel_usage()
  return {"kernel_s": now[0] - start[0], "minor_faults": now[1] - start[1]}


def kernel_text(step: dict) -> str:
  return f"kernel {step['kernel_s']:.2f} s, {step['minor_faults'] / 1e3:.0f}k page faults"


def load_average() -> str:
  one, five, fifteen = os.getloadavg()
  return f"{one:.2f} {five:.2f} {fifteen:.2f} (1/5/15 min, {os.cpu_count()} cores)"


def bf16_instructions() -> str:
  """A line saying whether this CPU has bfloat16 instructions (both benches print it)."""
  from hflax.platforms import cpu_has_bf16
  return (f"bfloat16 instructions in this CPU (hflax.platforms.cpu_has_bf16): {cpu_has_bf16()} "
          "(without them XLA and torch emulate bf16 and fp32 is each side's best setting)")


def decoder_flops(cfg, rows: int, tokens: int, *, logits_tokens: int | None = None,
                  backward: bool = False, squares: float | None = None) -> float:
  """Matmul FLOPs of a teacher-forced pass of `rows` x `tokens` (causal attention counted
  as the full square XLA computes, or over `squares` = the sum of each sequence's length
  squared, for packed rows), the LM head on `logits_tokens` per row (default all);
  backward=True adds the backward pass (twice the forward)."""
  d, h, kv, hd, f, v = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.intermediate_size, cfg.vocab_size)
  per_layer = d * h * hd + 2 * d * kv * hd + h * hd * d + 3 * d * f
  head_tokens = tokens if logits_tokens is None else logits_tokens
  forward = rows * (2 * cfg.num_layers * per_layer * tokens
                    + 4 * cfg.num_layers * h * hd * (tokens * tokens if squares is None
                                                     else squares / rows)
                    + 2 * d * v * head_tokens)
  return forward * (3 if backward else 1)


def lm_head_flops(cfg, rows: int, tokens: int, backward: bool = False) -> float:
  """The LM head's share of decoder_flops (the 49152-id vocabulary on SmolLM2)."""
  return rows * tokens * 2 * cfg.hidden_size * cfg.vocab_size * (3 if backward else 1)


def reset_peak_rss() -> bool:
  """Starts a new peak-RSS window (Linux: writing 5 to clear_refs resets VmHWM), so each
  framework's peak can be read after its own steps in a shared process."""
  try:
    with open("/proc/self/clear_refs", "w") as f:
      f.write("5")
    return True
  except OSError:
    return False


def window_peak_rss_mib() -> float:
  """VmHWM: the peak resident memory since the last reset_peak_rss (or the start)."""
  try:
    with open("/proc/self/status") as f:
      for line in f:
        if line.startswith("VmHWM:"):
          return int(line.split()[1]) / 1024
  except OSError:
    pass
  return peak_rss_mib()


def cpu_description() -> str:
  """The CPU's model name (as /proc/cpuinfo gives it) and core count, for results files."""
  import pathlib
  import platform
  name = platform.processor() or platform.machine()
  try:
    for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
      if line.startswith("model name"):
        name = line.split(":", 1)[1].strip()
        break
  except OSError:
    pass
  return f"{name}, {os.cpu_count()} cores"
