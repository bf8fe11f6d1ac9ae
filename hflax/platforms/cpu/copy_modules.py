"""The CPU decoding copy's modules: the model's Dense, Attention, MLP and DecoderLM as the
copy that decoding_copy.py writes computes them.

The model's modules keep weights, biases, LoRA and the math. decoding_plan turns each
plain one of a model into its copy here (the same object, its class changed), with what
the copy stores: kernels [out, in] (CopyDense.out_in), q, k and v grouped into one kernel
(CopyAttention.qkv), gate and up stacked (CopyMLP.pair), a tied head packed
(CopyLM.packed_head), kernels in the CPU matmul kernel's packed layout (`packed`), and
decode steps attending through the CPU attention kernel (CopyAttention.cpu_attention).
They compute what the model's modules compute, laid out for XLA:CPU's matmul library and
the CPU kernels.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hflax import platforms
from hflax.models.matmul import (dense_dot, head_on_left, kernel_on_left, row_major_transpose,
                                 step_logits, widens_on_cpu)
from hflax.models.transformer import MLP, Attention, DecoderLM, Dense, swiglu
from hflax.platforms.leaf_copy import kv_grouped


class CopyDense(Dense):
  """A plain (adapter-free) Dense whose kernel is stored [out, in]."""

  out_in = True  # the layout, for readers that cannot import this module (models/logprobs)

  def become_copy(self, packed: bool, kernel_left: bool):
    # True where the kernel is also in the CPU matmul kernel's packed layout.
    self.packed = packed
    # The kernel goes on the left for a few rows (matmul.rows_by_kernel): for a product
    # that feeds an addition (the residual: o and down), which reads it transposed at no
    # cost; q/k/v's and gate/up's consumers did not (their gain went into a transposing
    # copy). The head is CopyLM.step_logits' choice (a limit of its own).
    self.kernel_left = kernel_left

  def __call__(self, x):
    y = dense_dot(x, self.kernel[...], self.dtype, out_in=True, kernel_left=self.kernel_left,
                  low=self.compute_kernel, packed=self.packed)
    return y if self.bias is None else y + self.bias[...].astype(self.dtype)


class CopyAttention(Attention):
  """q, k and v from one grouped kernel (or grouped in each decode step where the hybrid
  engine's copy keeps them apart), decode steps through the CPU attention kernel."""

  def become_copy(self):
    # q, k and v's kernels in one, in place of q, k and v (decoding_plan's fuse).
    self.qkv, self.qkv_bias = nnx.data(None), nnx.data(None)
    self.packed = False  # qkv in the CPU matmul kernel's packed layout
    # Decode steps attend through the CPU decode-attention kernel (decoding_plan's attend).
    self.cpu_attention = False

  @property
  def kernel_decodes(self) -> bool:
    """Whether decode steps attend through the CPU kernel where it takes the cache:
    the decoding copy asked for it and no other attention implementation is configured."""
    return self.cpu_attention and self.cfg.attention == "auto"

  def attention_options(self, cache) -> dict:
    return {"decode_kernel": self.kernel_decodes and cache is not None}

  def projections(self, x_BxTxD):
    if self.qkv is not None:
      return self._grouped_projections(
          x_BxTxD, self.qkv[...], None if self.qkv_bias is None else self.qkv_bias[...],
          self.packed)
    if x_BxTxD.shape[1] == 1 and _copies(self.q, self.k, self.v):
      # The hybrid engine's copy keeps q, k and v apart (its transfer moves leaves one to
      # one): grouped here, XLA hoists the concatenation out of the decode loop.
      return self._grouped_projections(
          x_BxTxD, *_grouped((self.q, self.k, self.v), self.cfg.num_kv_heads))
    return super().projections(x_BxTxD)

  def _grouped_projections(self, x_BxTxD, kernel, bias, packed=False):
    """q, k and v from a decoding copy's kernel [KV, (G + 2) * Dh, D] (q, k and v
    concatenated per KV group, so a tensor-parallel split of the heads stays aligned with
    the groups) in one matmul instead of three: a decode step's small products are bound
    by reading the kernels and by per-call overhead, not by FLOPs: few rows gain, the
    same tokens; many rows, bound by FLOPs, neither gain nor lose."""
    cfg = self.cfg
    B, T, _ = x_BxTxD.shape
    KV, G, Dh = cfg.num_kv_heads, cfg.num_heads // cfg.num_kv_heads, cfg.head_dim
    # [B, T, KV, (G + 2) * Dh]
    y = dense_dot(x_BxTxD, kernel, self.o.dtype, out_in=True, packed=packed)
    if bias is not None:
      y = y + bias.astype(y.dtype)
    q, k, v = jnp.split(y, [G * Dh, (G + 1) * Dh], axis=-1)
    return q.reshape(B, T, KV * G, Dh), k, v


class CopyMLP(MLP):
  """gate and up stacked [mlp, 2, embed] in one kernel (pair), in place of gate and up:
  one matmul, the product [..., mlp, 2]. Stacked in front, the flattened [2 * mlp, embed]
  would split a tensor-parallel mlp axis in its minor half, and XLA gathered the whole
  pair."""

  def become_copy(self):
    self.pair = nnx.data(None)
    self.packed = False  # pair in the CPU matmul kernel's packed layout

  def __call__(self, x):
    if self.pair is None:
      if x.shape[-2] == 1 and _copies(self.gate, self.up) and self.gate.bias is None:
        # The hybrid engine's copy keeps gate and up apart (its transfer moves leaves one
        # to one): stacked here [mlp, 2, embed]; XLA hoists the stack out of the decode loop.
        kernels = jnp.stack([self.gate.kernel[...], self.up.kernel[...]], axis=1)
        gate, up = jnp.moveaxis(dense_dot(x, kernels, self.gate.dtype, out_in=True), -1, 0)
        return self.down(swiglu(gate, up))
      return super().__call__(x)
    # down is a decoding copy's kernel too (never an adapted one: decoding_copy)
    if (kernel_on_left(x.size // x.shape[-1], self.down.dtype) and _copies(self.down)
        and not self.packed):
      return self._columns(x)
    pair = dense_dot(x, self.pair[...], self.down.dtype, out_in=True, packed=self.packed)
    gate, up = jnp.moveaxis(pair, -1, 0)
    return self.down(swiglu(gate, up))

  def _columns(self, x):
    """The decoding copy's MLP for a few rows on CPU, both kernels the left operands
    (matmul.rows_by_kernel). float32 keeps the activation transposed ([mlp, rows]) between
    them, down taking it as it lies (both products gain, down the more). bfloat16 writes
    the activation out [rows, mlp] first: XLA:CPU widens a bfloat16 dot whose right
    operand contracts its first axis to float32 (the MLP ran much slower that way). Both
    products are rounded to the compute dtype as the plain order rounds them."""
    # The kernel's axis 1 contracted with the right operand's `axis`.
    contract = lambda axis: (((1,), (axis,)), ((), ()))  # noqa: E731
    dtype = jnp.dtype(self.down.dtype)
    x_RxD = x.reshape(-1, x.shape[-1]).astype(dtype)
    F, _, D = self.pair.shape
    wide = jnp.float32 if widens_on_cpu(dtype) else None
    pair_Fx2xR = jax.lax.dot_general(self.pair[...].reshape(2 * F, D), x_RxD, contract(1),
                                     preferred_element_type=wide).astype(dtype)
    pair_Fx2xR = pair_Fx2xR.reshape(F, 2, -1)
    act_FxR = swiglu(pair_Fx2xR[:, 0], pair_Fx2xR[:, 1])
    if wide is not None:  # down's own product, its kernel on the left (rows_by_kernel)
      return self.down(row_major_transpose(act_FxR[None])[0].reshape(x.shape[:-1] + (F,)))
    y_DxR = jax.lax.dot_general(self.down.kernel[...], act_FxR, contract(0))
    y = jax.lax.optimization_barrier(y_DxR).T.reshape(x.shape)
    return y if self.down.bias is None else y + self.down.bias[...].astype(y.dtype)


class CopyLM(DecoderLM):
  """The head of a generation step's rows through the CPU matmul kernel where the copy
  packed it, or with its [V, D] table on the left for a few rows."""

  def become_copy(self):
    # A tied table [V, D] in the CPU matmul kernel's packed layout, for step_logits; the
    # embedding lookups keep reading embed.
    self.packed_head = nnx.data(None)

  def step_logits(self, hidden_BxD):
    if self.packed_head is not None:
      return platforms.packed_matmul(hidden_BxD, self.packed_head[...])
    head = self.lm_head
    if head is not None and getattr(head, "packed", False):
      return platforms.packed_matmul(hidden_BxD, head.kernel[...])
    if _copies(head) and head_on_left(hidden_BxD.shape[0], head.dtype):
      return step_logits(hidden_BxD, head.kernel[...], head.dtype)
    return super().step_logits(hidden_BxD)


def _copies(*denses) -> bool:
  """Whether every one of `denses` is a copy's, its kernel stored [out, in]."""
  return all(isinstance(d, CopyDense) for d in denses)


def _grouped(denses, groups):
  """Kernels stored [out, in] (and biases) concatenated per KV group along out."""
  kernel = kv_grouped([d.kernel[...] for d in denses], groups)
  return kernel, None if denses[0].bias is None else kv_grouped([d.bias[...] for d in denses],
                                                                 groups)

