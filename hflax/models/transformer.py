"""The decoder-only transformer behind Llama (2/3), Qwen2/2.5, Qwen3 and Qwen3-MoE (its
sparse MLP in hflax.models.moe), in Flax NNX.

Every parameter carries `axes`, a tuple of logical axis names, that hflax.sharding maps
to mesh axes (one mapping for training, another for generation).

Attention works on explicit KV-cache slots: the cache for a layer stores K as
[B, kv_heads, head_dim, S] and V as [B, kv_heads, S, head_dim], so that both attention
matmuls read their operand in the layout it is stored in (no per-step transpose of the
cache). `kv_valid_BxS` marks slots holding real tokens; a query in slot s sees valid
slots <= s. Teacher forcing is the same computation with a cache made of the sequence.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from hflax import platforms
from hflax.models.attention import attention
from hflax.models.config import LORA_SHARED_GATE, ROW_AXES, ModelConfig
from hflax.models.matmul import compute_copy, dense_dot, step_logits, tied_head, tied_logits
from hflax.models.moe import SparseMoE, remat_recorded, set_replay
from hflax.models.norm import rms_norm
from hflax.models.rope import apply_rope, rope_tables
from hflax.models.tracing import one_trace_per_call

_INIT = jax.nn.initializers.normal(0.02)


class Dense(nnx.Module):
  """x W (+ bias), the kernel W stored [din, dout]; with `lora`, plus (alpha / rank) x A B,
  A and B being LoRAParams."""

  def __init__(self, din, dout, axes, *, bias, cfg: ModelConfig, rngs: nnx.Rngs,
               lora: bool = False):
    self.kernel = nnx.Param(_INIT(rngs.params(), (din, dout), cfg.param_dtype), axes=axes)
    self.bias = (nnx.Param(jnp.zeros((dout,), cfg.param_dtype), axes=axes[1:])
                 if bias else None)
    self.dtype = jnp.dtype(cfg.dtype)
    self.lora_a, self.lora_b = _lora_pair(din, dout, axes, cfg, rngs) if lora else (None, None)
    self.lora_scale = cfg.lora_scale if lora else 0.0
    # The kernel already cast to the compute dtype, for the model of one update's
    # micro-batches only (compute_kernels); never part of the state.
    self.compute_kernel = nnx.data(None)

  def __call__(self, x):
    y = dense_dot(x, self.kernel[...], self.dtype, low=self.compute_kernel)
    if self.lora_a is not None:
      down = dense_dot(x, self.lora_a[...], self.dtype)
      y = y + self.lora_scale * dense_dot(down, self.lora_b[...], self.dtype)
    return y if self.bias is None else y + self.bias[...].astype(self.dtype)


def _lora_pair(din, dout, axes, cfg: ModelConfig, rngs: nnx.Rngs):
  """PEFT's initialisation: A ~ U(+-1/sqrt(din)) (kaiming-uniform, a=sqrt(5)), B = 0, so
  the adapted model starts as the base model. A draws from a stream of its own, which
  leaves the base weights' draws as they are without LoRA."""
  bound, r = din ** -0.5, cfg.lora_rank
  a = jax.random.uniform(rngs.lora(), (din, r), cfg.param_dtype, -bound, bound)
  return (nnx.LoRAParam(a, axes=(axes[0], None)),
          nnx.LoRAParam(jnp.zeros((r, dout), cfg.param_dtype), axes=(None, axes[1])))


class RMSNorm(nnx.Module):
  def __init__(self, dim, axis_name, *, cfg: ModelConfig):
    self.scale = nnx.Param(jnp.ones((dim,), cfg.param_dtype), axes=(axis_name,))
    self.eps = cfg.rms_norm_eps

  def __call__(self, x):
    return rms_norm(x, self.scale[...], self.eps)


