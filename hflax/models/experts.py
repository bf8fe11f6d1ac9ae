"""How a sparse layer computes the experts its router picked (ModelConfig.moe_dispatch).
Each function takes the tokens [B, T, D], their k picks [B, T, k] with combine weights,
and the stacked SwiGLU experts (gate, up [E, D, F], down [E, F, D]); each returns the
weighted sum of every token's k experts, with no token dropped unless a capacity says so.

"dense": every expert runs on every token and a [tokens, experts] matrix of combine weights
(zero outside a token's k) sums them: num_experts / k times the FLOPs of the picks, but
two einsums over the stacked weights, so an "expert" mesh axis on E splits the work
(XLA reduces the sum over E across the axis).

"sorted": the B*T*k picks sorted by expert, each expert's contiguous rows multiplied by
its weights alone (jax.lax.ragged_dot, a grouped matmul: k experts' FLOPs a token where
the backend has a grouped kernel; jax lowers it on CPU to a masked product over every
group). Under an expert axis XLA partitions the sort and the grouped products as it can:
every device all-reduces all picked rows over the pool.

"all_to_all": expert parallelism as GShard and MaxText do it. Under a mesh with an
"expert" axis (the trainer's programs run under their pool's mesh), each device keeps its
own rows, sends every pick to the device holding its expert (one all-to-all), runs its
own experts on what it received (grouped, as "sorted"), and sends the results back (a
second all-to-all); the backward pass is the same exchange reversed. Each device sends
every other a buffer of a fixed number of rows (collectives need static shapes): with
moe_capacity_factor 0 that is all its picks, so no pick is ever dropped and the result
equals "sorted"; with a factor c > 0 it is c x its picks / expert-axis size, the
traffic and memory of a balanced router times c, and a pick past its expert device's
capacity contributes nothing (the token keeps its other picks and the residual). Outside
such a mesh (generation, one device) it is "sorted".

LoRA: each function also takes `adapters`, {"gate" | "up" | "down": (A [E, in, r],
B [E, r, out])} for the adapted projections (B already times the LoRA scale), and adds
x A_e B_e to x W_e for a row of expert e, the function of W_e + A_e B_e, as two more
products of rank r in the same dispatch: einsums over the stack (dense), grouped
products (sorted, and all_to_all on each device's own experts, its adapters split over
the expert axis with the kernels).
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from hflax.models.config import ROW_AXES

EXPERT_AXIS = "expert"  # the mesh axis experts split over (hflax.sharding.layouts)


def dense_experts(x_BxTxD, routes_BxTxK, weights_BxTxK, gate_ExDxF, up_ExDxF, down_ExFxD,
                  adapters=None):
  """Dense dispatch: every expert on every token, summed with combine weights that are zero
  outside a token's k experts."""
  n, adapters = gate_ExDxF.shape[0], adapters or {}
  # [..., E]: each token's weight for each expert, zero outside its k.
  combine = jnp.einsum("...k,...ke->...e", weights_BxTxK,
                       jax.nn.one_hot(routes_BxTxK, n, dtype=weights_BxTxK.dtype))
  gate = _each_expert(x_BxTxD, gate_ExDxF, adapters.get("gate"))
  up = _each_expert(x_BxTxD, up_ExDxF, adapters.get("up"))
  hidden = _swiglu(gate, up) * combine[..., None]
  out = jnp.einsum("btef,efd->btd", hidden, down_ExFxD)
  if "down" in adapters:
    a_ExFxR, b_ExRxD = adapters["down"]
    out = out + jnp.einsum("bter,erd->btd", jnp.einsum("btef,efr->bter", hidden, a_ExFxR),
                           b_ExRxD)
  return out


def _each_expert(x_BxTxD, w_ExDxF, adapter):
  """x through every expert's projection [B, T, E, F], with its adapter (A, B) if any."""
  out = jnp.einsum("btd,edf->btef", x_BxTxD, w_ExDxF)
  if adapter is None:
    return out
  a_ExDxR, b_ExRxF = adapter
  return out + jnp.einsum("bter,erf->btef", jnp.einsum("btd,edr->bter", x_BxTxD, a_ExDxR),
                          b_ExRxF)


