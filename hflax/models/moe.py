"""Qwen3-MoE's and Qwen2-MoE's sparse MLP: a top-k router over stacked SwiGLU experts.

The router is HF's: logits in the compute dtype, a softmax over all experts in float32,
the top k of those probabilities, renormalised to sum to 1 when norm_topk_prob. How the
picked experts are computed (ModelConfig.moe_dispatch: every expert on every token,
grouped by expert, or exchanged all-to-all over an "expert" mesh axis) is
hflax.models.experts; all give the same function and the router its gradient through the
combine weights.

Qwen2-MoE adds a shared expert: a dense SwiGLU MLP every token runs through, scaled by
sigmoid(x @ shared_expert_gate) and added to the routed experts' sum (HF's order). The
model builds it (a transformer MLP and Dense) and hands it in, so this module stays below
the transformer's.

LoRA (ModelConfig.lora_targets naming gate_proj, up_proj or down_proj, unless
ModelConfig.lora_experts is False): each adapted
projection's stack gets LoRAParams <proj>_lora_a [E, in, r] and <proj>_lora_b [E, r, out],
one pair an expert, split over the expert axis as the stack is, B zero at first; the
dispatch adds scale x A_e B_e to expert e's kernel (hflax.models.experts). The router is
adapted only where lora_targets names it ("gate", HF's mlp.gate: router_lora_a [D, r],
router_lora_b [r, E]); the shared expert is a dense MLP and takes the dense MLP's adapters.

Routing replay: a module's `replay` (set by `set_replay` before a call) replaces the
top-k choice with given expert indices; the combine weights are still the current
router's probabilities at those indices (renormalised the same way), so the router gets
its gradient. Inside `recording()` every call appends the indices it used and its router
logits to the recorder (a list, not the module: a decode loop's body may not mutate a
module made outside it), for the rollout to keep and for the load-balancing loss.
"""
from __future__ import annotations

import contextlib
import functools
import threading

import jax
import jax.numpy as jnp
from flax import nnx

from hflax.models.config import LORA_ROUTER, ModelConfig
from hflax.models.experts import DISPATCH
from hflax.models.matmul import dense_dot

_INIT = jax.nn.initializers.normal(0.02)


