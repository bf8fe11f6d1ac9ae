"""A model's decoding copy: its dense kernels stored [out, in] in their compute dtype.

A decode step multiplies a few rows (one token per sequence) by every kernel, so it
streams all weights from memory each step. XLA:CPU's matmul library reads a kernel laid
out [out, in] (each output's weights contiguous) faster than the training layout
[in, out]: SmolLM2-135M's layer matmuls, bfloat16 on a 2-core Xeon, took 14.5 against
20.9 ms a step for 16 rows and 23.7 against 29.7 for 64 (float32: 33.8 against 39.8 for
16). A transpose written inside the decode program does not get there: XLA folds it back
into the dot and keeps the [in, out] layout. So a program of its own writes the copy, once
per generate call (about 0.15 s for SmolLM2's fp32 kernels, cast on the way), and the
sampler decodes from it; in an RL job the hybrid engine writes it as the actor's
generation copy (hflax.sharding.hybrid_engine), and the sampler finds nothing left to
copy. GPUs and TPUs keep their measured path: the copy is CPU-only.
The copy lives beside the weights while the sampler runs, one per device holding a
replica; where it would take more than half of the memory this process can still use,
the weights are decoded as they are, with a warning logged once. So are weights that
span processes: every process must then decide alike, and a memory reading is local.
The copy is the sampler's own: a checkpoint or export of it would be transposed.
The last copy written is kept while the arrays it was made from live, and a call on those
same arrays reuses it (generating again from unchanged weights, as an evaluation loop
does, skipped a 0.15 s copy of SmolLM2's fp32 kernels per call); `forget_decoding_copy`
drops it sooner.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import weakref

import jax
import jax.numpy as jnp
from flax import nnx

from hflax.models.transformer import Dense


@dataclasses.dataclass(frozen=True)
class DecodingPlan:
  """How a state becomes its decoding copy: `graphdef` and `abstract` (shape structs) are
  the copy's; `dtypes` has, for each leaf of the state in jax.tree.leaves order, the
  dtype its kernel is stored in transposed, or None for a leaf kept as it is."""
  graphdef: nnx.GraphDef
  abstract: nnx.State
  dtypes: tuple

  def copy_bytes(self, leaves) -> int:
    """Bytes of the transposed kernels on this process's devices, a replica on each."""
    return sum(_local_elements(x) * jnp.dtype(d).itemsize
               for x, d in zip(leaves, self.dtypes) if d is not None)


def decoding_plan(graphdef, state) -> DecodingPlan | None:
  """The plan for `state` (arrays or shape structs), or None where no plain
  (adapter-free) kernel is left to transpose."""
  model = nnx.merge(graphdef, state)
  dtypes = {}
  for path, m in nnx.iter_modules(model):
    if isinstance(m, Dense) and not m.out_in and m.lora_a is None:
      kernel = m.kernel.get_value()
      # The compute dtype (what the matmul reads), never widened: a bfloat16 generation
      # copy computing in float32 stays bfloat16.
      dtype = min(m.dtype, kernel.dtype, key=lambda d: jnp.dtype(d).itemsize)
      dtypes[(*path, "kernel")] = jnp.dtype(dtype)
      m.kernel = m.kernel.replace(jax.ShapeDtypeStruct(kernel.shape[::-1], dtype),
                                  axes=tuple(reversed(m.kernel.axes)))
      m.out_in = True
  if not dtypes:
    return None
  copy_graphdef, abstract = nnx.split(model)
  paths = [tuple(getattr(k, "key", k) for k in path[:-1])  # the last: the Variable's value
           for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]
  leaf_dtypes = tuple(dtypes.get(p) for p in paths)
  matched = sum(d is not None for d in leaf_dtypes)
  if matched != len(dtypes):
    # A kernel flagged out_in but left as stored would decode wrong, silently if square.
    raise RuntimeError(f"decoding_plan: {len(dtypes)} kernels, but the state's leaf paths "
                       f"match {matched} of them")
  return DecodingPlan(copy_graphdef, abstract, leaf_dtypes)


def fits_in_memory(copy_bytes: int) -> bool:
  """Whether a copy of that size takes at most half of the memory left; logs once if not."""
  if copy_bytes <= available_memory() // 2:
    return True
  _warn_once(f"generate: decoding from the weights as stored: their [out, in] copy "
             f"({copy_bytes / 2**30:.1f} GiB) would take over half of the available memory")
  return False