def sorted_experts(x_BxTxD, routes_BxTxK, weights_BxTxK, gate_ExDxF, up_ExDxF, down_ExFxD,
                   adapters=None):
  """Sorted (grouped) dispatch: each of the B*T*k (token, expert) picks becomes a row, the
  rows are sorted by expert, and jax.lax.ragged_dot multiplies each expert's contiguous
  group of rows by that expert's weights alone (a grouped matmul: the FLOPs of k experts a
  token, not all E). The rows' outputs, scaled by their routing weights, are put back in
  pick order and summed over each token's k picks. No capacity: a group holds however
  many rows its expert got, so no token is dropped. How fast it is depends on how jax
  lowers ragged_dot: on GPU and TPU to XLA's ragged-dot instruction (a grouped matmul);
  on CPU to a masked product over every group, k times dense dispatch's FLOPs."""
  B, T, D = x_BxTxD.shape
  k, n = routes_BxTxK.shape[-1], gate_ExDxF.shape[0]
  experts = routes_BxTxK.reshape(-1)  # [B*T*k], pick i is token i // k's
  order = jnp.argsort(experts, stable=True)
  rows_RxD = jnp.take(x_BxTxD.reshape(B * T, D), order // k, axis=0)
  sizes = jnp.bincount(experts, length=n).astype(jnp.int32)
  out_RxD = grouped_swiglu(rows_RxD, sizes, gate_ExDxF, up_ExDxF, down_ExFxD, adapters)
  out_RxD = out_RxD * jnp.take(weights_BxTxK.reshape(-1), order)[:, None]
  # Back in pick order (the inverse permutation), then each token's k picks summed.
  picks = jnp.zeros_like(out_RxD).at[order].set(out_RxD, unique_indices=True)
  return picks.reshape(B, T, k, D).sum(axis=2)


def _swiglu(gate, up):
  """silu(gate) * up, in float32 for 16-bit dtypes and rounded once (as the dense MLP)."""
  wide = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32))
  return wide.astype(gate.dtype)


def grouped_swiglu(rows_RxD, sizes_E, gate_ExDxF, up_ExDxF, down_ExFxD, adapters=None):
  """Rows sorted by expert (sizes[e] rows for expert e in turn; rows past them give zeros)
  through their own expert's SwiGLU: three grouped matmuls (two more per adapter)."""
  adapters = adapters or {}
  gate = _grouped(rows_RxD, gate_ExDxF, sizes_E, adapters.get("gate"))
  up = _grouped(rows_RxD, up_ExDxF, sizes_E, adapters.get("up"))
  return _grouped(_swiglu(gate, up), down_ExFxD, sizes_E, adapters.get("down"))


def _grouped(rows_RxD, w_ExDxF, sizes_E, adapter):
  """Each row through its expert's projection, with that expert's adapter (A, B) if any."""
  out = jax.lax.ragged_dot(rows_RxD, w_ExDxF, sizes_E)
  if adapter is None:
    return out
  a_ExDxR, b_ExRxF = adapter
  low_RxR = jax.lax.ragged_dot(rows_RxD, a_ExDxR, sizes_E)
  return out + jax.lax.ragged_dot(low_RxR, b_ExRxF, sizes_E)


