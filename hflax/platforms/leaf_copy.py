"""Copies of a model's state written leaf by leaf from recipes: the generation copy the
hybrid engine writes (a cast, or the CPU platform's decoding copy) and the sampler's
decoding copy are both made here.

A Recipe says how one leaf of the copy comes from the state's leaves; build_leaves runs
the recipes (inside a program the caller compiles) and copy_leaves assembles the copy,
passing untouched leaves as they are. Which recipes a copy has is the platform's choice
(platforms/decoding.py); the making is the same on every backend.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

from hflax import platforms


class Recipe(NamedTuple):
  """How one leaf of a copy is made from the state's leaves (`sources`, indices in
  jax.tree.leaves order): "keep" (cast to `dtype` where given), "transpose" (a kernel
  stored [out, in]), "stack" (kernels stored [out, in] and stacked on a new axis 1: the
  MLP's gate and up as [mlp, 2, embed]), "groups" (q, k and v, each split into `shape[0]`
  KV groups along its output axis and concatenated per group: kernels stored [out, in],
  [KV, (G + 2) * head_dim, embed]; biases [KV, (G + 2) * head_dim]). `packed`: the result
  then goes into the packed layout of platforms.packed_matmul (same shape)."""
  kind: str
  sources: tuple
  dtype: Any
  shape: tuple
  packed: bool = False

  @property
  def identity(self) -> bool:
    return self.kind == "keep" and self.dtype is None and not self.packed


def copy_leaves(recipes, leaves, program):
  """The copy's leaves: those `recipes` pass as they are, and the others, in order, from
  `program(leaves)` (build_leaves over their recipes, compiled by the caller)."""
  written = iter(program(leaves) if any(not r.identity for r in recipes) else ())
  return [leaves[r.sources[0]] if r.identity else next(written) for r in recipes]


def build_leaves(recipes, leaves):
  """The copy's leaves that `recipes` make from the state's `leaves`."""
  return [_build(r, [leaves[i] for i in r.sources]) for r in recipes]


def _build(recipe: Recipe, xs):
  kernels = recipe.kind != "keep" and xs[0].ndim == 2  # a bias is grouped, not transposed
  xs = [(x.T if kernels else x).astype(recipe.dtype or x.dtype) for x in xs]
  if recipe.kind == "stack":
    out = jnp.stack(xs, axis=1)
  elif recipe.kind == "groups":
    out = kv_grouped(xs, recipe.shape[0])
  else:
    out = xs[0]
  return platforms.pack_for_kernel(out) if recipe.packed else out


def kv_grouped(arrays, groups):
  """[out, ...] arrays (q, k and v kernels stored [out, in], or their biases) each split
  into `groups` along out and concatenated per group: [groups, sum(out) / groups, ...],
  the layout a decoding copy's grouped q/k/v projection reads."""
  return jnp.concatenate([x.reshape(groups, -1, *x.shape[1:]) for x in arrays], axis=1)
