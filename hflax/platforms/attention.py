"""The one place that picks an attention implementation for the backend (as MaxText picks
its attention kernels in one place): models/attention.py computes whichever this names.
"""
from __future__ import annotations

from hflax import platforms

# What `choose` may name: the model's own implementations (models/attention.py) and the
# platforms' kernels.
CHOICES = ("decode_kernel", "one_query", "reference", "blockwise", "cudnn", "splash")


def choose(impl: str, *, queries: int, short: bool, q_dtype, head_dim: int,
           teacher_forced: bool, packed: bool, prefix: bool, decode_kernel: bool = False,
           kv_dtypes: tuple = ()) -> str:
  """The implementation that computes an attention call configured as `impl`.

  "reference" and "blockwise" are taken as named. "cudnn" and "splash" force their kernel
  where it takes the call (gpu/attention.fits, tpu/attention.fits) and leave the other
  calls (decoding, ...) to "auto". "auto": one query a row (decoding) takes one_query on
  XLA:CPU and the dense reference elsewhere (already linear in the keys); `short` contexts
  take the reference too; then cuDNN on GPUs and splash on TPUs where they fit; blockwise
  everywhere else.
  queries: T; short: few enough keys for the dense reference; packed: segment ids;
  prefix: prefix ids (hflax.controller.packing). decode_kernel: a decoding copy asked for
  the CPU decode-attention kernel (cpu/attention.py), taken for one query a row under "auto"
  where it reads caches of `kv_dtypes` (keys', values') and nothing turned it off since."""
  if impl in ("reference", "blockwise"):
    return impl
  if decode_kernel and impl == "auto" and queries == 1:
    import jax
    from hflax.platforms.cpu import attention as cpu
    if cpu.serves(q_dtype, *(jax.ShapeDtypeStruct((), d) for d in kv_dtypes)):
      return "decode_kernel"
  from hflax.platforms.gpu import attention as gpu
  from hflax.platforms.tpu import attention as tpu
  cudnn_fits = lambda: gpu.fits(q_dtype, head_dim, teacher_forced=teacher_forced,  # noqa: E731
                                packed=packed)
  splash_fits = lambda: tpu.fits(queries, teacher_forced=teacher_forced, prefix=prefix)  # noqa: E731
  if impl == "cudnn" and cudnn_fits():
    return "cudnn"
  if impl == "splash" and splash_fits():
    return "splash"
  backend = platforms.backend()
  if queries == 1 and backend == "cpu":
    return "one_query"
  if queries == 1 or short:
    return "reference"
  if backend == "gpu" and cudnn_fits():
    return "cudnn"
  if backend == "tpu" and splash_fits():
    return "splash"
  return "blockwise"
