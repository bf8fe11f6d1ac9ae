"""Rows times a decoding copy's kernel on x86 CPUs with AVX-512 (bfloat16 with
AVX512-BF16, and float32), through a kernel of our own (matmul.cc) that XLA calls as a
custom call (jax.ffi).

Why: a decode step multiplies a few rows (a few dozen a device) by every kernel, and
XLA:CPU's matmul library runs such products well under the CPU's peak; this kernel gets
closer to it, in bfloat16 more than in float32 (bench/generate.py measures whole calls).
The gain comes from the layout: the kernel is packed once, when the decoding copy is
written, so that each step along K reads 16 outputs' weights in one contiguous 64-byte
load (for one pair of K indices in bfloat16, the operand vdpbf16ps takes); the library
repacks its operand on every call.

The packed layout (`pack`): a kernel [N, K] ([out, in]) keeps its shape and dtype, and
each block of 16 outputs (rows n0..n0+15) is stored [K / 2, 16, 2] in bfloat16 (pairs
along K), [K, 16] in float32. It is a permutation within 16-row blocks, so reshaping a
kernel stored [..., K] flattens its leading axes as the rows, and a packed copy can be
sliced by 16-row blocks.

HFLAX_CPU_MATMUL=0 turns it off (decoding copies then stay [out, in] for XLA's library).
Otherwise it is used for weights replicated on one device per core (`serves`; on a
2-core host, generate(devices=jax.devices()) with jax_num_cpu_devices=2, as
bench/generate.py's fastest row runs), where the CPU has AVX-512 (AVX512-BF16 for
bfloat16) and a C++ compiler (g++, or $CXX) builds matmul.cc (with attention.cc,
one library), once, into a cache directory ($HFLAX_CACHE_DIR, else $XDG_CACHE_HOME/hflax,
else ~/.cache/hflax); where it is not, `problem` says why and the reason is
logged once.
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

from hflax import platforms
from hflax.platforms.cpu import settings

ENV = settings.MATMUL
# The dtypes decoding copies are packed in where the kernel can serve them.
PACKED = ("bfloat16", "float32")
# Built into one library: this kernel and attention.py's.
SOURCES = tuple(pathlib.Path(__file__).with_name(name) for name in ("matmul.cc", "attention.cc"))
LANES = 16  # outputs per packed block: a 512-bit register of float32
# By (operands' dtype, result's dtype): bfloat16 products may be rounded to bfloat16 in the
# kernel (a separate convert of each decode-step product is a pass over it of its own).
_TARGETS = {("bfloat16", "float32"): ("hflax_cpu_matmul_bf16", "HflaxCpuMatmulBf16"),
            ("bfloat16", "bfloat16"): ("hflax_cpu_matmul_bf16_rounded",
                                       "HflaxCpuMatmulBf16Rounded"),
            ("float32", "float32"): ("hflax_cpu_matmul_f32", "HflaxCpuMatmulF32")}
_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fno-exceptions", "-w")


def problem(dtype) -> str | None:
  """Why the kernel cannot serve `dtype` in this process, or None where it can."""
  dtype = jnp.dtype(dtype)
  off = settings.turned_off(ENV)
  if off:
    return off
  if dtype not in (jnp.bfloat16, jnp.float32):
    return f"no kernel for {dtype.name}"
  return backend_problem() or machine_problem(
      {"avx512f", "avx512bw"} | ({"avx512_bf16"} if dtype == jnp.bfloat16 else set()))


def backend_problem() -> str | None:
  """Why this process's default backend cannot run the CPU kernels, or None."""
  if not platforms.on_cpu():
    return f"the default backend is {platforms.backend()}, not cpu"
  return None


def machine_problem(flags) -> str | None:
  """Why the kernels' library cannot run here with these CPU flags, or None."""
  missing = set(flags) - _cpu_flags()
  if missing:
    return f"this CPU lacks {', '.join(sorted(missing))}"
  library = _library()
  return library if isinstance(library, str) else None


def usable(dtype) -> bool:
  """Whether decoding copies in `dtype` are packed for this kernel (logs why not, once)."""
  reason = problem(dtype)
  if reason is not None:
    note_once(f"decoding with XLA's matmuls in {jnp.dtype(dtype).name}: {reason}")
  return reason is None


def packable(shape, dtype=jnp.bfloat16) -> bool:
  """Whether a kernel stored [..., K] with this shape can be packed."""
  return (len(shape) >= 2 and int(np.prod(shape[:-1])) % LANES == 0
          and shape[-1] % _pairs(dtype) == 0)


