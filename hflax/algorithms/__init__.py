"""RL algorithms for LLMs as pure, jit-friendly functions of arrays and masks.

No controller, mesh or model is needed: every function takes [B, T] per-token arrays
with a `response_mask` (1 on real response tokens, the end token included), [B]
per-response scores, and integer `group_ids` for the samples of one prompt.
Semantics follow verl's (see each module's docstring).
"""
from hflax.algorithms.advantages import (discounted_returns, gae_advantage, grpo_advantage,
                                         reinforce_plus_plus_advantage,
                                         reinforce_plus_plus_baseline_advantage,
                                         remax_advantage, rloo_advantage, sequence_scores)
from hflax.algorithms.aggregation import LOSS_AGG_MODES, aggregate_loss, aggregation_weight
from hflax.algorithms.kl import (KL_ESTIMATORS, KL_KINDS, KLControlState, adaptive_kl_controller,
                                 apply_kl_penalty, fixed_kl_controller, kl_loss, kl_penalty,
                                 update_kl_controller)
from hflax.algorithms.masked import (group_mean_std, masked_mean, masked_sum, masked_var,
                                     masked_whiten)
from hflax.algorithms.losses import (cispo_loss, entropy_from_logits, entropy_loss,
                                     explained_variance, gmpo_loss, gspo_loss, ppo_clip_loss,
                                     sapo_loss, value_loss)
from hflax.algorithms.registry import (advantage_estimator_names, advantage_fn,
                                       get_advantage_estimator,
                                       get_policy_loss, policy_loss_names,
                                       register_advantage_estimator, register_policy_loss)
from hflax.algorithms.recipes import (groups_with_variance, lagrange_update, overlong_penalty,
                                      safe_rlhf_advantage, samples_in_groups_with_variance)

__all__ = [
    # advantages
    "gae_advantage", "grpo_advantage", "rloo_advantage", "reinforce_plus_plus_advantage",
    "reinforce_plus_plus_baseline_advantage", "remax_advantage", "discounted_returns",
    "sequence_scores",
    # losses
    "ppo_clip_loss", "gspo_loss", "cispo_loss", "sapo_loss", "gmpo_loss", "value_loss",
    "explained_variance", "entropy_from_logits",
    "entropy_loss", "aggregate_loss", "aggregation_weight", "LOSS_AGG_MODES",
    # KL
    "kl_penalty", "kl_loss", "apply_kl_penalty", "KL_ESTIMATORS", "KL_KINDS", "KLControlState",
    "fixed_kl_controller", "adaptive_kl_controller", "update_kl_controller",
    # DAPO, Safe-RLHF
    "overlong_penalty", "groups_with_variance", "samples_in_groups_with_variance",
    "lagrange_update", "safe_rlhf_advantage",
    # masked statistics
    "masked_sum", "masked_mean", "masked_var", "masked_whiten", "group_mean_std",
    # registry
    "register_advantage_estimator", "register_policy_loss", "get_advantage_estimator",
    "advantage_fn",
    "get_policy_loss", "advantage_estimator_names", "policy_loss_names",
]