def all_to_all_experts(x_BxTxD, routes_BxTxK, weights_BxTxK, gate_ExDxF, up_ExDxF,
                       down_ExFxD, adapters=None, capacity_factor: float = 0.0):
  """Expert parallelism by two all-to-alls over the context mesh's expert axis (module
  docstring); sorted_experts where there is none."""
  mesh = jax.sharding.get_abstract_mesh()
  adapters = adapters or {}
  if (mesh.empty or mesh.shape.get(EXPERT_AXIS, 1) == 1
      or any(t == jax.sharding.AxisType.Manual for t in mesh.axis_types)):
    return sorted_experts(x_BxTxD, routes_BxTxK, weights_BxTxK, gate_ExDxF, up_ExDxF,
                          down_ExFxD, adapters)
  rows = P(tuple(a for a in ROW_AXES if a in mesh.axis_names and mesh.shape[a] > 1))
  experts = P(EXPERT_AXIS)
  exchange = functools.partial(_exchange, shards=mesh.shape[EXPERT_AXIS],
                               capacity_factor=capacity_factor)
  # The adapters split over the expert axis as the kernels do: each device its experts'.
  return jax.shard_map(exchange, in_specs=(rows, rows, rows, experts, experts, experts, experts),
                       out_specs=rows)(x_BxTxD, routes_BxTxK, weights_BxTxK, gate_ExDxF,
                                       up_ExDxF, down_ExFxD, adapters)


def _exchange(x_BxTxD, routes_BxTxK, weights_BxTxK, gate_LxDxF, up_LxDxF, down_LxFxD,
              adapters, *, shards: int, capacity_factor: float):
  """One device's part: its rows' picks out to their experts' devices and back. L: the
  experts this device holds (expert e lives on device e // L of the axis, as index L*j..
  L*j+L-1 of the stacked weights on device j)."""
  B, T, D = x_BxTxD.shape
  k, local = routes_BxTxK.shape[-1], gate_LxDxF.shape[0]
  picks = B * T * k
  capacity = picks if not capacity_factor else min(
      picks, max(1, math.ceil(capacity_factor * picks / shards)))
  expert = routes_BxTxK.reshape(-1)  # pick i is token i // k's
  order = jnp.argsort(expert, stable=True)  # by destination device, then by expert
  dest = expert[order] // local
  sent = jnp.bincount(dest, length=shards)
  slot = jnp.arange(picks) - (jnp.cumsum(sent) - sent)[dest]  # place in its device's block
  # Where each sorted pick goes in the send buffer: block dest, row slot; past the
  # capacity, nowhere (an index off the end, which the scatter drops).
  where = jnp.where(slot < capacity, dest * capacity + slot, shards * capacity)
  x_rows = jnp.take(x_BxTxD.reshape(B * T, D), order // k, axis=0)
  send_x = jnp.zeros((shards * capacity, D), x_rows.dtype).at[where].set(
      x_rows, mode="drop", unique_indices=True)
  # Each row's expert on the receiving device; `local` marks an empty row.
  send_e = jnp.full((shards * capacity,), local, jnp.int32).at[where].set(
      (expert[order] % local).astype(jnp.int32), mode="drop", unique_indices=True)
  recv_x = jax.lax.all_to_all(send_x, EXPERT_AXIS, 0, 0, tiled=True)
  recv_e = jax.lax.all_to_all(send_e, EXPERT_AXIS, 0, 0, tiled=True)
  # Block j of what arrived came from device j. Grouped by expert (empty rows last, where
  # the grouped matmul gives zeros), computed, put back in arrival order.
  by_expert = jnp.argsort(recv_e, stable=True)
  out = grouped_swiglu(jnp.take(recv_x, by_expert, axis=0),
                       jnp.bincount(recv_e, length=local).astype(jnp.int32),
                       gate_LxDxF, up_LxDxF, down_LxFxD, adapters)
  out = jnp.zeros_like(out).at[by_expert].set(out, unique_indices=True)
  back = jax.lax.all_to_all(out, EXPERT_AXIS, 0, 0, tiled=True)  # in the send buffer's rows
  result = jnp.take(back, where, axis=0, mode="fill", fill_value=0)
  result = result * jnp.take(weights_BxTxK.reshape(-1), order)[:, None]
  result = jnp.zeros_like(result).at[order].set(result, unique_indices=True)
  return result.reshape(B, T, k, D).sum(axis=2)


DISPATCH = {"dense": dense_experts, "sorted": sorted_experts, "all_to_all": all_to_all_experts}