def for_decoding(graphdef, state):
  """(graphdef, state) of the decoding copy, or the inputs themselves where it does not
  apply: not jax arrays of this process's CPU devices, no plain (adapter-free) kernels,
  already a decoding copy, or too little memory."""
  if not _local_cpu_arrays(state):
    return graphdef, state
  leaves, treedef = jax.tree.flatten(state)
  plan = _cached_plan(graphdef, treedef,
                      tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves))
  if plan is None:
    return graphdef, state
  kept = _last_copy.of(plan, leaves)
  if kept is not None:
    return kept
  _last_copy.forget()  # before the new copy is written: never two held at once
  if not fits_in_memory(plan.copy_bytes(leaves)):
    return graphdef, state
  sources = list(leaves)
  picked = [i for i, d in enumerate(plan.dtypes) if d is not None]
  kernels = _copy_leaves(tuple((True, plan.dtypes[i]) for i in picked),
                         [leaves[i] for i in picked])
  for i, kernel in zip(picked, kernels):
    leaves[i] = kernel
  copy = plan.graphdef, jax.tree.unflatten(jax.tree.structure(plan.abstract), leaves)
  _last_copy.keep(plan, sources, copy)
  return copy


class _LastCopy:
  """The last decoding copy written, with weak references to the arrays it was made
  from: jax arrays are immutable, so while those very objects live (and are not deleted,
  e.g. donated to an update) the copy still holds their values. Dropped as soon as any of
  them is collected, so it never outlives the weights it copies."""

  def __init__(self):
    self._lock = threading.Lock()
    self._entry = None  # (plan, weak references to the sources, copy, token)

  def of(self, plan, leaves):
    with self._lock:
      entry = self._entry
    if entry is None or entry[0] is not plan or len(entry[1]) != len(leaves):
      return None
    if any(ref() is not x for ref, x in zip(entry[1], leaves)):
      return None
    if any(x.is_deleted() for x in leaves):
      return None  # the copy program then fails on them, as it would have without this
    return entry[2]

  def keep(self, plan, sources, copy):
    token = object()  # not the entry itself: the references' callback would keep it alive

    def drop(_):  # a source collected: its copy goes with it
      with self._lock:
        if self._entry is not None and self._entry[3] is token:
          self._entry = None
    entry = (plan, tuple(weakref.ref(x, drop) for x in sources), copy, token)
    with self._lock:
      self._entry = entry

  def forget(self):
    with self._lock:
      self._entry = None


_last_copy = _LastCopy()


def forget_decoding_copy():
  """Frees the decoding copy kept for the last weights generated from (see the module
  docstring); the next call on them writes it again."""
  _last_copy.forget()


@functools.lru_cache(maxsize=16)
def _cached_plan(graphdef, treedef, structs) -> DecodingPlan | None:
  """decoding_plan by the state's structure, once: merging the model and splitting its copy
  in every generate call cost Python time (SmolLM2: for_decoding 79-97 ms a call, 53-57
  with the plan cached), and a fresh copy graphdef cost the sampler's compiled-program
  lookup a deep comparison with the one it had compiled for."""
  return decoding_plan(graphdef, jax.tree.unflatten(treedef, structs))


def available_memory() -> int:
  """Bytes this process can still allocate: Linux's MemAvailable, or less where a
  container's memory limit (cgroup v2 or v1) leaves less; unbounded where unknown."""
  available = _read_int("/proc/meminfo", "MemAvailable:")
  free = [] if available is None else [available * 1024]
  for limit, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                       ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                        "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
    cap, used = _read_int(limit), _read_int(usage)
    if cap is not None and used is not None:
      free.append(max(cap - used, 0))
  return min(free, default=2**62)


def _read_int(path: str, key: str | None = None) -> int | None:
  """The integer in a /proc or /sys file (after `key` where given); None if absent or
  not a number ("max": no limit)."""
  try:
    with open(path) as f:
      for line in f:
        if key is None or line.startswith(key):
          return int(line.split()[1 if key else 0])
  except (OSError, ValueError, IndexError):
    pass
  return None


@functools.cache
def _warn_once(message: str):
  logging.getLogger(__name__).warning(message)


def _local_cpu_arrays(state) -> bool:
  leaves = jax.tree.leaves(state)
  return bool(leaves) and all(
      isinstance(x, jax.Array) and x.is_fully_addressable and
      all(d.platform == "cpu" for d in x.devices()) for x in leaves)


def _local_elements(x) -> int:
  """Elements of x held on this process's devices: a replica on each device is a copy."""
  return sum(shard.data.size for shard in x.addressable_shards)


def copy_leaves(ops, leaves):
  """Each leaf transposed or not, and cast: ops holds a (transpose, dtype) pair per leaf."""
  return [(x.T if transpose else x).astype(dtype) for x, (transpose, dtype) in zip(leaves, ops)]


_copy_leaves = jax.jit(copy_leaves, static_argnums=0)
