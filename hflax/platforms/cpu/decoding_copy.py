"""A model's decoding copy: its dense kernels stored [out, in] in their compute dtype.

A decode step multiplies a few rows (one token per sequence) by every kernel, so it
streams all weights from memory each step. XLA:CPU's matmul library reads a kernel laid
out [out, in] (each output's weights contiguous) faster than the training layout
[in, out], in bfloat16 and float32 alike (bench/generate.py measures whole calls). A
transpose written inside the decode program does not get there: XLA folds it back into
the dot and keeps the [in, out] layout. So a program of its own writes the copy (cast on
the way), with each layer's gate and up stacked and its q, k and v grouped into one
kernel (decoding_plan), and the sampler decodes from it; in an RL job the hybrid engine
writes it as the actor's generation copy (hflax.sharding.hybrid_engine; its kernels kept
apart, stacked in each decode step), and the sampler finds nothing left to copy. GPUs and
TPUs keep XLA's own path (hflax.platforms.decoding): the copy is CPU-only.
The copy lives beside the weights while the sampler runs, one per device holding a
replica; where it would take more than half of the memory this process can still use,
the weights are decoded as they are, with a warning logged once. So are weights that
span processes: every process must then decide alike, and a memory reading is local.
The copy is the sampler's own: a checkpoint or export of it would be transposed.
The last copy written for a set of devices is kept while the arrays it was made from
live, and a call on those same arrays reuses it: generating again from unchanged weights
(an evaluation loop, a benchmark's repetitions) skips writing the copy each call.
`forget_decoding_copy` drops it sooner.
"""
from __future__ import annotations

import dataclasses
import functools
import logging
import weakref

import jax
import jax.numpy as jnp
from flax import nnx

from hflax.platforms import all_cpu
from hflax.platforms.cpu import attention as cpu_attention
from hflax.platforms.cpu import matmul as cpu_matmul
from hflax.platforms.cpu.process import available_memory
from hflax.models.transformer import MLP, Attention, Dense, DecoderLM
from hflax.platforms.cpu.copy_modules import CopyAttention, CopyDense, CopyLM, CopyMLP
# The recipes' making is the platforms' common code; named here too for this copy's tests.
from hflax.platforms.leaf_copy import Recipe, build_leaves, copy_leaves  # noqa: F401


@dataclasses.dataclass(frozen=True)
class DecodingPlan:
  """How a state becomes its decoding copy: `graphdef` and `abstract` (shape structs) are
  the copy's; `recipes` has one Recipe per leaf of the copy (jax.tree.leaves order of
  `abstract`)."""
  graphdef: nnx.GraphDef
  abstract: nnx.State
  recipes: tuple

  def copy_bytes(self, leaves) -> int:
    """Bytes of the kernels it writes on this process's devices, a replica on each."""
    return sum(_local_elements(leaves[i]) * jnp.dtype(r.dtype).itemsize
               for r in self.recipes if r.kind != "keep" or r.packed for i in r.sources)