def _pairs(dtype) -> int:
  return 2 if jnp.dtype(dtype) == jnp.bfloat16 else 1


def pack(w):
  """A kernel stored [..., K] ([out, in]) in the packed layout, same shape and dtype:
  each 16 rows [K / 2, 16, 2] in bfloat16, [K, 16] in float32."""
  K, pairs = w.shape[-1], _pairs(w.dtype)
  blocks = w.reshape(-1, LANES, K // pairs, pairs)  # [N / 16, 16, K / pairs, pairs]
  return blocks.transpose(0, 2, 1, 3).reshape(w.shape)


def unpack(w):
  """`pack`'s inverse."""
  K, pairs = w.shape[-1], _pairs(w.dtype)
  blocks = w.reshape(-1, K // pairs, LANES, pairs)
  return blocks.transpose(0, 2, 1, 3).reshape(w.shape)


def matmul(x_RxK, packed_NxK, out_dtype=jnp.float32):
  """[R, N] in out_dtype: x_RxK (cast to the kernel's dtype) times a packed kernel's
  [N, K] transposed, accumulated in float32; a bfloat16 kernel's result may be rounded to
  bfloat16 once (out_dtype), a float32 kernel's is float32."""
  dtype = jnp.dtype(packed_NxK.dtype)
  reason = problem(dtype)
  if reason is not None:
    raise RuntimeError(f"hflax cpu matmul: {reason}")
  R, N = x_RxK.shape[0], packed_NxK.shape[0]
  out_dtype = jnp.dtype(out_dtype)
  if (dtype.name, out_dtype.name) not in _TARGETS:
    raise ValueError(f"hflax cpu matmul: no {dtype.name} kernel with a {out_dtype.name} result")
  call = jax.ffi.ffi_call(_registered(dtype.name, out_dtype.name),
                          jax.ShapeDtypeStruct((R, N), out_dtype), vmap_method="sequential")
  return call(x_RxK.astype(dtype), packed_NxK)


def serves(devices: int) -> bool:
  """Whether weights held on this many devices (a replica on each) decode faster through
  the kernel: where they keep every core busy, one device per core. The kernel runs on
  one thread; XLA's library spreads a lone device's matmuls over the cores. Threads of
  our own did not get there: inside the decode loop XLA hands a custom call no thread
  pool, and a helper thread competed with XLA's spinning ones (slower than the library)."""
  return devices >= cores()


def cores() -> int:
  """The cores this process may run on."""
  if hasattr(os, "sched_getaffinity"):
    return len(os.sched_getaffinity(0))
  return os.cpu_count() or 1


@functools.cache
def _registered(dtype: str, out_dtype: str) -> str:
  return register(*_TARGETS[dtype, out_dtype])


def register(name: str, symbol: str) -> str:
  """Registers the library's handler `symbol` as the CPU custom call `name` (once)."""
  _register(name, symbol)
  return name


@functools.cache
def _register(name, symbol):
  jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(getattr(_library(), symbol)),
                              platform="cpu")


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
    return "no C++ compiler found (g++, or $CXX) to build hflax's CPU kernels"
  include = jax.ffi.include_dir()
  version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout
  key = hashlib.sha256("\0".join([*(f.read_text() for f in SOURCES), version, include,
                                  jax.__version__, *_FLAGS]).encode()).hexdigest()[:16]
  path = _cache_dir() / f"cpu_matmul-{key}.so"
  try:
    if not path.exists():
      path.parent.mkdir(parents=True, exist_ok=True)
      # Written aside and renamed: processes building at once (test workers) never load a
      # half-written library.
      fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
      os.close(fd)
      built = subprocess.run([compiler, *_FLAGS, f"-I{include}", *map(str, SOURCES), "-o", tmp],
                             capture_output=True, text=True)
      if built.returncode:
        os.unlink(tmp)
        lines = built.stderr.strip().splitlines() or ["no output"]
        first = next((line for line in lines if "error" in line), lines[0])
        return f"{compiler} could not build hflax's CPU kernels: {first}"
      os.replace(tmp, path)
    return ctypes.cdll.LoadLibrary(str(path))
  except OSError as e:  # an unwritable cache directory, a library that does not load
    return f"hflax's CPU kernels could not be built or loaded at {path}: {e}"


def _cache_dir() -> pathlib.Path:
  if os.environ.get("HFLAX_CACHE_DIR"):
    return pathlib.Path(os.environ["HFLAX_CACHE_DIR"])
  base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
  return pathlib.Path(base) / "hflax"


@functools.cache
def note_once(message: str):
  logging.getLogger(__name__).info(message)
