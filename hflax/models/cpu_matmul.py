"""Rows times a decoding copy's bfloat16 kernel on x86 CPUs with AVX512-BF16, through a
kernel of our own (cpu_matmul.cc) that XLA calls as a custom call (jax.ffi).

Why: a decode step multiplies a few rows (32 a device for 64 prompts on two cores) by
every kernel, and XLA:CPU's matmul library runs such products well under the CPU's peak.
On a 2-core AMD EPYC (Zen 4; one core's vdpbf16ps peak about 220 GFLOP/s, measured with a
register-only loop), SmolLM2's kernels at 32 rows a device with both devices busy ran at
75-130 GFLOP/s a device in the library and 137-159 in this kernel (in a C loop, 185-210).
The gain comes from the layout: the kernel is packed once, when the decoding copy is
written, so that each step along K reads 16 outputs' weights for one pair of K indices in
one contiguous 64-byte load, the operand vdpbf16ps takes; the library repacks its operand
on every call. float32 has no such kernel: the same scheme ran no faster than the library
there (62-78 GFLOP/s a device against 64-78).

The packed layout (`pack`): a kernel [N, K] ([out, in]) keeps its shape and dtype, and
each block of 16 outputs (rows n0..n0+15) is stored [K / 2, 16, 2] (pairs along K). It
is a permutation within 16-row blocks, so reshaping a kernel stored [..., K] flattens its
leading axes as the rows, and a packed copy can be sliced by 16-row blocks.

HFLAX_CPU_MATMUL=0 turns it off (decoding copies then stay [out, in] for XLA's library).
Otherwise it is used for weights replicated on one device per core (`serves`; on a
2-core host, generate(devices=jax.devices()) with jax_num_cpu_devices=2, as
bench/generate.py's fastest row runs), where the CPU has AVX512-BF16 and a C++ compiler (g++, or $CXX)
builds cpu_matmul.cc, once, into a cache directory ($HFLAX_CACHE_DIR, else
$XDG_CACHE_HOME/hflax, else ~/.cache/hflax; about 4 s); where it is not, `problem` says
why and the reason is logged once.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import pathlib
import shutil
import subprocess
import tempfile

import jax
import jax.numpy as jnp
import numpy as np

ENV = "HFLAX_CPU_MATMUL"
SOURCE = pathlib.Path(__file__).with_name("cpu_matmul.cc")
LANES = 16  # outputs per packed block: a 512-bit register of float32
# By the result's dtype: float32, or rounded to bfloat16 in the kernel (a separate convert
# of each decode-step product cost SmolLM2 ~4 ms a step at 32 rows a device).
_TARGETS = {jnp.dtype(jnp.float32): ("hflax_cpu_matmul_bf16", "HflaxCpuMatmulBf16"),
            jnp.dtype(jnp.bfloat16): ("hflax_cpu_matmul_bf16_rounded",
                                      "HflaxCpuMatmulBf16Rounded")}
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-exceptions", "-w")


def problem(dtype) -> str | None:
  """Why the kernel cannot serve `dtype` in this process, or None where it can."""
  dtype = jnp.dtype(dtype)
  if os.environ.get(ENV, "").lower() in ("0", "false", "off"):
    return f"{ENV}={os.environ[ENV]}"
  if dtype != jnp.bfloat16:
    return f"no kernel for {dtype.name}"
  if jax.default_backend() != "cpu":
    return f"the default backend is {jax.default_backend()}, not cpu"
  needed = {"avx512f", "avx512bw", "avx512_bf16"}
  missing = needed - _cpu_flags()
  if missing:
    return f"this CPU lacks {', '.join(sorted(missing))}"
  library = _library()
  return library if isinstance(library, str) else None


def usable(dtype) -> bool:
  """Whether decoding copies in `dtype` are packed for this kernel (logs why not, once)."""
  reason = problem(dtype)
  if reason is not None:
    _note_once(f"decoding with XLA's matmuls in {jnp.dtype(dtype).name}: {reason}")
  return reason is None


def packable(shape) -> bool:
  """Whether a kernel stored [..., K] with this shape can be packed."""
  return len(shape) >= 2 and int(np.prod(shape[:-1])) % LANES == 0 and shape[-1] % 2 == 0


def pack(w):
  """A bfloat16 kernel stored [..., K] ([out, in]) in the packed layout, same shape."""
  K = w.shape[-1]
  blocks = w.reshape(-1, LANES, K // 2, 2)  # [N / 16, 16, K / 2, 2]
  return blocks.transpose(0, 2, 1, 3).reshape(w.shape)


def unpack(w):
  """`pack`'s inverse."""
  K = w.shape[-1]
  blocks = w.reshape(-1, K // 2, LANES, 2)
  return blocks.transpose(0, 2, 1, 3).reshape(w.shape)


def matmul(x_RxK, packed_NxK, out_dtype=jnp.float32):
  """[R, N] in out_dtype (float32, or bfloat16 rounded once): x_RxK (cast to bfloat16)
  times a packed bfloat16 kernel's [N, K] transposed, accumulated in float32."""
  reason = problem(packed_NxK.dtype)
  if reason is not None:
    raise RuntimeError(f"hflax cpu matmul: {reason}")
  R, N = x_RxK.shape[0], packed_NxK.shape[0]
  out_dtype = jnp.dtype(out_dtype)
  call = jax.ffi.ffi_call(_registered(out_dtype), jax.ShapeDtypeStruct((R, N), out_dtype),
                          vmap_method="sequential")
  return call(x_RxK.astype(jnp.bfloat16), packed_NxK)


def serves(devices: int) -> bool:
  """Whether weights held on this many devices (a replica on each) decode faster through
  the kernel: where they keep every core busy, one device per core. The kernel runs on
  one thread; XLA's library spreads a lone device's matmuls over the cores. Threads of
  our own did not get there: inside the decode loop XLA hands a custom call no thread
  pool, and a helper thread competed with XLA's spinning ones (64 SmolLM2 prompts on one
  device of a 2-core Zen 4: 18-22 s a call against 15.4-15.9 through the library)."""
  return devices >= cores()


def cores() -> int:
  """The cores this process may run on."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


@functools.cache
def _registered(out_dtype) -> str:
  name, symbol = _TARGETS[out_dtype]
  jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(_library(), symbol)),
                              platform="cpu")
  return name


@functools.cache
def _cpu_flags() -> frozenset:
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        if line.startswith("flags"):
          return frozenset(line.split(":", 1)[1].split())
  except OSError:
    pass
  return frozenset()


@functools.cache
def _library():
  """The compiled kernel (ctypes.CDLL), or a string saying why there is none."""
  compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
  if compiler is None or shutil.which(compiler) is None:
    return "no C++ compiler found (g++, or $CXX) to build cpu_matmul.cc"
  include = jax.ffi.include_dir()
  version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
  key = hashlib.sha256("\0".join([SOURCE.read_text(), version, include, jax.__version__,
                                  *_FLAGS]).encode()).hexdigest()[:16]
  path = _cache_dir() / f"cpu_matmul-{key}.so"
  if not path.exists():
    path.parent.mkdir(parents=True, exist_ok=True)
    # Written aside and renamed: processes building at once (test workers) never load a
    # half-written library.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    built = subprocess.run([compiler, *_FLAGS, f"-I{include}", str(SOURCE), "-o", tmp],
                           capture_output=True, text=True)
    if built.returncode:
      os.unlink(tmp)
      lines = built.stderr.strip().splitlines() or ["no output"]
      first = next((line for line in lines if "error" in line), lines[0])
      return f"{compiler} could not build cpu_matmul.cc: {first}"
    os.replace(tmp, path)
  return ctypes.cdll.LoadLibrary(str(path))


def _cache_dir() -> pathlib.Path:
  if os.environ.get("HFLAX_CACHE_DIR"):
    return pathlib.Path(os.environ["HFLAX_CACHE_DIR"])
  base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
  return pathlib.Path(base) / "hflax"


@functools.cache
def _note_once(message: str):
  logging.getLogger(__name__).info(message)