def decoding_plan(graphdef, state, fuse: bool = True, pack: tuple = (), attend: tuple = ()
                  ) -> DecodingPlan | None:
  """The plan for `state` (arrays or shape structs), or None where no plain
  (adapter-free) kernel is left to transpose; fuse=False keeps every kernel a leaf of its
  own (the hybrid engine moves leaves one to one), stacked in each decode step instead.
  pack: the names of the dtypes whose kernels (those computing in that dtype, from a
  copy in it) go into cpu_matmul's packed layout, a tied head as a packed table of its
  own (the caller's choice, of the dtypes cpu_matmul can serve: only for
  weights whole on each device, as cpu_matmul's custom call cannot be partitioned).
  attend: the names of the dtypes whose decode steps attend through cpu_attention's
  kernel (where it takes the model's head_dim; the caller's choice, on pack's terms).

  Why stacked and concatenated kernels: a decode step multiplies one token per row by each
  kernel, and its small products are bound by reading kernels and by per-call overhead, so
  q, k and v are one matmul and so are gate and up (on CPU the pair runs faster than two
  products, the more so the fewer the rows). Written into the copy, the stack is made
  once; made inside the generate program, it was rewritten on every call."""
  if pack and not fuse:
    # Kernels kept apart are stacked or grouped in each decode step (MLP, Attention),
    # which a packed layout does not survive.
    raise ValueError("decoding_plan: pack needs fuse=True")
  model = nnx.merge(graphdef, state)
  _become_copies(model)
  paths = {p: i for i, p in enumerate(_leaf_paths(state))}
  made = {}  # the copy's leaf path -> Recipe
  for path, m in list(nnx.iter_modules(model)) if fuse else ():
    if isinstance(m, MLP) and _plain(m.gate, m.up) and m.gate.bias is None:
      _fuse(m, path, ("gate", "up"), "pair", "stack", ("mlp", None, "embed"), paths, made,
            pack)
    elif isinstance(m, Attention) and _plain(m.q, m.k, m.v):
      _fuse(m, path, ("q", "k", "v"), "qkv", "groups", ("kv_heads", None, "embed"), paths,
            made, pack)
  for path, m in nnx.iter_modules(model):
    if isinstance(m, Attention):
      m.cpu_attention = (jnp.dtype(m.cfg.dtype).name in attend
                         and cpu_attention.fits(m.cfg.head_dim))
    if isinstance(m, Dense) and _plain(m):
      kernel = m.kernel.get_value()
      dtype = _compute_dtype(m)
      m.__class__ = CopyDense
      # o's and down's products feed the residual's addition (CopyDense.kernel_left).
      m.become_copy(packed=_packs(m, kernel.shape[::-1], pack),
                    kernel_left=path[-1] in ("o", "down"))
      made[(*path, "kernel")] = Recipe("transpose", (paths[(*path, "kernel")],), dtype,
                                       kernel.shape[::-1], m.packed)
      m.kernel = m.kernel.replace(jax.ShapeDtypeStruct(kernel.shape[::-1], dtype),
                                  axes=tuple(reversed(m.kernel.axes)))
  if (pack and isinstance(model, DecoderLM) and model.head == "lm" and model.lm_head is None
      and model.packed_head is None):  # a decoding copy already has its packed table
    _pack_tied_head(model, paths, made, pack)
  if not made:
    return None
  copy_graphdef, abstract = nnx.split(model)
  recipes = []
  for path, leaf in zip(_leaf_paths(abstract), jax.tree.leaves(abstract)):
    recipe = made.pop(path, None) or Recipe("keep", (paths[path],), None, leaf.shape)
    recipes.append(recipe)
  if made:
    # A leaf flagged as the copy's but not found in it would decode from the wrong array.
    raise RuntimeError(f"decoding_plan: {sorted(made)} not among the copy's leaves")
  return DecodingPlan(copy_graphdef, abstract, tuple(recipes))


def leafwise_plan(graphdef, abstract, devices, replicas: int | None) -> DecodingPlan | None:
  """decoding_plan for a copy written leaf by leaf from sharded training weights (the
  hybrid engine's transfer moves leaves one to one, so kernels stay apart: fuse=False),
  or None where `devices` (the generation mesh's and the sources') are not all this
  process's CPU devices: accelerators keep XLA's own path, and processes would
  decide apart. replicas: how many devices each hold the whole weights (None where they
  are split); decode steps then attend through the attention kernel on for_decoding's
  terms (one device per core)."""
  if not (all_cpu(devices) and all(d.process_index == jax.process_index() for d in devices)):
    return None
  whole = replicas is not None and cpu_matmul.serves(replicas)
  return decoding_plan(graphdef, abstract, fuse=False, attend=attending_dtypes() if whole else ())


_COPIES = ((Attention, CopyAttention), (MLP, CopyMLP), (DecoderLM, CopyLM))


