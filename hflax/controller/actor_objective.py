"""The function of the parameters the actor's update differentiates: the policy's forward
over one micro-batch (padded rows or packed ones), and the actor's loss of its log-probs,
with a mixture of experts' load balance measured in the same forward.

The load balance (models.moe.balance) counts the micro-batch's real tokens, prompt and
response, as transformers counts the tokens its attention mask keeps: padded rows by their
attention mask, leaving out the rows that only pad a micro-batch to the data-parallel size
(no response token to train); packed rows by their segment ids (a prompt shared by its
samples is packed, and counted, once).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from hflax.controller.update_engine import FRESH
from hflax.models import moe
from hflax.models.forwards import packed_log_probs_fn
from hflax.models.logprobs import sequence_log_probs


def padded_loss(graphdef, loss, *, width: int, temperature: float, top_k: int):
  """loss_fn(params, fields, kernels) -> (loss, metrics) over padded rows; fields with
  "routes" replay a mixture of experts' recorded routes. top_k: the model's experts per
  token (0 for a dense model)."""
  def loss_fn(params, fields, kernels=None):
    with moe.recording() as record:
      logp, entropy = sequence_log_probs(graphdef, params, fields["input_ids"],
                                         fields["attention_mask"], temperature=temperature,
                                         last=width, compute_kernels=kernels,
                                         routes_BxTxLxK=fields.get("routes"))
    trained = jnp.any(fields["response_mask"] > 0, axis=1)
    tokens = fields["attention_mask"].astype(bool) & trained[:, None]
    return _with_balance(loss, logp, entropy, fields, moe.balance(record, top_k, tokens))
  return loss_fn


def packed_loss(graphdef, loss, *, temperature: float, top_k: int):
  """padded_loss over packed rows (controller.packing's fields)."""
  packed = packed_log_probs_fn(graphdef, temperature)

  def loss_fn(params, fields, kernels=None):
    with moe.recording() as record:
      logp, entropy = packed(params, fields, kernels)
    tokens = fields["segment_ids"] > 0
    return _with_balance(loss, logp, entropy, fields, moe.balance(record, top_k, tokens))
  return loss_fn


def _with_balance(loss, logp, entropy, fields, balance):
  fields = fresh_behaviour(logp, fields)
  if balance is None:  # a dense model: any actor loss of three arguments serves
    return loss(logp, entropy, fields)
  return loss(logp, entropy, fields, balance=balance)


def fresh_behaviour(logp, fields):
  """The loss's fields with the update's own forward (without gradient) as old_log_probs
  in its first mini-batch, which is exactly on-policy (see update_engine.FRESH)."""
  fresh = fields[FRESH][:, None] > 0
  return {**fields, "old_log_probs": jnp.where(fresh, jax.lax.stop_gradient(logp),
                                               fields["old_log_probs"])}