class SparseMoE(nnx.Module):
  def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, shared_expert=None,
               shared_expert_gate=None):
    e, d, f = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size

    def param(shape, axes):
      return nnx.Param(_INIT(rngs.params(), shape, cfg.param_dtype), axes=axes)

    # Stored [in, out] like Dense's kernels; the expert axis first so it can be split.
    self.router = param((d, e), ("embed", None))
    self.gate = param((e, d, f), ("expert", "embed", "expert_mlp"))
    self.up = param((e, d, f), ("expert", "embed", "expert_mlp"))
    self.down = param((e, f, d), ("expert", "expert_mlp", "embed"))
    for proj, (din, dout), axes in (("gate", (d, f), ("embed", "expert_mlp")),
                                    ("up", (d, f), ("embed", "expert_mlp")),
                                    ("down", (f, d), ("expert_mlp", "embed"))):
      on = f"{proj}_proj" in cfg.lora_targets and cfg.lora_experts
      a, b = _expert_lora_pair(e, din, dout, axes, cfg, rngs) if on else (None, None)
      setattr(self, f"{proj}_lora_a", a)
      setattr(self, f"{proj}_lora_b", b)
    router_lora = LORA_ROUTER in cfg.lora_targets
    self.router_lora_a, self.router_lora_b = (
        _lora_pair(d, e, ("embed", None), cfg, rngs) if router_lora else (None, None))
    self.lora_scale = cfg.lora_scale
    self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
    self.dtype = jnp.dtype(cfg.dtype)
    # "dense", "sorted" or "all_to_all" (ModelConfig.moe_dispatch, hflax.models.experts)
    self.dispatch, self.capacity_factor = cfg.moe_dispatch, cfg.moe_capacity_factor
    # An input of the next call, never part of the state: expert indices to replay
    # ([..., k] int32, shaped like the tokens; set_replay).
    self.replay = nnx.data(None)
    # Qwen2-MoE's shared expert (an MLP module) and its gate (a Dense to one output), or None.
    self.shared_expert, self.shared_expert_gate = shared_expert, shared_expert_gate

  def __call__(self, x_BxTxD):
    logits = dense_dot(x_BxTxD, self.router[...], self.dtype)
    if self.router_lora_a is not None:
      low = dense_dot(x_BxTxD, self.router_lora_a[...], self.dtype)
      logits = logits + self.lora_scale * dense_dot(low, self.router_lora_b[...], self.dtype)
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, routes = jax.lax.top_k(probs, self.top_k)
    if self.replay is not None:
      replay = jnp.asarray(self.replay, jnp.int32)
      if replay.shape != routes.shape:
        raise ValueError(f"replayed routes have shape {replay.shape}, the tokens need "
                         f"{routes.shape}")
      # A token whose recorded route is -1 (never fed to the model by the rollout: a
      # response's last token, padding) is routed afresh.
      routes = jnp.where(replay[..., :1] >= 0, replay, routes)
      weights = jnp.take_along_axis(probs, routes, axis=-1)
    if self.norm_topk_prob:
      weights = weights / weights.sum(axis=-1, keepdims=True)
    if getattr(_recorders, "stack", None):
      _recorders.stack[-1].append((routes, logits))
    x = x_BxTxD.astype(self.dtype)
    kernels = [w[...].astype(self.dtype) for w in (self.gate, self.up, self.down)]
    experts = DISPATCH[self.dispatch]
    if self.dispatch == "all_to_all":
      experts = functools.partial(experts, capacity_factor=self.capacity_factor)
    out = experts(x, routes, weights.astype(self.dtype), *kernels, self.adapters())
    if self.shared_expert is not None:
      out = out + jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
    return out


  def adapters(self) -> dict:
    """{projection: (A, scale x B)} in the compute dtype, for the adapted projections."""
    out = {}
    for proj in ("gate", "up", "down"):
      a, b = getattr(self, f"{proj}_lora_a"), getattr(self, f"{proj}_lora_b")
      if a is not None:
        out[proj] = (a[...].astype(self.dtype), (self.lora_scale * b[...]).astype(self.dtype))
    return out


def _expert_lora_pair(experts, din, dout, axes, cfg: ModelConfig, rngs: nnx.Rngs):
  """One LoRA pair an expert, stacked on the expert axis: PEFT's initialisation of each
  (A ~ U(+-1/sqrt(din)) from the LoRA stream, B = 0), so the model starts as the base."""
  bound, r = din ** -0.5, cfg.lora_rank
  a = jax.random.uniform(rngs.lora(), (experts, din, r), cfg.param_dtype, -bound, bound)
  return (nnx.LoRAParam(a, axes=("expert", axes[0], None)),
          nnx.LoRAParam(jnp.zeros((experts, r, dout), cfg.param_dtype),
                        axes=("expert", None, axes[1])))


def _lora_pair(din, dout, axes, cfg: ModelConfig, rngs: nnx.Rngs):
  """The router's LoRA pair, initialised as PEFT's (and the transformer's Dense's)."""
  bound, r = din ** -0.5, cfg.lora_rank
  a = jax.random.uniform(rngs.lora(), (din, r), cfg.param_dtype, -bound, bound)
  return (nnx.LoRAParam(a, axes=(axes[0], None)),
          nnx.LoRAParam(jnp.zeros((r, dout), cfg.param_dtype), axes=(None, axes[1])))


def sparse_modules(model) -> list[SparseMoE]:
  """The model's MoE modules, in layer order."""
  return [m for _, m in nnx.iter_modules(model) if isinstance(m, SparseMoE)]


def set_replay(model, routes_LxBxTxK) -> None:
  """Makes each sparse layer route by the given experts ([sparse layers, ..., k] int32, in
  layer order, -1 for a token to route afresh; what `stacked` returned for the same
  tokens); None: route afresh."""
  modules = sparse_modules(model)
  if routes_LxBxTxK is not None and len(routes_LxBxTxK) != len(modules):
    raise ValueError(f"replayed routes cover {len(routes_LxBxTxK)} layers, the model has "
                     f"{len(modules)} sparse layers")
  for i, m in enumerate(modules):
    m.replay = nnx.data(None if routes_LxBxTxK is None else routes_LxBxTxK[i])