def _become_copies(model):
  """Turns the model's Attention, MLP and DecoderLM modules into the copy's
  (copy_modules), each with nothing fused or packed yet; a copy's stay as they are."""
  for _, m in nnx.iter_modules(model):
    for base, copy in _COPIES:
      if type(m) is base:
        m.__class__ = copy
        m.become_copy()


def _plain(*denses) -> bool:
  """Dense modules of the training layout without an adapter (those stay as they are)."""
  return all(isinstance(d, Dense) and not isinstance(d, CopyDense) and d.lora_a is None
             for d in denses)


def _packs(dense, shape, pack) -> bool:
  """Whether cpu_matmul serves this Dense's copy [out, in] of `shape`: it computes in the
  copy's own dtype, one of `pack` (a float32 computation from a bfloat16 copy keeps
  XLA's dot, which widens x to float32, not the kernel's rounding of x to bfloat16)."""
  dtype = _compute_dtype(dense)
  return (jnp.dtype(dense.dtype) == dtype and dtype.name in pack
          and cpu_matmul.packable(shape, dtype))


def _pack_tied_head(model, paths, made, pack):
  """A packed copy of a tied table for step_logits, in the dtype step_logits computes in
  (the hidden states', the model's compute dtype), where `pack` has it."""
  dtype = jnp.dtype(model.cfg.dtype)
  shape = model.embed.get_value().shape
  if not (dtype.name in pack and cpu_matmul.packable(shape, dtype)):
    return
  model.packed_head = nnx.Param(jax.ShapeDtypeStruct(shape, dtype), axes=("vocab", "embed"))
  made[("packed_head",)] = Recipe("keep", (paths[("embed",)],), dtype, shape, True)


def _compute_dtype(dense):
  """What the matmul reads, never widened: a bfloat16 generation copy computing in
  float32 stays bfloat16."""
  return jnp.dtype(min(dense.dtype, dense.kernel.get_value().dtype,
                       key=lambda d: jnp.dtype(d).itemsize))


