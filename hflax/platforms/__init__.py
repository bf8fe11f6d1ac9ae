"""The one place that knows the hardware.

Everything that differs by backend (kernels, compiler options, process set-up) is chosen
here; model, rollout, sharding and controller code asks this package instead of reading
`jax.default_backend()` or a device's `platform` itself.

  xla.py            the plain path GPUs and TPUs take
  attention.py      the one choice of attention implementation per backend
  cpu/              XLA:CPU: the decoding copy, its kernels and their build, process
                    set-up and compiler options; every HFLAX_CPU_* setting in settings.py
  gpu/, tpu/        cuDNN attention and the Pallas log-prob kernel; splash attention
  compile_cache.py  JAX's persistent compilation cache (any backend)

This package imports jax only inside its functions: the CPU process set-up runs before
JAX starts.
"""
from __future__ import annotations

from typing import Iterable


def backend() -> str:
  """The default JAX backend's name: "cpu", "gpu" or "tpu"."""
  import jax
  return jax.default_backend()


def on_cpu() -> bool:
  """Whether the default backend is XLA:CPU (whose tunings the cpu platform holds)."""
  return backend() == "cpu"


# What differs by backend, asked by name. Each is a property of XLA:CPU today (the CPU is
# where hflax measured these forms faster); GPUs and TPUs keep the plain forms.


def sort_is_slow() -> bool:
  """Whether a full sort of the vocabulary costs more than bisecting for a threshold
  (top-p sampling): XLA:CPU sorts a row with scalar code."""
  return on_cpu()


def argmax_is_slow() -> bool:
  """Whether argmax's (value, index) reduction runs as scalar code, so a max and a min
  over the indices where it is reached serve better (token picks): XLA:CPU's does."""
  return on_cpu()


def step_time_follows_rows() -> bool:
  """Whether a decode step's time grows with its rows, so a batch decodes its last rows
  with fewer slots: on CPU it does; an accelerator's small steps cost about the same
  whatever their rows."""
  return on_cpu()


def dots_want_library_forms() -> bool:
  """Whether dots are laid out for XLA:CPU's matmul library: low-precision operands with
  float32 results, gradients written out in the layouts it takes, a decoding copy's few
  rows with the kernel on the left, kernels cast once for many micro-batches
  (models/matmul.py). GPUs and TPUs take their dots as they are."""
  return on_cpu()


def widens_16_bit() -> bool:
  """Whether XLA widens 16-bit data movement and dots to float32 unless they are laid out
  for its library (XLA:CPU does: the model then writes bfloat16 caches through their bits
  and rounds a 16-bit dot's float32 result once)."""
  return on_cpu()


def recompute_is_dear() -> bool:
  """Whether a backward pass should read a forward's results kept in memory rather than
  recompute them (a bfloat16 head's logits, within a bound): on CPU recomputing costs
  more; on accelerators it is cheap and memory is not."""
  return on_cpu()


def decode_attention_kernel_usable(dtype) -> bool:
  """Whether a decode step in `dtype` may attend through a platform kernel here (the CPU
  one, cpu/attention.py, which says why not, once); no other platform has one."""
  from hflax.platforms.cpu import attention
  return attention.usable(dtype)


def packed_matmul(x_RxK, packed_NxK, out_dtype="float32"):
  """[R, N] in out_dtype: rows times a kernel [N, K] that a decoding copy stored in the CPU
  kernel's packed layout (cpu/matmul.py)."""
  from hflax.platforms.cpu import matmul
  return matmul.matmul(x_RxK, packed_NxK, out_dtype)


def decode_attention(q_BxHxDh, k_BxKxDhxS, v_BxKxSxDh, visible_BxS):
  """One decode step's attention [B, H, Dh] through the CPU kernel (cpu/attention.py), for
  a step attention.choose sent there."""
  from hflax.platforms.cpu import attention
  return attention.decode(q_BxHxDh, k_BxKxDhxS, v_BxKxSxDh, visible_BxS)


def all_cpu(devices: Iterable) -> bool:
  """Whether every one of `devices` (jax devices) is a CPU device."""
  return all(d.platform == "cpu" for d in devices)


def free_memory(devices) -> int:
  """Bytes that arrays spread evenly over `devices` (this process's) can still take, all
  together: on accelerators the fullest device's free memory times the devices; XLA:CPU's
  devices share the host's available memory (a container's limit included)."""
  devices = list(devices)
  if all_cpu(devices):
    from hflax.platforms.cpu.process import available_memory
    return available_memory()
  free = [s["bytes_limit"] - s.get("bytes_in_use", 0)
          for s in (d.memory_stats() or {} for d in devices) if s.get("bytes_limit")]
  return min(free) * len(devices) if len(free) == len(devices) else 2**62