_recorders = threading.local()


@contextlib.contextmanager
def recording():
  """Within it, each sparse layer's call appends (routes [..., k], router logits [..., E])
  to the list it yields, in call order (layer order for one model call). Use the values
  in the same trace they were made in (inside a loop's body for a call in that body)."""
  stack = _recorders.__dict__.setdefault("stack", [])
  stack.append([])
  try:
    yield stack[-1]
  finally:
    stack.pop()


def remat_recorded(call):
  """nnx.remat(call), whose sparse layers' records come out of the rematerialised trace
  as its results and join the caller's recorder (appended from inside, they would be
  tracers of that trace, leaked)."""
  def inner(*args):
    with recording() as record:
      out = call(*args)
    return out, list(record)

  def outer(*args):
    out, record = nnx.remat(inner)(*args)
    if getattr(_recorders, "stack", None):
      _recorders.stack[-1].extend(record)
    return out
  return outer


def stacked(record):
  """(routes [sparse layers, ..., k] int32, router logits [sparse layers, ..., E]) of one
  model call's record; (None, None) for a dense model."""
  if not record:
    return None, None
  return jnp.stack([r for r, _ in record]), jnp.stack([lg for _, lg in record])


def rows_first(routes_LxBxTxK):
  """[sparse layers, B, T, k] -> [B, T, sparse layers, k]: a batch field's layout (rows
  first, so it splits, packs and pads like the tokens)."""
  return jnp.moveaxis(routes_LxBxTxK, 0, 2)


def load_balancing_loss(router_logits_LxBxTxE, top_k: int, mask_BxT=None):
  """The Switch Transformer auxiliary loss as transformers' load_balancing_loss_func
  computes it for Qwen3-MoE: over all sparse layers' (unpadded) tokens together,
  E x sum_e (share of top-k assignments to e) x (mean router probability of e), the
  assignment shares summing to k."""
  probs = jax.nn.softmax(router_logits_LxBxTxE.astype(jnp.float32), axis=-1)
  n = probs.shape[-1]
  _, top = jax.lax.top_k(probs, top_k)
  assigned = jax.nn.one_hot(top, n, dtype=jnp.float32).sum(axis=-2)  # [L, B, T, E]
  if mask_BxT is None:
    mask_BxT = jnp.ones(probs.shape[1:-1], jnp.float32)
  w = jnp.broadcast_to(mask_BxT.astype(jnp.float32)[None, ..., None], probs.shape[:-1] + (1,))
  rows = w.sum()
  tokens_per_expert = (assigned * w).sum(axis=(0, 1, 2)) / rows
  prob_per_expert = (probs * w).sum(axis=(0, 1, 2)) / rows
  return n * jnp.sum(tokens_per_expert * prob_per_expert)


def balance(record, top_k: int, mask_BxT):
  """The load balance of one model call's record over its unpadded tokens (mask [B, T]),
  for the actor's loss and metrics; None for a dense model (an empty record):
    "aux": load_balancing_loss, which the actor adds times actor.moe_aux_loss_coef;
    "load_max": the busiest expert's share of its layer's top-k picks (by the current
      router, as the aux loss counts them) against an even share, the worst layer's
      (1: balanced, E/k: one expert takes every token's first pick)."""
  if not record:
    return None
  _, logits = stacked(record)
  probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
  n = probs.shape[-1]
  picks = jax.nn.one_hot(jax.lax.top_k(probs, top_k)[1], n, dtype=jnp.float32).sum(-2)
  w = mask_BxT.astype(jnp.float32)[None, ..., None]
  per_layer = (picks * w).sum(axis=(1, 2))  # [L, E]
  even = per_layer.sum(-1, keepdims=True) / n
  return {"aux": load_balancing_loss(logits, top_k, mask_BxT),
          "load_max": jnp.max(per_layer / jnp.maximum(even, 1e-9))}
