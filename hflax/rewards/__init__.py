"""Rewards: rule rewards as pure functions, a data_source registry, a batch scorer."""
from hflax.rewards.competition_math import boxed_answer, math_boxed
from hflax.rewards.math_dapo import math_dapo
from hflax.rewards.qa import qa_exact_match
from hflax.rewards.registry import (check_rule_available, default_reward_fn, load_reward_function,
                                    math_verifier, register_reward_fn, reward_data_sources)
from hflax.rewards.rules import (arithmetic_exact_match, extract_gsm8k_answer, gsm8k,
                                 leading_integer)
from hflax.rewards.scorer import RuleRewardScorer, last_token_scores
from hflax.rewards.validation import validation_metrics

__all__ = ["arithmetic_exact_match", "gsm8k", "extract_gsm8k_answer", "leading_integer",
           "math_boxed", "boxed_answer", "math_dapo", "qa_exact_match",
           "check_rule_available", "math_verifier", "default_reward_fn", "register_reward_fn",
           "reward_data_sources",
           "load_reward_function", "RuleRewardScorer", "validation_metrics", "last_token_scores"]