def train_compiler_options(devices, compute_dtype="float32") -> dict | None:
  """XLA options for a training step on `devices` computing in `compute_dtype`: XLA:CPU's
  (cpu/options.py) where every device is a CPU, None (XLA's defaults) elsewhere."""
  if not all_cpu(devices):
    return None
  from hflax.platforms.cpu.options import train_options
  return train_options(compute_dtype)


def prepare_process(platform: str) -> None:
  """Set-up a process that will run JAX on `platform` (a cluster's "cpu", "gpu" or "tpu")
  needs before JAX starts (cpu/process.py); nothing elsewhere."""
  if platform == "cpu":
    from hflax.platforms.cpu.process import prepare_cpu_process
    prepare_cpu_process()


def set_local_devices(platform: str, devices: int) -> None:
  """Gives this process `devices` local devices where JAX lets it choose (simulated CPU
  devices); an accelerator's devices are what the machine has."""
  if platform == "cpu":
    import jax
    jax.config.update("jax_num_cpu_devices", devices)


def gpus_to_reserve(platform: str, devices: int) -> int:
  """GPUs a process holding `devices` devices of `platform` reserves from its scheduler."""
  return devices if platform == "gpu" else 0


# Entries for code outside this package: what it needs of the cpu/, gpu/ and tpu/ kernels
# and set-up, by a name that does not say which platform serves it. Each imports its
# platform module late, so importing this package stays free of JAX and of kernels.


def pack_for_kernel(w_NxK):
  """w [N, K] in the packed layout packed_matmul reads (cpu/matmul.py)."""
  from hflax.platforms.cpu import matmul
  return matmul.pack(w_NxK)


def cudnn_attention(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, kv_valid_BxS, fallback, **options):
  """Teacher-forced attention by cuDNN's flash attention (gpu/attention.py), rows it cannot
  take by `fallback`."""
  from hflax.platforms.gpu import attention
  return attention.cudnn(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, kv_valid_BxS, fallback, **options)


def splash_attention(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, kv_valid_BxS, q_seg_BxT=None,
                     **options):
  """Teacher-forced attention by the TPU splash kernel (tpu/attention.py)."""
  from hflax.platforms.tpu import attention
  return attention.splash(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, kv_valid_BxS, q_seg_BxT,
                          **options)


def fused_log_probs_mode() -> str | None:
  """How the fused log-prob kernel serves (gpu/logprob_kernel.py: HFLAX_LOGPROB_KERNEL and
  the GPU found), or None where it does not."""
  from hflax.platforms.gpu import logprob_kernel
  return logprob_kernel.logprob_kernel_mode()


def fused_log_probs(hidden_NxD, w, targets_N, **config):
  """(log-probs, entropy) [N] of each target through the fused kernel (gpu/logprobs.py;
  imported late: it loads Pallas' Triton lowering, wanted on GPUs only)."""
  from hflax.platforms.gpu.logprobs import fused_log_probs as fused
  return fused(hidden_NxD, w, targets_N, **config)


def cores() -> int:
  """The CPU cores this process may run on (simulated CPU devices share them)."""
  from hflax.platforms.cpu import matmul
  return matmul.cores()


def bf16_fast_math_options() -> dict:
  """XLA:CPU's options for a bfloat16 training step when none is turned off
  (cpu/options.py)."""
  from hflax.platforms.cpu import options
  return dict(options.BF16_FAST_MATH)


# Process set-up before JAX starts (cpu/process.py: no JAX imported there either).


def configure_cpu(devices: int | None = None) -> str:
  """Simulated CPU devices (HFLAX_CPU_DEVICES unless `devices`) in XLA_FLAGS, and freed
  host memory kept where JAX will compute on the CPU; returns XLA_FLAGS."""
  from hflax.platforms.cpu import process
  return process.configure_cpu(devices)


def cpu_devices() -> int:
  """The simulated CPU devices asked for (HFLAX_CPU_DEVICES, default 2)."""
  from hflax.platforms.cpu import process
  return process.cpu_devices()


def cpu_has_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool | None:
  """Whether the host CPU has bfloat16 instructions (None where it cannot tell)."""
  from hflax.platforms.cpu import process
  return process.cpu_has_bf16(cpuinfo)


def keep_freed_memory() -> bool:
  """glibc keeps freed memory for reuse on its main heap (cpu/process.py says why)."""
  from hflax.platforms.cpu import process
  return process.keep_freed_memory()


def accelerator_expected() -> bool:
  """Whether JAX will find an accelerator plugin here (so the CPU set-up leaves malloc)."""
  from hflax.platforms.cpu import process
  return process.accelerator_expected()
