"""The hybrid engine: the actor's parameters switch from the training layout to the
generation layout (tensor parallel of width t_g, replicated over the rest) and back.

The generation mesh (generate_mesh) follows the paper's strided grouping inside each data
replica: the block of the model-parallel dimension a device trains on lies inside the
block it generates with, so only the rest of its generation shard has to arrive from
other devices.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from hflax import platforms
from hflax.platforms.decoding import decoding
from hflax.platforms.leaf_copy import Recipe, build_leaves, copy_leaves
from hflax.sharding.layouts import GENERATE_AXES, GENERATE_RULES, state_shardings


def generate_mesh(train_mesh: Mesh, tensor: int, strided: bool = True) -> Mesh:
  """A generation mesh over the training mesh's devices.

  strided (the paper's grouping): the model splits m = fsdp * tensor ways for training,
  and a device's training shard is its position q inside its data replica. With t_g <= m
  it gets tensor rank q // (m / t_g): its generation shard contains its training shard,
  and a tensor group is made of devices m / t_g apart. With t_g > m, the data replicas of
  shard q take the t_g / m generation shards inside it, and nothing moves.
  strided=False is the naive order (tensor groups of consecutive devices). With one data
  replica, or t_g = 1, the flat device order is the training mesh's.
  """
  devices = train_mesh.devices.reshape(-1)  # training order: data, fsdp, tensor
  if devices.size % tensor:
    raise ValueError(f"generate tensor width {tensor} does not divide the pool's "
                     f"{devices.size} devices")
  groups = devices.size // tensor
  if not strided:
    return Mesh(devices.reshape(groups, tensor), GENERATE_AXES)
  replicas = dict(train_mesh.shape).get("data", 1)
  m = devices.size // replicas
  by_replica = devices.reshape(replicas, m)  # [data, q]
  if m % tensor == 0:  # [data, rank, q within the rank's block] -> rank first
    grid = by_replica.reshape(replicas, tensor, m // tensor).transpose(1, 0, 2)
  elif tensor % m == 0:  # rank = q * (t_g / m) + s, s counting replicas of shard q
    split = tensor // m
    grid = by_replica.reshape(replicas // split, split, m).transpose(2, 1, 0)
  else:
    grid = devices
  return Mesh(grid.reshape(tensor, groups), ("tensor", "data"))


def _region(index, shape) -> tuple[tuple[int, int], ...]:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def assemble(x: jax.Array, sharding) -> jax.Array:
  """`x` laid out as `sharding` without a host round trip of the whole array: each
  destination shard is built from the pieces of the source shards that cover it.

  On accelerators (`_assemble_by_copies`) a device keeps its own piece and receives the
  rest as device-to-device copies; there is no collective program, because XLA's CPU
  collectives rendezvous all participants, which many transfers in flight can starve on a
  small thread pool. On the CPU backend every device's memory is the same host memory,
  so `_assemble_in_host_memory` writes each distinct destination shard once and lets its
  replicas share that buffer.

  A pool spanning several processes (the Ray backend) cannot build shards from pieces it
  does not address; there the switch is one jax.device_put, which for two shardings over
  the same devices (in the training order, or reordered by the strided grouping when the
  pool has data replicas) compiles to a resharding program whose collectives cross the
  processes.

  Where a device already holds exactly its new shard, both paths reuse that buffer: the
  result must be dropped before `x` is donated (the actor frees its generation copy
  before any update)."""
  if not x.is_fully_addressable:
    return jax.device_put(x, sharding)
  on_cpu = platforms.all_cpu(sharding.device_set | x.sharding.device_set)
  if on_cpu and not jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):  # numpy-readable
    return _assemble_in_host_memory(x, sharding)
  return _assemble_by_copies(x, sharding)


def _overlap_slices(want, have):
  """The part of region `want` inside region `have`, as slices into each, or None."""
  part = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(want, have))
  if any(lo >= hi for lo, hi in part):
    return None
  into = lambda region: tuple(slice(lo - r0, hi - r0) for (lo, hi), (r0, _) in zip(part, region))
  return part, into(want), into(have)


def _assemble_by_copies(x: jax.Array, sharding) -> jax.Array:
  shape = x.shape
  sources = [(s.device, _region(s.index, shape), s.data) for s in x.addressable_shards]
  built = []
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    want, pieces = _region(index, shape), {}
    for src_device, have, data in sorted(sources, key=lambda t: t[0] != device):
      overlap = _overlap_slices(want, have)
      if overlap is None or overlap[0] in pieces:
        continue  # disjoint, or a replica of a piece already taken (local ones first)
      part, _, local = overlap
      whole = all(sl.stop - sl.start == n for sl, n in zip(local, data.shape))
      piece = data if whole else data[local]
      pieces[part] = piece if src_device == device else jax.device_put(piece, device)
    built.append(_join(pieces))
  return jax.make_array_from_single_device_arrays(shape, sharding, built)


def _assemble_in_host_memory(x: jax.Array, sharding) -> jax.Array:
  """CPU devices share host memory: each distinct destination shard is written once, from
  zero-copy views of the source shards, into a fresh 64-byte-aligned host buffer that the
  CPU client adopts without copying, so the replicas of a shard (the generate layout's
  data axis) are one buffer. A shard a device already holds is kept as it is (as on
  accelerators); every other buffer is private to the new array."""
  shape = x.shape
  sources, held = {}, {}
  for shard in x.addressable_shards:
    region = _region(shard.index, shape)
    sources.setdefault(region, shard.data)
    held[shard.device, region] = shard.data
  blocks, built = {}, []
  for device, index in sharding.addressable_devices_indices_map(shape).items():
    want = _region(index, shape)
    if (device, want) in held:  # this device already holds exactly this shard
      built.append(held[device, want])
      continue
    if want not in blocks:
      block = _aligned_empty([hi - lo for lo, hi in want], x.dtype)
      for have, data in sources.items():
        overlap = _overlap_slices(want, have)
        if overlap is not None:
          block[overlap[1]] = np.asarray(data)[overlap[2]]
      blocks[want] = block
    built.append(jax.device_put(blocks[want], device))
  return jax.make_array_from_single_device_arrays(shape, sharding, built)


def _aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
  """An uninitialised array whose data starts on an `align`-byte boundary, the alignment
  XLA:CPU needs to use a host buffer in place instead of copying it."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
  raw = np.empty(nbytes + align, np.uint8)
  start = -raw.ctypes.data % align
  return raw[start:start + nbytes].view(dtype).reshape(shape)


def _join(pieces: dict, dim: int = 0):
  """Concatenates pieces keyed by their (start, stop) per dimension into one block."""
  if len(pieces) == 1:
    return next(iter(pieces.values()))
  starts = sorted({key[dim][0] for key in pieces})
  if len(starts) == 1:
    return _join(pieces, dim + 1)
  return jnp.concatenate([_join({k: v for k, v in pieces.items() if k[dim][0] == s}, dim + 1)
                          for s in starts], axis=dim)


def _elements(region) -> int:
  return math.prod(hi - lo for lo, hi in region)


def bytes_to_move(abstract_state, src_shardings, dst_shardings, dst_dtype=None) -> dict:
  """Bytes each device must receive to build its destination shards, counting as local
  whatever part of a destination shard the device already holds in its source shard."""
  per_device: dict = {}
  leaves = zip(jax.tree.leaves(abstract_state), jax.tree.leaves(src_shardings),
               jax.tree.leaves(dst_shardings))
  for leaf, src, dst in leaves:
    shape = leaf.shape
    itemsize = jnp.dtype(dst_dtype or leaf.dtype).itemsize
    src_index = src.devices_indices_map(shape)
    for device, dst_idx in dst.devices_indices_map(shape).items():
      want = _region(dst_idx, shape)
      overlap = (_overlap_slices(want, _region(src_index[device], shape))
                 if device in src_index else None)
      local = _elements(overlap[0]) if overlap else 0
      per_device[device] = per_device.get(device, 0) + (_elements(want) - local) * itemsize
  return {"total": sum(per_device.values()), "max_per_device": max(per_device.values()),
          "per_device": per_device}


def shard_bytes(state) -> dict:
  """Bytes of `state` held by each device."""
  held: dict = {}
  for leaf in jax.tree.leaves(state):
    for shard in leaf.addressable_shards:
      held[shard.device] = held.get(shard.device, 0) + shard.data.nbytes
  return held


@dataclasses.dataclass(frozen=True)
class _Layout:
  """One generation copy the engine writes: the graph it runs on, its shardings and
  treedef, the training-layout shardings of its leaves, the bytes it moves, and the
  program writing (from the training state's leaves) those of its leaves that are not
  passed as they are, in the training layout, or None; `recipes` make each of its leaves."""
  graphdef: Any
  shardings: Any
  treedef: Any
  sources: list
  moved: dict
  program: Callable | None
  recipes: tuple


class HybridEngine:
  """Builds the generation copy of the actor's parameters and measures the switch.

  Given the model's `graphdef`, where the platform decodes from a copy of its own
  (hflax.platforms.decoding: on this process's CPU devices, dense kernels stored [out, in]
  in their compute dtype), the copy is the sampler's decoding copy, written by the same
  program as the cast: the actor then holds one generation copy, where the sampler would
  otherwise write a second one from it on every call. Each switch checks that the copy
  fits (the memory left then, the other roles' weights and caches included) and
  otherwise writes the plain copy.
  `graphdef`, `shardings` and `moved` describe the copy last written (before the first
  switch, the one preferred).
  """

  def __init__(self, train_mesh: Mesh, abstract_state, train_shardings, tensor: int = 1,
               dtype: str | None = None, strided: bool = True, graphdef=None,
               generate_on: Mesh | None = None):
    # generate_on: devices apart from the training mesh's (a split placement's rollout
    # pool): each switch is then a weight sync, every byte copied to them.
    self.split = generate_on is not None
    self.mesh = generate_mesh(generate_on if self.split else train_mesh, tensor, strided)
    self.dtype = dtype
    self._copies = decoding([])  # the platform's decoding copy, once a plan is found
    cast = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, dtype or x.dtype),
                        abstract_state)
    sources = jax.tree.leaves(train_shardings)
    self._plain = self._layout(graphdef, cast, sources, [
        Recipe("keep", (i,), None, x.shape) for i, x in enumerate(jax.tree.leaves(cast))])
    plan = self._decoding_plan(graphdef, cast, sources)
    self._decoding = plan and self._layout(plan.graphdef, plan.abstract, sources, plan.recipes)
    self._decoding_bytes = plan and _copy_bytes(plan, self._decoding)
    self._use(self._decoding or self._plain)

  def _layout(self, graphdef, abstract, train_sources, recipes) -> _Layout:
    """The copy whose leaves `recipes` make from the training state's (leaf_copy's
    Recipe), every leaf cast to self.dtype where set; a leaf neither cast nor made from
    others passes as it is."""
    recipes = [r._replace(dtype=r.dtype or self.dtype) for r in recipes]
    sources = [_source(r, train_sources) for r in recipes]
    picked = tuple(i for i, r in enumerate(recipes) if not r.identity)
    # Written in the training layout, so fewer bytes cross devices.
    program = picked and jax.jit(functools.partial(build_leaves, tuple(recipes[i] for i in picked)),
                                 out_shardings=[sources[i] for i in picked])
    shardings = state_shardings(abstract, self.mesh, GENERATE_RULES)
    return _Layout(graphdef, shardings, jax.tree.structure(abstract), sources,
                   bytes_to_move(abstract, sources, shardings), program or None,
                   tuple(recipes))

  def _decoding_plan(self, graphdef, abstract, sources):
    devices = list(self.mesh.devices.flat) + [d for s in sources for d in s.device_set]
    if graphdef is None or not all(isinstance(s, NamedSharding) for s in sources):
      return None
    # The devices each holding the whole weights (no tensor axis), else None.
    replicas = self.mesh.devices.size if self.mesh.shape.get("tensor", 1) == 1 else None
    self._copies = decoding(devices)
    return self._copies.leafwise_plan(graphdef, abstract, devices, replicas)

  def _use(self, layout: _Layout):
    self.graphdef, self.shardings, self.moved = layout.graphdef, layout.shardings, layout.moved

  def to_generate(self, train_state):
    """The generation-layout copy, built shard by shard (see `assemble`); self.graphdef
    is then the graph it runs on."""
    start = time.perf_counter()
    decoding = (self._decoding is not None
                and self._copies.fits_in_memory(self._decoding_bytes))
    layout = self._decoding if decoding else self._plain
    self._use(layout)
    leaves = jax.tree.leaves(train_state)
    copy = copy_leaves(layout.recipes, leaves, layout.program)
    gen_state = jax.tree.unflatten(layout.treedef, [
        assemble(x, s) for x, s in zip(copy, jax.tree.leaves(layout.shardings), strict=True)])
    jax.block_until_ready(gen_state)
    metrics = {"timing_s/reshard": time.perf_counter() - start,
               "reshard/bytes_moved": float(layout.moved["total"]),
               "reshard/max_bytes_per_device": float(layout.moved["max_per_device"]),
               "reshard/decoding_layout": float(decoding)}
    if self.split:
      metrics["timing_s/weight_sync"] = metrics["timing_s/reshard"]
      metrics["rollout/weight_sync_bytes"] = metrics["reshard/bytes_moved"]
    return gen_state, metrics


