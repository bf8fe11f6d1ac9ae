"""Rollout correction: importance weights between the policy that sampled a batch (the
rollout's recorded log-probs) and the policy the trainer takes as the behaviour one (its
old log-probs), for off-policy samples (one-step-off and asynchronous training, or a
generation dtype that rounds differently from training).

Names follow verl's `algorithm.rollout_correction` section:
  rollout_is                 None | "token" | "sequence": truncated importance sampling
                             (TIS), each token's loss times min(w, rollout_is_threshold)
  rollout_is_threshold       the cap of TIS (verl's default 2.0)
  rollout_rs                 None | "token" | "sequence" | "geometric": masked importance
                             sampling (MIS; IcePop at token level): tokens, or whole
                             sequences, whose w falls outside [lower, upper] leave the loss
  rollout_rs_threshold       upper (verl's default 2.0)
  rollout_rs_threshold_lower lower (None: 1 / upper)

with, per response token t of sequence i (mask m, clamped to [-20, 20] before exp):
  log w_it = old_log_prob_it - rollout_log_prob_it                          ("token")
  log w_i  = sum_t m_it log w_it                                           ("sequence")
  log w_i  = sum_t m_it log w_it / sum_t m_it                             ("geometric")

Weights carry no gradient. A masked-out token's loss is 0 while the loss keeps its
denominator (the response's tokens), so micro-batch weighting is unchanged.

Metrics (under "rollout_corr/", as verl's): k3_kl, the mismatch KL(rollout || old) by the
k3 estimator mean(w - 1 - log w) over tokens; rollout_is_mean/min/max of the token ratios
w; rollout_rs_masked_fraction; and `staleness_histogram` of the rows' weight versions.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from hflax.algorithms.masked import f32, masked_mean

LOG_W_CLAMP = 20.0
IS_LEVELS = ("token", "sequence")
RS_LEVELS = ("token", "sequence", "geometric")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RolloutCorrection:
  rollout_is: str | None = None
  rollout_is_threshold: float = 2.0
  rollout_rs: str | None = None
  rollout_rs_threshold: float = 2.0
  rollout_rs_threshold_lower: float | None = None

  def __post_init__(self):
    problem = correction_problem(dataclasses.asdict(self))
    if problem:
      raise ValueError(f"rollout_correction.{problem[0]}: {problem[1]}")

  @property
  def enabled(self) -> bool:
    return self.rollout_is is not None or self.rollout_rs is not None

  @property
  def bounds(self) -> tuple[float, float]:
    upper = self.rollout_rs_threshold
    lower = self.rollout_rs_threshold_lower
    return (1.0 / upper if lower is None else lower), upper


def correction_problem(section) -> tuple[str, str] | None:
  """(field, why) for the first bad field of a rollout_correction mapping, else None."""
  get = section.get
  if get("rollout_is") not in (None, *IS_LEVELS):
    return "rollout_is", f"{get('rollout_is')!r} is not None or one of {IS_LEVELS}"
  if get("rollout_rs") not in (None, *RS_LEVELS):
    return "rollout_rs", f"{get('rollout_rs')!r} is not None or one of {RS_LEVELS}"
  cap = get("rollout_is_threshold", 2.0)
  if not (isinstance(cap, (int, float)) and cap > 0):
    return "rollout_is_threshold", f"the TIS cap must be > 0, got {cap!r}"
  upper, lower = get("rollout_rs_threshold", 2.0), get("rollout_rs_threshold_lower")
  if not (isinstance(upper, (int, float)) and upper > 0):
    return "rollout_rs_threshold", f"the upper bound must be > 0, got {upper!r}"
  if lower is not None and not (isinstance(lower, (int, float)) and 0 <= lower <= upper):
    return ("rollout_rs_threshold_lower", f"must be in [0, rollout_rs_threshold={upper}], "
            f"got {lower!r}")
  return None


def log_weights(old_log_probs_BxT, rollout_log_probs_BxT, response_mask_BxT, level: str):
  """log w per token ("token") or per sequence broadcast over its tokens; 0 off the mask."""
  mask_BxT = f32(response_mask_BxT)
  log_w_BxT = (f32(old_log_probs_BxT) - f32(rollout_log_probs_BxT)) * mask_BxT
  if level == "token":
    out_BxT = log_w_BxT
  else:
    seq_B = jnp.sum(log_w_BxT, axis=-1)
    if level == "geometric":
      seq_B = seq_B / jnp.maximum(jnp.sum(mask_BxT, axis=-1), 1.0)
    elif level != "sequence":
      raise ValueError(f"unknown correction level {level!r}; valid: {RS_LEVELS}")
    out_BxT = jnp.broadcast_to(seq_B[:, None], mask_BxT.shape)
  return jnp.clip(out_BxT, -LOG_W_CLAMP, LOG_W_CLAMP) * mask_BxT


def truncated_weights(old_log_probs_BxT, rollout_log_probs_BxT, response_mask_BxT, *,
                      level: str = "token", threshold: float = 2.0):
  """TIS: min(w, threshold) per token, 0 off the mask, without gradient."""
  log_w_BxT = log_weights(old_log_probs_BxT, rollout_log_probs_BxT, response_mask_BxT, level)
  w_BxT = jnp.minimum(jnp.exp(log_w_BxT), threshold) * f32(response_mask_BxT)
  return jax.lax.stop_gradient(w_BxT)


def rejection_mask(old_log_probs_BxT, rollout_log_probs_BxT, response_mask_BxT, *,
                   level: str = "token", lower: float = 0.5, upper: float = 2.0):
  """MIS / IcePop: 1 where w (of the token, or of its sequence) lies in [lower, upper] and
  the token is in the response, else 0."""
  w_BxT = jnp.exp(log_weights(old_log_probs_BxT, rollout_log_probs_BxT, response_mask_BxT,
                              level))
  keep_BxT = (w_BxT >= lower) & (w_BxT <= upper)
  return jax.lax.stop_gradient(keep_BxT.astype(jnp.float32) * f32(response_mask_BxT))


def mismatch_metrics(old_log_probs_BxT, rollout_log_probs_BxT, response_mask_BxT) -> dict:
  """k3 KL(rollout || old) and the token ratios' mean/min/max over the response tokens
  (min and max are 1 where no token is in the response)."""
  mask_BxT = f32(response_mask_BxT)
  log_w_BxT = log_weights(old_log_probs_BxT, rollout_log_probs_BxT, mask_BxT, "token")
  w_BxT = jnp.exp(log_w_BxT)
  valid_BxT = mask_BxT > 0
  # w - 1 - log w as expm1(log w) - log w: exact for the tiny log-ratios of one version's lag
  return {"rollout_corr/k3_kl": masked_mean(jnp.expm1(log_w_BxT) - log_w_BxT, mask_BxT),
          "rollout_corr/rollout_is_mean": masked_mean(w_BxT, mask_BxT),
          "rollout_corr/rollout_is_min": _extreme(jnp.min, w_BxT, valid_BxT),
          "rollout_corr/rollout_is_max": _extreme(jnp.max, w_BxT, valid_BxT)}


def _extreme(reduce, w_BxT, valid_BxT):
  # 1 (the on-policy ratio) where nothing is valid: a micro-batch of padding rows must not
  # put an inf into the averaged metrics.
  any_valid = jnp.any(valid_BxT)
  return jnp.where(any_valid, reduce(jnp.where(valid_BxT, w_BxT, 1.0)), 1.0)


def apply_correction(loss_BxT, old_log_probs_BxT, rollout_log_probs_BxT, response_mask_BxT,
                     cfg: RolloutCorrection):
  """(corrected per-token loss, metrics): the loss times the TIS weights and the MIS mask
  of `cfg` (each only where selected)."""
  metrics = mismatch_metrics(old_log_probs_BxT, rollout_log_probs_BxT, response_mask_BxT)
  if cfg.rollout_is is not None:
    loss_BxT = loss_BxT * truncated_weights(old_log_probs_BxT, rollout_log_probs_BxT,
                                            response_mask_BxT, level=cfg.rollout_is,
                                            threshold=cfg.rollout_is_threshold)
  if cfg.rollout_rs is not None:
    lower, upper = cfg.bounds
    keep_BxT = rejection_mask(old_log_probs_BxT, rollout_log_probs_BxT, response_mask_BxT,
                              level=cfg.rollout_rs, lower=lower, upper=upper)
    loss_BxT = loss_BxT * keep_BxT
    metrics["rollout_corr/rollout_rs_masked_fraction"] = masked_mean(1.0 - keep_BxT,
                                                                     response_mask_BxT)
  return loss_BxT, metrics


def staleness_histogram(rollout_version_B, current_version, bins: int = 4) -> dict:
  """The fraction of rows sampled `s` weight versions before `current_version`, for
  s = 0 .. bins - 2 and the last bin s >= bins - 1, plus the mean and max staleness."""
  staleness_B = jnp.maximum(current_version - jnp.asarray(rollout_version_B, jnp.int32), 0)
  binned_B = jnp.minimum(staleness_B, bins - 1)
  counts = jnp.zeros((bins,), jnp.float32).at[binned_B].add(1.0) / staleness_B.shape[0]
  out = {f"rollout/staleness_{s}": counts[s] for s in range(bins - 1)}
  out[f"rollout/staleness_{bins - 1}+"] = counts[bins - 1]
  out["rollout/staleness_mean"] = jnp.mean(staleness_B.astype(jnp.float32))
  out["rollout/staleness_max"] = jnp.max(staleness_B).astype(jnp.float32)
  return out
