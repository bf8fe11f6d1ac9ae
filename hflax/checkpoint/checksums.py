"""Checksums of checkpointed values, written at save and verified at restore.

The host item also holds a checksum of every array's value and a digest of the
host item itself, so both are committed by the same rename as the data they describe. An
array's checksum is two 32-bit sums, over all its elements, of a hash of the element's bits
and its position in the array (row-major over the global shape); addition modulo 2**32 is
exact in any order, so it is computed on the devices that hold the array, in one reduction,
and does not depend on the sharding: a checkpoint saved on 8 devices verifies when it is
restored onto 1 or 4, and in a multi-process pool every process takes part in the same
global reduction (as it takes part in orbax's save and restore), so the whole array is
covered, not just one process's shards. `restore` recomputes the checksums of what it read
and raises CorruptCheckpoint, one line naming the step directory and the first bad array;
any orbax or TensorStore error while reading is summarised in one line the same way.
Checkpoints written before checksums existed restore unverified.
"""
from __future__ import annotations

import hashlib
import json

import jax
import jax.numpy as jnp
import numpy as np


def _fmix(h):
  """murmur3's 32-bit finaliser: a bijection that spreads every input bit."""
  h = h ^ (h >> 16)
  h = h * jnp.uint32(0x85EBCA6B)
  h = h ^ (h >> 13)
  h = h * jnp.uint32(0xC2B2AE35)
  return h ^ (h >> 16)


def _words(x):
  """The bits of every element as uint32 (8-byte elements: two words, a trailing axis)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    return _words(jax.random.key_data(x))
  dt = jnp.dtype(x.dtype)
  if dt == jnp.bool_:
    return x.astype(jnp.uint32)
  if jnp.issubdtype(dt, jnp.complexfloating):
    return _words(jnp.stack([x.real, x.imag], axis=-1))
  bits = jax.dtypes.itemsize_bits(dt) if hasattr(jax.dtypes, "itemsize_bits") else \
      dt.itemsize * 8
  if bits < 8:  # int4, float4: widened exactly first
    x = x.astype(jnp.float32 if jnp.issubdtype(dt, jnp.floating) else jnp.int32)
    dt = jnp.dtype(x.dtype)
  size = dt.itemsize
  if size == 4 or size == 8:
    return jax.lax.bitcast_convert_type(x, jnp.uint32)
  unsigned = {2: jnp.uint16, 1: jnp.uint8}[size]
  return jax.lax.bitcast_convert_type(x, unsigned).astype(jnp.uint32)


def _digest(x):
  """[2] uint32: sums over elements of hash(bits, flat position), in two independent lanes."""
  w = _words(x)
  pos, stride = jnp.zeros(w.shape, jnp.uint32), 1
  for axis in reversed(range(w.ndim)):  # no reshape: that could reshard a sharded array
    pos = pos + jax.lax.broadcasted_iota(jnp.uint32, w.shape, axis) * jnp.uint32(stride % 2**32)
    stride *= w.shape[axis]
  a = _fmix(w ^ _fmix(pos ^ jnp.uint32(0x9E3779B9)))
  b = _fmix((w + jnp.uint32(0x7F4A7C15)) ^ _fmix(pos + jnp.uint32(0x632BE5AB)))
  return jnp.stack([jnp.sum(a, dtype=jnp.uint32), jnp.sum(b, dtype=jnp.uint32)])


_digest_jit = jax.jit(_digest)


def _off_device(x) -> bool:
  return getattr(getattr(x, "sharding", None), "memory_kind", None) not in (None, "device")


def checksums(flat: dict) -> dict:
  """{key: 16 hex digits} for every leaf of {key: array}: one jitted reduction per leaf,
  where the leaf lives (every process of a multi-process array takes part), compiled once
  per shape, dtype and sharding, so repeated layers and repeated saves share it. Each is
  waited for before the next starts: many collective programs in flight can starve XLA's
  CPU rendezvous, and a leaf in host memory (an offloaded optimizer state) is copied to
  the devices alone, its copy freed before the next."""
  sums = {}
  for key, x in flat.items():
    if not isinstance(x, jax.Array):
      x = jnp.asarray(x)
    if _off_device(x):
      x = jax.device_put(x, x.sharding.with_memory_kind("device"))
    sums[key] = _hex(_digest_jit(x))
  return sums


def _hex(s) -> str:
  # The result is replicated; in a multi-process pool only this process's copy is readable.
  lanes = np.asarray(s.addressable_shards[0].data)
  return "".join(f"{int(v):08x}" for v in lanes)


def host_digest(host: dict) -> str:
  body = {k: v for k, v in host.items() if k != "digest"}
  return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