def _copy_bytes(plan, layout: _Layout) -> int:
  """Bytes the decoding copy's kernels take at the switch's peak: each training device's
  shard of them, beside every distinct generation shard `assemble` writes anew (a device
  already holding exactly its shard keeps that buffer; on CPUs replicas share one)."""
  total = 0
  shardings, abstract = jax.tree.leaves(layout.shardings), jax.tree.leaves(plan.abstract)
  for i, recipe in enumerate(plan.recipes):
    if recipe.kind == "keep":
      continue
    shape, item, src = abstract[i].shape, jnp.dtype(recipe.dtype).itemsize, layout.sources[i]
    held = src.devices_indices_map(shape)
    total += len(held) * math.prod(src.shard_shape(shape)) * item
    fresh = {_region(index, shape) for device, index in
             shardings[i].devices_indices_map(shape).items()
             if device not in held or _region(held[device], shape) != _region(index, shape)}
    total += sum(_elements(region) for region in fresh) * item
  return total


def _source(recipe: Recipe, train_sources) -> NamedSharding:
  """Where the copy program writes a leaf: its training sharding, transposed for a kernel
  stored [out, in]."""
  first = train_sources[recipe.sources[0]]
  if recipe.kind == "keep":
    return first
  if recipe.kind == "transpose":
    return _transposed(first)
  raise ValueError(f"hybrid engine: no training layout for a '{recipe.kind}' leaf")


def _transposed(sharding: NamedSharding) -> NamedSharding:
  """A [in, out] leaf's sharding, for the same leaf stored [out, in]."""
  spec = tuple(sharding.spec) + (None,) * (2 - len(sharding.spec))
  return NamedSharding(sharding.mesh, PartitionSpec(*reversed(spec)))
