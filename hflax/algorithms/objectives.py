"""The actor's and critic's training objectives, built from their config sections: what a
role worker's update minimises (policy loss, entropy bonus, KL loss; clipped value loss).

Sections are read with .get, so any mapping works:
  actor:  policy_loss, clip_ratio, clip_ratio_low, clip_ratio_high, clip_ratio_c,
          loss_agg_mode, entropy_coeff, use_kl_loss, kl_loss_coef, kl_loss_type,
          moe_aux_loss_coef
  critic: cliprange_value, loss_agg_mode
The actor's rollout correction (hflax.algorithms.correction) comes apart from its section:
it is verl's algorithm.rollout_correction.
"""
from __future__ import annotations

from hflax.algorithms.aggregation import aggregate_loss, aggregation_weight
from hflax.algorithms.correction import RolloutCorrection, apply_correction
from hflax.algorithms.kl import kl_loss
from hflax.algorithms.losses import entropy_loss, value_loss
from hflax.algorithms.registry import get_policy_loss


def actor_loss(cfg, correction: RolloutCorrection | None = None):
  """loss(log_probs, entropy, fields) -> (scalar, metrics) for ActorRolloutWorker.

  With `correction`, fields also hold "rollout_log_probs" and the policy loss per token is
  corrected from them against fields["old_log_probs"] (the behaviour policy's: in the
  update's first mini-batch its own forward, see update_engine.FRESH).

  balance: a mixture of experts' load balance in the same forward (models.moe.balance: its
  load-balancing loss "aux" and busiest expert "load_max"; None for a dense model). Both
  become metrics, and moe_aux_loss_coef x aux joins the loss, as transformers adds
  router_aux_loss_coef x aux_loss to a Qwen3-MoE's loss when it outputs router logits."""
  policy_loss = get_policy_loss(cfg.get("policy_loss", "vanilla"))
  mode = cfg.get("loss_agg_mode", "token-mean")
  entropy_coeff = cfg.get("entropy_coeff", 0.0)
  use_kl_loss, kl_coef = cfg.get("use_kl_loss", False), cfg.get("kl_loss_coef", 0.001)
  kl_type = cfg.get("kl_loss_type", "low_var_kl")
  aux_coef = cfg.get("moe_aux_loss_coef", 0.0)

  def loss(log_probs, entropy, f, balance=None):
    mask = f["response_mask"]
    per_token, metrics = policy_loss(
        {"log_probs": log_probs, "old_log_probs": f["old_log_probs"],
         "advantages": f["advantages"], "response_mask": mask}, cfg)
    if correction is not None:
      per_token, corrected = apply_correction(per_token, f["old_log_probs"],
                                              f["rollout_log_probs"], mask, correction)
      metrics = {**metrics, **corrected}
    pg_loss = aggregate_loss(per_token, mask, mode)
    # The entropy bonus is aggregated like the policy loss (verl's agg_loss on both).
    metrics = {**metrics, "pg_loss": pg_loss, "entropy": entropy_loss(entropy, mask, mode)}
    total = pg_loss - entropy_coeff * metrics["entropy"]
    if use_kl_loss:
      metrics["kl_loss"] = kl_loss(log_probs, f["ref_log_prob"], mask, kl_type, mode)
      total = total + kl_coef * metrics["kl_loss"]
    if balance is not None:
      metrics["moe_aux_loss"] = balance["aux"]
      metrics["moe_expert_load_max"] = balance["load_max"]
      if aux_coef:
        total = total + aux_coef * balance["aux"]
    return total, metrics

  loss.micro_batch_weight = _weight(mode)
  return loss


def _weight(mode):
  """For the update's micro-batch accumulation (controller.training.make_train_step)."""
  return lambda f: aggregation_weight(f["response_mask"], mode)


def critic_loss(cfg):
  """loss(values, fields) -> (scalar, metrics) for CriticWorker."""
  clip, mode = cfg.get("cliprange_value", 0.5), cfg.get("loss_agg_mode", "token-mean")

  def loss(values, f):
    mask = f["response_mask"]
    per_token, metrics = value_loss(values, f["values"], f["returns"], mask,
                                        cliprange_value=clip)
    vf_loss = aggregate_loss(per_token, mask, mode)
    return vf_loss, {**metrics, "vf_loss": vf_loss}

  loss.micro_batch_weight = _weight(mode)
  return loss