class Attention(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, h, kv, hd = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    self.cfg = cfg
    on = lambda name: {"cfg": cfg, "rngs": rngs, "lora": name in cfg.lora_targets}  # noqa: E731
    self.q = Dense(d, h * hd, ("embed", "q_heads"), bias=cfg.qkv_bias, **on("q_proj"))
    self.k = Dense(d, kv * hd, ("embed", "kv_heads"), bias=cfg.qkv_bias, **on("k_proj"))
    self.v = Dense(d, kv * hd, ("embed", "kv_heads"), bias=cfg.qkv_bias, **on("v_proj"))
    self.o = Dense(h * hd, d, ("q_heads", "embed"), bias=cfg.o_bias, **on("o_proj"))
    self.q_norm = RMSNorm(hd, "head_dim", cfg=cfg) if cfg.qk_norm else None
    self.k_norm = RMSNorm(hd, "head_dim", cfg=cfg) if cfg.qk_norm else None

  def __call__(self, x_BxTxD, cos, sin, kv_valid_BxS, slot0, cache, segment_ids_BxT=None,
               prefix_ids_BxT=None):
    cfg = self.cfg
    teacher_forced = cache is None and isinstance(slot0, int) and slot0 == 0
    B, T, _ = x_BxTxD.shape
    H, Dh = cfg.num_heads, cfg.head_dim
    q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh = self.projections(x_BxTxD)
    if self.q_norm is not None:
      q_BxTxHxDh, k_BxTxKxDh = self.q_norm(q_BxTxHxDh), self.k_norm(k_BxTxKxDh)
    q_BxTxHxDh = apply_rope(q_BxTxHxDh, cos, sin)
    k_BxKxDhxT = apply_rope(k_BxTxKxDh, cos, sin).transpose(0, 2, 3, 1)
    v_BxKxTxDh = v_BxTxKxDh.transpose(0, 2, 1, 3)
    if cache is None:
      k_BxKxDhxS, v_BxKxSxDh = k_BxKxDhxT, v_BxKxTxDh
    else:
      cache = {"k": _write_slots(cache["k"], k_BxKxDhxT, slot0, axis=3),
               "v": _write_slots(cache["v"], v_BxKxTxDh, slot0, axis=2)}
      k_BxKxDhxS, v_BxKxSxDh = stored_keys(cache["k"]), cache["v"]
    # The slot each query was written to: [1, T] for a shared slot0, [B, T] per row.
    q_slot_BxT = jnp.reshape(slot0, (-1, 1)) + jnp.arange(T)
    out_BxTxHxDh = attention(q_BxTxHxDh, k_BxKxDhxS, v_BxKxSxDh, kv_valid_BxS, q_slot_BxT,
                             segment_ids_BxT, segment_ids_BxT, prefix_ids_BxT,
                             impl=cfg.attention, teacher_forced=teacher_forced,
                             **self.attention_options(cache))
    return self.o(out_BxTxHxDh.reshape(B, T, H * Dh)), cache

  def projections(self, x_BxTxD):
    """q [B, T, H, Dh], k and v [B, T, KV, Dh]."""
    cfg = self.cfg
    B, T, _ = x_BxTxD.shape
    KV, H, Dh = cfg.num_kv_heads, cfg.num_heads, cfg.head_dim
    return (self.q(x_BxTxD).reshape(B, T, H, Dh), self.k(x_BxTxD).reshape(B, T, KV, Dh),
            self.v(x_BxTxD).reshape(B, T, KV, Dh))

  def attention_options(self, cache) -> dict:
    """Keyword arguments for models.attention.attention beyond the model's config."""
    return {}

def _write_slots(cache, new, slot0, axis):
  """cache with `new` written at columns slot0.. of `axis`; slot0 a scalar or one per row."""
  new = _as_bits(new) if cache.dtype == KEY_BITS else new.astype(cache.dtype)
  if new.shape[axis] == 1 and _widened_on_cpu(cache):
    at = jnp.reshape(slot0, (-1,) + (1,) * (cache.ndim - 1))
    return cache_where(cache_columns(cache, axis) == at, new, cache)
  start = lambda s: tuple(s if a == axis else 0 for a in range(new.ndim))  # noqa: E731
  if jnp.ndim(slot0) == 0:
    return jax.lax.dynamic_update_slice(cache, new, start(slot0))
  # A row's own columns: vmapped over rows this lowers to one scatter.
  row_start = lambda s: start(s)[1:]  # noqa: E731
  return jax.vmap(lambda c, n, s: jax.lax.dynamic_update_slice(c, n, row_start(s)))(
      cache, new, jnp.asarray(slot0, jnp.int32))


def _widened_on_cpu(cache) -> bool:
  """XLA:CPU widens bfloat16 data movement (dynamic-update-slice, select) to float32: a
  one-column write converted the whole cache, a third of a many-row decode step. On its
  uint16 bits the same select runs at memory speed."""
  return _bfloat16_on_cpu(cache.dtype)


def _bfloat16_on_cpu(dtype) -> bool:
  return jnp.dtype(dtype) == jnp.bfloat16 and platforms.widens_16_bit()


KEY_BITS = jnp.uint16


def _as_bits(x):
  return jax.lax.bitcast_convert_type(x.astype(jnp.bfloat16), KEY_BITS)


def _from_bits(bits):
  return jax.lax.bitcast_convert_type(bits, jnp.bfloat16)


def key_cache_dtype(dtype):
  """The dtype a KV cache holds its keys in: bfloat16 keys on CPU as their bits (KEY_BITS).

  Why: XLA:CPU widens a bfloat16 dynamic-update-slice to float32, so each decode step
  rewrote every cached key through a select (cache_where), done twice: into the cache and
  into the float32 copy the scores' loop reads. On the bits, the new column is written in
  place (the float32 copy stays: XLA makes it for the loop either way); a bfloat16
  generate call runs faster, with the same tokens. The values stay bfloat16: their weighted
  sum is a matmul, which wants a bfloat16 buffer (a view of bits was copied every step)."""
  return jnp.dtype(KEY_BITS if _bfloat16_on_cpu(dtype) else dtype)


def stored_keys(k_cache):
  """The keys of a cache as numbers (bfloat16 where key_cache_dtype stores bits)."""
  return _from_bits(k_cache) if k_cache.dtype == KEY_BITS else k_cache


def cache_columns(cache, axis):
  """The slot index of every column along `axis`, shaped to broadcast against `cache`."""
  return jnp.arange(cache.shape[axis]).reshape([-1 if a == axis else 1
                                                for a in range(cache.ndim)])


def cache_where(mask, new, cache):
  """jnp.where(mask, new, cache) for a KV cache (bfloat16 ones on CPU through their bits)."""
  if not _widened_on_cpu(cache):
    return jnp.where(mask, new.astype(cache.dtype), cache)
  return _from_bits(jnp.where(mask, _as_bits(new), _as_bits(cache)))


class MLP(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
    d, f, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
    on = lambda name: {"cfg": cfg, "rngs": rngs, "lora": name in cfg.lora_targets}  # noqa: E731
    self.gate = Dense(d, f, ("embed", "mlp"), bias=b, **on("gate_proj"))
    self.up = Dense(d, f, ("embed", "mlp"), bias=b, **on("up_proj"))
    self.down = Dense(f, d, ("mlp", "embed"), bias=b, **on("down_proj"))

  def __call__(self, x):
    plain = self.gate.bias is None and self.gate.lora_a is None and self.up.lora_a is None
    if x.shape[-2] == 1 and plain:
      # Decoding one token: gate and up stacked [embed, 2, mlp] for one product (a step's
      # small products are bound by reading kernels); XLA hoists the stack out of the
      # decode loop.
      kernels = jnp.stack([self.gate.kernel[...], self.up.kernel[...]], axis=1)
      gate, up = jnp.moveaxis(dense_dot(x, kernels, self.gate.dtype), -2, 0)
      return self.down(swiglu(gate, up))
    return self.down(swiglu(self.gate(x), self.up(x)))


def swiglu(gate, up):
  """silu(gate) * up; for a 16-bit dtype computed in float32 and rounded once.

  In bfloat16, XLA:CPU widened each of silu's steps to float32 and rounded it back, about
  twice the time of one widening in a prefill and in a decode step alike. Rounding once is
  also closer to the float32 result. float32 keeps autodiff's plain form (the fp32 update
  was slower recomputing it).
  """
  if jnp.dtype(gate.dtype).itemsize >= 4:  # float32 (float64 too: never narrowed)
    return jax.nn.silu(gate) * up
  return _swiglu_in_float32(gate, up)


@jax.checkpoint
def _swiglu_in_float32(gate, up):
  # Recomputed in the backward pass (jax.checkpoint), so training keeps only gate and up in
  # their own dtype, not float32 intermediates.
  return (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(gate.dtype)


def _sparse_mlp(cfg: ModelConfig, rngs: nnx.Rngs) -> SparseMoE:
  """A sparse layer, with Qwen2-MoE's shared expert where the config has one."""
  width = cfg.shared_expert_intermediate_size
  if not width:
    return SparseMoE(cfg, rngs)
  shared = MLP(cfg.replace(intermediate_size=width), rngs)
  gate = Dense(cfg.hidden_size, 1, ("embed", None), bias=False, cfg=cfg, rngs=rngs,
               lora=LORA_SHARED_GATE in cfg.lora_targets)
  return SparseMoE(cfg, rngs, shared_expert=shared, shared_expert_gate=gate)


class Block(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, layer: int = 0):
    self.attn_norm = RMSNorm(cfg.hidden_size, "norm", cfg=cfg)
    self.attn = Attention(cfg, rngs)
    self.mlp_norm = RMSNorm(cfg.hidden_size, "norm", cfg=cfg)
    self.mlp = _sparse_mlp(cfg, rngs) if cfg.sparse_layer(layer) else MLP(cfg, rngs)

  def __call__(self, x, cos, sin, kv_valid, slot0, cache, segment_ids=None, prefix_ids=None):
    h, cache = self.attn(self.attn_norm(x), cos, sin, kv_valid, slot0, cache, segment_ids,
                         prefix_ids)
    x = x + h
    return x + self.mlp(self.mlp_norm(x)), cache


class DecoderLM(nnx.Module):
  """head="lm": next-token logits. head="value": one scalar per token (critic, reward, cost)."""

  def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, head: str = "lm"):
    if head not in ("lm", "value"):
      raise ValueError(f"head must be 'lm' or 'value', got {head!r}")
    self.cfg, self.head = cfg, head
    self.embed = nnx.Param(_INIT(rngs.params(), (cfg.vocab_size, cfg.hidden_size),
                                 cfg.param_dtype), axes=("vocab", "embed"))
    self.layers = nnx.List([Block(cfg, rngs, i) for i in range(cfg.num_layers)])
    self.final_norm = RMSNorm(cfg.hidden_size, "norm", cfg=cfg)
    untied_lm = head == "lm" and not cfg.tie_word_embeddings
    self.lm_head = (Dense(cfg.hidden_size, cfg.vocab_size, ("embed", "vocab"), bias=False,
                          cfg=cfg, rngs=rngs) if untied_lm else None)
    self.score = (Dense(cfg.hidden_size, 1, ("embed", None), bias=True, cfg=cfg, rngs=rngs)
                  if head == "value" else None)

  def __call__(self, tokens_BxT, positions_BxT, kv_valid_BxS, *, cache=None, slot0=0,
               segment_ids_BxT=None, prefix_ids_BxT=None):
    """Final-norm hidden states [B, T, D] and the updated cache (a list, one dict per layer).

    Positions must be below S, the number of KV slots (kv_valid_BxS.shape[1]): true of
    positions_from_mask, where a token's position never exceeds its slot. slot0 is where
    the T new tokens' K/V go: one int for all rows, or an int32 [B] with each row's own.
    segment_ids_BxT (teacher forcing only) packs sequences in a row: 0 marks padding,
    1..k the k-th sequence; a token sees only earlier tokens of its own sequence, and
    positions_BxT should restart at 0 for each (positions_from_segments). prefix_ids_BxT
    (with segment ids) is a second segment each token also sees: a prompt packed once for
    the responses that continue it (hflax.controller.packing), positions then explicit.
    """
    if segment_ids_BxT is not None and cache is not None:
      raise ValueError("segment_ids_BxT is for teacher forcing: pass cache=None with it")
    if jnp.ndim(slot0) not in (0, 1):
      raise ValueError(f"slot0 must be an int or an int32 [B] array, got shape {jnp.shape(slot0)}")
    x = jnp.take(self.embed[...], tokens_BxT, axis=0).astype(jnp.dtype(self.cfg.dtype))
    cos, sin = rope_tables(self.cfg, positions_BxT, kv_valid_BxS.shape[1])
    new_cache = []
    with one_trace_per_call(x):  # the layers share their attention's, matmuls' ... traces
      for i, layer in enumerate(self.layers):
        x = rows_split(x)
        if self.cfg.remat and cache is None:
          x, layer_cache = remat_recorded(Block.__call__)(layer, x, cos, sin, kv_valid_BxS,
                                                          slot0, None, segment_ids_BxT,
                                                          prefix_ids_BxT)
        else:
          x, layer_cache = layer(x, cos, sin, kv_valid_BxS, slot0,
                                 None if cache is None else cache[i], segment_ids_BxT,
                                 prefix_ids_BxT)
        new_cache.append(layer_cache)
      return self.final_norm(x), (None if cache is None else new_cache)

  def logits(self, hidden_BxTxD):
    if self.head != "lm":
      raise ValueError("logits() needs head='lm'")
    if self.lm_head is None:
      return tied_logits(hidden_BxTxD, self.embed[...], hidden_BxTxD.dtype)
    return self.lm_head(hidden_BxTxD).astype(jnp.float32)

  def step_logits(self, hidden_BxD):
    """`logits` of a generation step's rows [B, D], through matmul.step_logits where the
    head's table is stored [V, D] (tied; a decoding copy's untied head too)."""
    if self.head == "lm" and self.lm_head is None:
      return step_logits(hidden_BxD, self.embed[...], hidden_BxD.dtype)
    return self.logits(hidden_BxD)

  def logits_projection(self):
    """hidden [..., D] -> float32 logits [..., V], as `logits`, with the head's weights
    made ready (cast to the compute dtype) once, for callers that project many chunks."""
    if self.head == "lm" and self.lm_head is None:
      return tied_head(self.embed[...], jnp.dtype(self.cfg.dtype))
    return self.logits

  def values(self, hidden_BxTxD):
    if self.head != "value":
      raise ValueError("values() needs head='value'")
    return self.score(hidden_BxTxD)[..., 0].astype(jnp.float32)


def rows_split(x):
  """x with its rows split over the context mesh's batch axes and everything else whole
  on each device (a no-op outside a mesh context: `jax.set_mesh`, `use_abstract_mesh`).
  Between layers this pins FSDP semantics: XLA then gathers each layer's weights instead
  of resharding the activations to match the weights' split (all-to-alls and activation
  all-reduces)."""
  mesh = jax.sharding.get_abstract_mesh()
  manual = {a for a, t in zip(mesh.axis_names, mesh.axis_types)
            if t == jax.sharding.AxisType.Manual}  # inside shard_map: already split
  axes = tuple(a for a in ROW_AXES
               if a in mesh.axis_names and mesh.shape[a] > 1 and a not in manual)
  if not axes:
    return x
  return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(axes))


def positions_from_mask(mask_BxT):
  """Position ids for left-padded rows: 0 at the first real token, pads clamped to 0."""
  return jnp.maximum(jnp.cumsum(mask_BxT.astype(jnp.int32), axis=-1) - 1, 0)


def positions_from_segments(segment_ids_BxT):
  """Position ids for packed rows: 0 at each sequence's first token, padding (id 0) at 0."""
  T = segment_ids_BxT.shape[-1]
  t = jnp.arange(T)
  prev = jnp.pad(segment_ids_BxT[..., :-1], [(0, 0)] * (segment_ids_BxT.ndim - 1) + [(1, 0)],
                 constant_values=-1)
  starts = jnp.where(segment_ids_BxT != prev, t, 0)
  pos = t - jax.lax.cummax(starts, axis=segment_ids_BxT.ndim - 1)
  return jnp.where(segment_ids_BxT > 0, pos, 0).astype(jnp.int32)


def init_cache(cfg: ModelConfig, batch: int, length: int, dtype=None):
  dtype = jnp.dtype(dtype or cfg.dtype)
  kv, hd = cfg.num_kv_heads, cfg.head_dim
  return [{"k": jnp.zeros((batch, kv, hd, length), key_cache_dtype(dtype)),
           "v": jnp.zeros((batch, kv, length, hd), dtype)} for _ in range(cfg.num_layers)]


_LORA_STREAM = 0x6C6F7261  # "lora"


def model_rngs(seed: int) -> nnx.Rngs:
  """The base weights draw from seed's stream, LoRA's A from a stream of its own."""
  return nnx.Rngs(seed, lora=jax.random.fold_in(jax.random.key(seed), _LORA_STREAM))


def create(cfg: ModelConfig, *, seed: int = 0, head: str = "lm"):
  """(graphdef, state) of a randomly initialised model."""
  return nnx.split(DecoderLM(cfg, rngs=model_rngs(seed), head=head))


def create_abstract(cfg: ModelConfig, *, head: str = "lm"):
  """(graphdef, state of ShapeDtypeStructs): the shapes, with no memory allocated."""
  return nnx.split(nnx.eval_shape(lambda: DecoderLM(cfg, rngs=model_rngs(0), head=head)))


def logical_axes(state):
  """The logical axis names of every parameter, as a pytree shaped like `state`."""
  return jax.tree.map(lambda v: v.get_metadata().get("axes"), state,
                      is_leaf=lambda x: isinstance(x, nnx.Variable))


def compute_kernels(graphdef, state) -> dict:
  """{path of a Dense module: its kernel cast to the compute dtype}, for every kernel
  dense_dot would otherwise cast on each call (matmul.compute_copy: 16-bit compute over
  wider kernels on CPU; {} elsewhere). An update makes them once, outside its loop over
  micro-batches, and hands them to forward: cast in each, SmolLM2's bf16 update converted
  its 106M float32 kernel weights once per micro-batch."""
  out = {}
  for path, m in nnx.iter_modules(nnx.merge(graphdef, state)):
    if isinstance(m, Dense):  # a training state's: a decoding copy is never trained
      low = compute_copy(m.kernel[...], m.dtype)
      if low is not None:
        out[path] = low
  return out


def _use_compute_kernels(model, kernels: dict):
  """Gives each Dense of `model` its kernel from compute_kernels (made for these params)."""
  for path, m in nnx.iter_modules(model):
    if path in kernels:
      if not isinstance(m, Dense) or kernels[path].shape != m.kernel[...].shape:
        raise ValueError(f"compute_kernels: {path} is not a Dense kernel of this model's shape")
      m.compute_kernel = nnx.data(kernels[path])


def forward(graphdef, state, tokens_BxT, mask_BxT, *, segment_ids_BxT=None, positions_BxT=None,
            prefix_ids_BxT=None, compute_kernels=None, routes_BxTxLxK=None):
  """Hidden states [B, T, D] of full sequences (teacher forcing); pads are masked out.

  With segment_ids_BxT (packed rows, see DecoderLM.__call__) the mask is segment_ids > 0
  and mask_BxT is not read; positions_BxT, if given, replace positions_from_segments (a
  response packed after a shared prompt, prefix_ids_BxT, continues the prompt's).
  compute_kernels: what the function of that name made from the same graphdef and state.
  routes_BxTxLxK (mixture of experts): each token's experts in each sparse layer to
  replay (moe.set_replay; -1: route afresh), e.g. those the rollout recorded.
  """
  model = nnx.merge(graphdef, state)
  if compute_kernels:
    _use_compute_kernels(model, compute_kernels)
  if routes_BxTxLxK is not None:
    set_replay(model, jnp.moveaxis(routes_BxTxLxK, 2, 0))
  if segment_ids_BxT is None:
    hidden, _ = model(tokens_BxT, positions_from_mask(mask_BxT), mask_BxT.astype(bool))
  else:
    if positions_BxT is None:
      positions_BxT = positions_from_segments(segment_ids_BxT)
    hidden, _ = model(tokens_BxT, positions_BxT, segment_ids_BxT > 0,
                      segment_ids_BxT=segment_ids_BxT, prefix_ids_BxT=prefix_ids_BxT)
  return model, hidden


def logits_fn(graphdef, state, tokens_BxT, mask_BxT):
  model, hidden = forward(graphdef, state, tokens_BxT, mask_BxT)
  return model.logits(hidden)