def _fuse(module, path, names, attr, kind, axes, paths, made, pack):
  """Replaces module's Dense `names` by one Param `attr` (kernels by `kind`; their biases,
  where present, as `attr`_bias grouped alike) and records the recipes; the kernel packed
  (module.packed) where `pack` and _packs allow."""
  denses = [getattr(module, n) for n in names]
  dtype = _compute_dtype(denses[0])
  kernels = [d.kernel.get_value() for d in denses]
  D = kernels[0].shape[0]
  if kind == "stack":
    shape = (kernels[0].shape[1], len(names), D)
  else:
    groups = module.cfg.num_kv_heads
    shape = (groups, sum(k.shape[1] for k in kernels) // groups, D)
  setattr(module, attr, nnx.Param(jax.ShapeDtypeStruct(shape, dtype), axes=axes))
  module.packed = _packs(denses[0], shape, pack)
  made[(*path, attr)] = Recipe(kind, tuple(paths[(*path, n, "kernel")] for n in names),
                               dtype, shape, module.packed)
  if denses[0].bias is not None:
    bias = denses[0].bias.get_value()
    setattr(module, f"{attr}_bias",
            nnx.Param(jax.ShapeDtypeStruct(shape[:2], bias.dtype), axes=axes[:2]))
    made[(*path, f"{attr}_bias")] = Recipe(
        kind, tuple(paths[(*path, n, "bias")] for n in names), None, shape[:2])
  for n in names:
    setattr(module, n, None)


def _leaf_paths(state) -> list[tuple]:
  """Each leaf's path of keys, less the last (the Variable's value)."""
  return [tuple(getattr(k, "key", k) for k in path[:-1])
          for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


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
  # cpu_matmul's custom call cannot be partitioned: packed only where every device holds
  # the whole weights (a replica on each), on one device per core.
  whole = (all(x.sharding.is_fully_replicated for x in leaves)
           and cpu_matmul.serves(len(_devices(leaves))))
  pack = tuple(d for d in cpu_matmul.PACKED if cpu_matmul.usable(d)) if whole else ()
  attend = attending_dtypes() if whole else ()
  plan = _cached_plan(graphdef, treedef,
                      tuple(jax.ShapeDtypeStruct(x.shape, x.dtype) for x in leaves), pack,
                      attend)
  if plan is None:
    return graphdef, state
  kept = _last_copy.of(plan, leaves)
  if kept is not None:
    return kept
  _last_copy.forget(leaves)  # before the new copy is written: never two held at once
  if not fits_in_memory(plan.copy_bytes(leaves)):
    return graphdef, state
  written = functools.partial(_build_leaves, tuple(r for r in plan.recipes if not r.identity))
  out = copy_leaves(plan.recipes, leaves, written)
  copy = plan.graphdef, jax.tree.unflatten(jax.tree.structure(plan.abstract), out)
  _last_copy.keep(plan, leaves, copy)
  return copy


def attending_dtypes() -> tuple:
  """The dtypes whose decode steps cpu_attention's kernel can serve here."""
  return tuple(d for d in cpu_attention.DTYPES if cpu_attention.usable(d))


class _LastCopy:
  """The last decoding copy written for each set of devices, with weak references to the
  arrays it was made from: jax arrays are immutable, so while those very objects live
  (and are not deleted, e.g. donated to an update) the copy still holds their values.
  Dropped as soon as any of them is collected, so it never outlives the weights it
  copies. No lock: the references' callback runs inside garbage collection, which any
  allocation under a lock can start (a deadlock), and a dict assignment is atomic already."""

  def __init__(self):
    self._entries = {}  # device set -> (plan, weak references to the sources, copy, token)

  def of(self, plan, leaves):
    entry = self._entries.get(_devices(leaves))
    if entry is None or entry[0] is not plan:  # the same plan: the same leaf structure
      return None
    if any(ref() is not x for ref, x in zip(entry[1], leaves)):
      return None
    if any(x.is_deleted() for x in leaves):
      return None  # the copy program then fails on them, as it would have without this
    return entry[2]

  def keep(self, plan, sources, copy):
    key, token = _devices(sources), object()  # a token: the entry would keep itself alive

    def drop(_):  # a source collected: its copy goes with it
      if self._entries.get(key, (None,) * 4)[3] is token:
        self._entries.pop(key, None)
    self._entries[key] = (plan, tuple(weakref.ref(x, drop) for x in sources), copy, token)

  def forget(self, leaves=None):
    """Drops the copy kept for the devices `leaves` live on, or every copy."""
    if leaves is None:
      self._entries.clear()
    else:
      self._entries.pop(_devices(leaves), None)


def _devices(leaves) -> frozenset:
  return frozenset(d for x in leaves for d in x.sharding.device_set)


_last_copy = _LastCopy()


def forget_decoding_copy():
  """Frees the decoding copies kept for the last weights generated from on each set of
  devices (see the module docstring); the next call on them writes its copy again."""
  _last_copy.forget()


@functools.lru_cache(maxsize=16)
def _cached_plan(graphdef, treedef, structs, pack, attend) -> DecodingPlan | None:
  """decoding_plan by the state's structure, once: merging the model and splitting its copy
  in every generate call cost Python time, and a fresh copy graphdef cost the sampler's
  compiled-program lookup a deep comparison with the one it had compiled for."""
  return decoding_plan(graphdef, jax.tree.unflatten(treedef, structs), pack=pack,
                       attend=attend)


@functools.cache
def _warn_once(message: str):
  logging.getLogger(__name__).warning(message)


def _local_cpu_arrays(state) -> bool:
  leaves = jax.tree.leaves(state)
  return bool(leaves) and all(
      isinstance(x, jax.Array) and x.is_fully_addressable and
      all_cpu(x.devices()) for x in leaves)


def _local_elements(x) -> int:
  """Elements of x held on this process's devices: a replica on each device is a copy."""
  return sum(shard.data.size for shard in x.addressable_shards)


_build_leaves = jax.jit(build_leaves, static_argnums=0)
