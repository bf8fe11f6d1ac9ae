"""Actor and critic losses: PPO clip (symmetric, clip-higher, dual-clip), GSPO, CISPO,
SAPO, GMPO, clipped value loss, entropy bonus.

Policy losses return (loss_BxT, metrics): the per-token loss, 0 outside the response, to
be reduced with `aggregate_loss`, and scalar metrics under verl's names:
  pg_clipfrac        fraction of valid tokens where the clipped term is the active one
                     (CISPO: whose weight is clipped; SAPO, which never clips: 0)
  pg_clipfrac_lower  fraction of valid tokens where the dual-clip bound is active
  ppo_kl             masked mean of old_log_prob - log_prob (0 on an on-policy step)
Log-probs are [B, T] per-token log-probs of the sampled response tokens.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from hflax.algorithms.aggregation import aggregate_loss
from hflax.algorithms.masked import f32, masked_mean, masked_var

# The log-ratio is clamped before exp so a stale token cannot overflow the ratio.
LOG_RATIO_CLAMP = 20.0
GSPO_LOG_RATIO_MAX = 10.0


def ppo_clip_loss(log_probs_BxT, old_log_probs_BxT, advantages_BxT, response_mask_BxT, *,
                  clip_ratio: float = 0.2, clip_ratio_low=None, clip_ratio_high=None,
                  clip_ratio_c=None):
  """PPO clipped surrogate, per token: max(-A r, -A clip(r, 1 - low, 1 + high)).

  r = exp(log_prob - old_log_prob). clip_ratio_low / clip_ratio_high default to
  clip_ratio; a larger high bound is DAPO's clip-higher. clip_ratio_c (> 1, e.g. 3.0)
  turns on dual-clip: where A < 0 the loss is further capped at -A * clip_ratio_c, so
  a token whose ratio exploded cannot dominate the update. None disables it.
  """
  low = clip_ratio if clip_ratio_low is None else clip_ratio_low
  high = clip_ratio if clip_ratio_high is None else clip_ratio_high
  mask_BxT = f32(response_mask_BxT)
  advantages_BxT = f32(advantages_BxT)
  log_ratio_BxT = jnp.clip(f32(log_probs_BxT) - f32(old_log_probs_BxT),
                           -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  ratio_BxT = jnp.exp(log_ratio_BxT)
  unclipped_BxT = -advantages_BxT * ratio_BxT
  clipped_BxT = -advantages_BxT * jnp.clip(ratio_BxT, 1.0 - low, 1.0 + high)
  loss_BxT = jnp.maximum(unclipped_BxT, clipped_BxT)
  metrics = {"pg_clipfrac": masked_mean(clipped_BxT > unclipped_BxT, mask_BxT),
             "ppo_kl": masked_mean(-log_ratio_BxT, mask_BxT)}
  if clip_ratio_c is None:
    metrics["pg_clipfrac_lower"] = jnp.zeros((), jnp.float32)
  else:
    if clip_ratio_c <= 1.0:
      raise ValueError(f"clip_ratio_c must be > 1 for dual-clip, got {clip_ratio_c}")
    cap_BxT = -advantages_BxT * clip_ratio_c
    negative_BxT = advantages_BxT < 0
    metrics["pg_clipfrac_lower"] = masked_mean((loss_BxT > cap_BxT) & negative_BxT, mask_BxT)
    loss_BxT = jnp.where(negative_BxT, jnp.minimum(loss_BxT, cap_BxT), loss_BxT)
  return loss_BxT * mask_BxT, metrics


def gspo_loss(log_probs_BxT, old_log_probs_BxT, advantages_BxT, response_mask_BxT, *,
              clip_ratio_low: float = 3e-4, clip_ratio_high: float = 4e-4):
  """GSPO: PPO clipping on the sequence-level importance ratio.

  s_i = exp(mean over the valid tokens of sequence i of (log_prob - old_log_prob)).
  Per token the ratio is s_i * pi(y_t) / sg(pi(y_t)) (sg = stop-gradient): its value is
  s_i on every token while token t's gradient is that of log pi(y_t) scaled by s_i, as
  in the GSPO paper's token-level form (GSPO-token). The default clip ranges are the
  paper's (they are on a sequence ratio, hence tiny). The paper averages tokens within a
  sequence, then over sequences: aggregate with "seq-mean-token-mean".
  """
  mask_BxT = f32(response_mask_BxT)
  advantages_BxT = f32(advantages_BxT)
  log_probs_BxT = f32(log_probs_BxT)
  log_ratio_BxT = log_probs_BxT - f32(old_log_probs_BxT)
  seq_log_ratio_B = (jnp.sum(log_ratio_BxT * mask_BxT, axis=-1) /
                     jnp.maximum(jnp.sum(mask_BxT, axis=-1), 1.0))
  token_log_ratio_BxT = (log_probs_BxT - jax.lax.stop_gradient(log_probs_BxT) +
                         jax.lax.stop_gradient(seq_log_ratio_B)[:, None])
  ratio_BxT = jnp.exp(jnp.minimum(token_log_ratio_BxT, GSPO_LOG_RATIO_MAX))
  unclipped_BxT = -advantages_BxT * ratio_BxT
  clipped_BxT = -advantages_BxT * jnp.clip(ratio_BxT, 1.0 - clip_ratio_low,
                                           1.0 + clip_ratio_high)
  loss_BxT = jnp.maximum(unclipped_BxT, clipped_BxT)
  metrics = {"pg_clipfrac": masked_mean(clipped_BxT > unclipped_BxT, mask_BxT),
             "pg_clipfrac_lower": jnp.zeros((), jnp.float32),
             "ppo_kl": masked_mean(-log_ratio_BxT, mask_BxT)}
  return loss_BxT * mask_BxT, metrics


def cispo_loss(log_probs_BxT, old_log_probs_BxT, advantages_BxT, response_mask_BxT, *,
               clip_ratio_low: float = 1.0, clip_ratio_high: float = 0.2):
  """CISPO (MiniMax-M1, arXiv:2506.13585, eqs. 4-5), per token:

    -sg(clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high)) * A * log_prob

  r = exp(log_prob - old_log_prob), sg = stop-gradient. The clipped ratio is only a
  weight on a REINFORCE term, so unlike PPO no token loses its gradient: a clipped
  token's gradient is capped, not zeroed. clip_ratio_low = 1 (a lower bound of 0) is no
  lower bound, as the paper runs it ("we only tuned eps_high").
  """
  mask_BxT = f32(response_mask_BxT)
  log_probs_BxT = f32(log_probs_BxT)
  log_ratio_BxT = jnp.clip(log_probs_BxT - f32(old_log_probs_BxT),
                           -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  ratio_BxT = jnp.exp(log_ratio_BxT)
  weight_BxT = jnp.clip(ratio_BxT, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
  loss_BxT = -jax.lax.stop_gradient(weight_BxT) * f32(advantages_BxT) * log_probs_BxT
  metrics = {"pg_clipfrac": masked_mean(weight_BxT != ratio_BxT, mask_BxT),
             "pg_clipfrac_lower": jnp.zeros((), jnp.float32),
             "ppo_kl": masked_mean(-log_ratio_BxT, mask_BxT)}
  return loss_BxT * mask_BxT, metrics


def sapo_loss(log_probs_BxT, old_log_probs_BxT, advantages_BxT, response_mask_BxT, *,
              tau_pos: float = 1.0, tau_neg: float = 1.05):
  """SAPO (Qwen, arXiv:2511.20347), per token: -f(r) * A with the soft gate

    f(r) = sigmoid(tau * (r - 1)) * 4 / tau,  tau = tau_pos if A > 0 else tau_neg.

  In place of PPO's hard clip, the gradient is -w r A grad(log pi) with the soft weight
  w = 4 sigmoid (1 - sigmoid) (PPO's unclipped surrogate: w = 1, cut to 0 past a bound):
  w is 1 at r = 1, so the on-policy gradient is PPO's and REINFORCE's, and decays
  smoothly as r leaves 1, faster for a larger tau. f(1) = 2 / tau, so pg_loss reads
  -2 A / tau on-policy, not PPO's -A. The paper's tau_neg > tau_pos damps the
  negative-advantage updates, which it finds the less stable. Its objective averages
  tokens within a sequence, then sequences (loss_agg_mode "seq-mean-token-mean").
  """
  mask_BxT = f32(response_mask_BxT)
  advantages_BxT = f32(advantages_BxT)
  log_ratio_BxT = jnp.clip(f32(log_probs_BxT) - f32(old_log_probs_BxT),
                           -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
  tau_BxT = jnp.where(advantages_BxT > 0, tau_pos, tau_neg)
  gate_BxT = jax.nn.sigmoid(tau_BxT * (jnp.exp(log_ratio_BxT) - 1.0)) * (4.0 / tau_BxT)
  metrics = {"pg_clipfrac": jnp.zeros((), jnp.float32),
             "pg_clipfrac_lower": jnp.zeros((), jnp.float32),
             "ppo_kl": masked_mean(-log_ratio_BxT, mask_BxT)}
  return -gate_BxT * advantages_BxT * mask_BxT, metrics


def gmpo_loss(log_probs_BxT, old_log_probs_BxT, advantages_BxT, response_mask_BxT, *,
              clip_ratio_low: float = 0.4, clip_ratio_high: float = 0.4):
  """GMPO (Zhao et al., arXiv:2507.20673): the geometric mean of a sequence's token
  ratios, each clipped in log space to [-clip_ratio_low, clip_ratio_high], pessimistically:

    loss_i = -A_i * exp(mean_t c_t),  c_t = min(log r_t, high) if A_i > 0
                                            max(log r_t, -low) otherwise

  (the paper's |min(r A, clip(r, e^-low, e^high) A)| product to the power 1/|o_i|, times
  sgn(A_i)). A_i is the mean advantage over the sequence's valid tokens (GRPO's outcome
  advantage is constant along it). The paper's range is (e^-0.4, e^0.4). Each valid token
  carries loss_i, so "seq-mean-token-mean" aggregation gives the paper's mean over
  sequences, and each token's gradient is -A_i * exp(mean c) / |o_i| where unclipped.
  """
  mask_BxT = f32(response_mask_BxT)
  log_ratio_BxT = f32(log_probs_BxT) - f32(old_log_probs_BxT)
  count_B = jnp.maximum(jnp.sum(mask_BxT, axis=-1), 1.0)
  advantage_B = jnp.sum(f32(advantages_BxT) * mask_BxT, axis=-1) / count_B
  clipped_BxT = jnp.where((advantage_B > 0)[:, None],
                          jnp.minimum(log_ratio_BxT, clip_ratio_high),
                          jnp.maximum(log_ratio_BxT, -clip_ratio_low))
  seq_log_ratio_B = jnp.sum(clipped_BxT * mask_BxT, axis=-1) / count_B
  # Only a negative advantage leaves the log-ratio unbounded above: clamp before exp.
  loss_B = -advantage_B * jnp.exp(jnp.minimum(seq_log_ratio_B, LOG_RATIO_CLAMP))
  metrics = {"pg_clipfrac": masked_mean(clipped_BxT != log_ratio_BxT, mask_BxT),
             "pg_clipfrac_lower": jnp.zeros((), jnp.float32),
             "ppo_kl": masked_mean(-log_ratio_BxT, mask_BxT)}
  return loss_B[:, None] * mask_BxT, metrics


def value_loss(values_BxT, old_values_BxT, returns_BxT, response_mask_BxT, *,
               cliprange_value: float = 0.5):
  """Per-token clipped value loss 0.5 * max((v - R)^2, (clip(v, v_old +- c) - R)^2).

  Clipping keeps the critic near the values the advantages were computed with. Returns
  (loss_BxT, {"vf_clipfrac": fraction of valid tokens where the clipped term is larger}).
  Reduce it with `aggregate_loss`.
  """
  values_BxT, old_values_BxT = f32(values_BxT), f32(old_values_BxT)
  returns_BxT, mask_BxT = f32(returns_BxT), f32(response_mask_BxT)
  clipped_values_BxT = jnp.clip(values_BxT, old_values_BxT - cliprange_value,
                                old_values_BxT + cliprange_value)
  unclipped_BxT = jnp.square(values_BxT - returns_BxT)
  clipped_BxT = jnp.square(clipped_values_BxT - returns_BxT)
  loss_BxT = 0.5 * jnp.maximum(unclipped_BxT, clipped_BxT) * mask_BxT
  return loss_BxT, {"vf_clipfrac": masked_mean(clipped_BxT > unclipped_BxT, mask_BxT)}


def explained_variance(values_BxT, returns_BxT, response_mask_BxT, eps: float = 1e-5):
  """1 - Var(returns - values) / (Var(returns) + eps) over valid tokens (1 is perfect)."""
  returns_BxT = f32(returns_BxT)
  residual_var = masked_var(returns_BxT - f32(values_BxT), response_mask_BxT)
  return 1.0 - residual_var / (masked_var(returns_BxT, response_mask_BxT) + eps)


def entropy_from_logits(logits_BxTxV, temperature: float = 1.0):
  """Entropy of softmax(logits / temperature) per position: [B, T], in float32."""
  logits = jnp.asarray(logits_BxTxV).astype(jnp.float32) / temperature
  log_z = jax.nn.logsumexp(logits, axis=-1)
  probs = jnp.exp(logits - log_z[..., None])
  # Filtered (-inf) logits have probability 0, and 0 * -inf is NaN: zero them before the
  # product, as a where after it would still send NaN back through the gradient.
  finite = jnp.where(jnp.isfinite(logits), logits, 0.0)
  return log_z - jnp.sum(probs * finite, axis=-1)


def entropy_loss(entropy_BxT, response_mask_BxT, mode: str = "token-mean"):
  """Aggregated entropy (a scalar, >= 0). The actor minimises pg_loss - coef * this."""
  return aggregate_loss(entropy_BxT, response_mask_BxT, mode)
