"""Name -> function registries for advantage estimators and policy losses.

Registered functions share one signature so a trainer can pick them from a config:

  advantage estimator:  fn(batch, cfg) -> (advantages_BxT, returns_BxT)
  policy loss:          fn(batch, cfg) -> (loss_BxT, metrics)

`batch` maps field names to arrays, `cfg` maps hyper-parameter names to Python values
(read with defaults, so {} works; under jit close over cfg, it is static). Fields:
  token_level_rewards [B, T]  rewards per token (an outcome reward sits on the last one)
  response_mask       [B, T]  1 on real response tokens
  values              [B, T]  critic values (gae)
  group_ids           [B]     int group (prompt) of each sample, in [0, num_groups)
  reward_baselines    [B]     score of the greedy response (remax)
  log_probs, old_log_probs, advantages  [B, T]  (policy losses)
cfg keys: gamma, lam (1.0), norm_adv_by_std_in_grpo (True), num_groups (static; default
the batch size), clip_ratio (0.2), clip_ratio_low / clip_ratio_high (default clip_ratio;
"clip_higher" defaults high to 0.28, "gspo" to the paper's 3e-4 / 4e-4, "cispo" low to 1,
no lower bound, "gmpo" / "geo_mean" both to the paper's 0.4 in log space), clip_ratio_c
(3.0; None turns dual-clip off), tau_pos / tau_neg ("sapo": 1.0 / 1.05).

A user registers their own from any module, and selects it by name:

  @register_advantage_estimator("my_estimator", jit=True)  # jit=True: pure jnp code
  def my_estimator(batch, cfg): ...

Drivers call an estimator through `advantage_fn`, which compiles it once per (estimator,
scalar cfg) when it was registered with jit=True (every built-in one is); others run
eagerly, so host code (numpy, Python control flow on values) works in them.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Mapping

import jax

from hflax.algorithms import advantages as adv
from hflax.algorithms.losses import cispo_loss, gmpo_loss, gspo_loss, ppo_clip_loss, sapo_loss

_ADVANTAGE_ESTIMATORS: dict[str, Callable] = {}
_POLICY_LOSSES: dict[str, Callable] = {}
_JITTABLE: set[Callable] = set()


def _register(table, what, names, override):
  if not names:
    raise ValueError(f"register a {what} under at least one name")

  def decorator(fn):
    for name in names:
      if name in table and table[name] is not fn and not override:
        raise ValueError(f"{what} {name!r} is already registered (pass override=True)")
      table[name] = fn
    return fn
  return decorator


def _lookup(table, what, name):
  if name not in table:
    raise ValueError(f"unknown {what} {name!r}; valid: {', '.join(sorted(table))}")
  return table[name]


def register_advantage_estimator(*names: str, override: bool = False, jit: bool = False):
  """Decorator: register fn(batch, cfg) -> (advantages_BxT, returns_BxT) under names;
  jit=True lets `advantage_fn` compile it (it must then be traceable: jnp only)."""
  register = _register(_ADVANTAGE_ESTIMATORS, "advantage estimator", names, override)

  def decorator(fn):
    if jit:
      _JITTABLE.add(fn)
    return register(fn)
  return decorator


def advantage_fn(name: str, cfg: Mapping[str, Any]) -> Callable:
  """fields -> (advantages_BxT, returns_BxT) for estimator `name` under `cfg`.

  Only cfg's scalar entries reach the estimator (they are what estimators read). A jit
  estimator is compiled once per (estimator, those entries): called eagerly, a lax.scan
  such as GAE's is traced and compiled again on every call."""
  fn = get_advantage_estimator(name)
  scalars = tuple(sorted((k, v) for k, v in cfg.items()
                         if isinstance(v, (bool, int, float, str, type(None)))))
  return _compiled(fn, scalars) if fn in _JITTABLE else functools.partial(_call, fn, scalars)


def _call(fn, scalars, fields):
  return fn(fields, dict(scalars))


@functools.lru_cache(maxsize=64)
def _compiled(fn, scalars) -> Callable:
  return jax.jit(functools.partial(_call, fn, scalars))


def register_policy_loss(*names: str, override: bool = False):
  """Decorator: register fn(batch, cfg) -> (loss_BxT, metrics) under names."""
  return _register(_POLICY_LOSSES, "policy loss", names, override)


def get_advantage_estimator(name: str) -> Callable:
  return _lookup(_ADVANTAGE_ESTIMATORS, "advantage estimator", name)


def get_policy_loss(name: str) -> Callable:
  return _lookup(_POLICY_LOSSES, "policy loss", name)


def advantage_estimator_names() -> list[str]:
  return sorted(_ADVANTAGE_ESTIMATORS)


def policy_loss_names() -> list[str]:
  return sorted(_POLICY_LOSSES)


def _field(batch: Mapping[str, Any], key: str, who: str):
  if key not in batch:
    raise KeyError(f"{who} needs batch[{key!r}]; batch has {sorted(batch)}")
  return batch[key]


def _scores(batch, who):
  return adv.sequence_scores(_field(batch, "token_level_rewards", who),
                             _field(batch, "response_mask", who))


@register_advantage_estimator("gae", jit=True)
def _gae(batch, cfg):
  return adv.gae_advantage(_field(batch, "token_level_rewards", "gae"),
                           _field(batch, "values", "gae"), _field(batch, "response_mask", "gae"),
                           gamma=cfg.get("gamma", 1.0), lam=cfg.get("lam", 1.0))


@register_advantage_estimator("grpo", jit=True)
def _grpo(batch, cfg):
  return adv.grpo_advantage(_scores(batch, "grpo"), batch["response_mask"],
                            _field(batch, "group_ids", "grpo"), cfg.get("num_groups"),
                            norm_by_std=cfg.get("norm_adv_by_std_in_grpo", True))


@register_advantage_estimator("rloo", jit=True)
def _rloo(batch, cfg):
  return adv.rloo_advantage(_scores(batch, "rloo"), batch["response_mask"],
                            _field(batch, "group_ids", "rloo"), cfg.get("num_groups"))


@register_advantage_estimator("reinforce_plus_plus", jit=True)
def _reinforce_plus_plus(batch, cfg):
  return adv.reinforce_plus_plus_advantage(
      _field(batch, "token_level_rewards", "reinforce_plus_plus"),
      _field(batch, "response_mask", "reinforce_plus_plus"), gamma=cfg.get("gamma", 1.0))


@register_advantage_estimator("reinforce_plus_plus_baseline", jit=True)
def _reinforce_plus_plus_baseline(batch, cfg):
  who = "reinforce_plus_plus_baseline"
  return adv.reinforce_plus_plus_baseline_advantage(
      _scores(batch, who), batch["response_mask"], _field(batch, "group_ids", who),
      cfg.get("num_groups"))


@register_advantage_estimator("remax", jit=True)
def _remax(batch, cfg):
  return adv.remax_advantage(_field(batch, "token_level_rewards", "remax"),
                             _field(batch, "reward_baselines", "remax"),
                             _field(batch, "response_mask", "remax"))


def _policy_inputs(batch, who):
  return tuple(_field(batch, k, who)
               for k in ("log_probs", "old_log_probs", "advantages", "response_mask"))


def _unset_to(cfg, key, default):
  # A config holds an unset optional as None (ml_collections placeholder): read it as absent.
  value = cfg.get(key)
  return default if value is None else value


def _ppo(batch, cfg, who, default_high=None):
  return ppo_clip_loss(*_policy_inputs(batch, who), clip_ratio=cfg.get("clip_ratio", 0.2),
                       clip_ratio_low=cfg.get("clip_ratio_low"),
                       clip_ratio_high=_unset_to(cfg, "clip_ratio_high", default_high),
                       clip_ratio_c=cfg.get("clip_ratio_c", 3.0))


@register_policy_loss("vanilla", "ppo", "dual_clip")
def _vanilla(batch, cfg):
  # verl's "vanilla" is PPO clip with dual-clip on (clip_ratio_c 3.0) by default.
  return _ppo(batch, cfg, "vanilla")


@register_policy_loss("clip_higher")
def _clip_higher(batch, cfg):
  return _ppo(batch, cfg, "clip_higher", default_high=0.28)


@register_policy_loss("gspo")
def _gspo(batch, cfg):
  return gspo_loss(*_policy_inputs(batch, "gspo"),
                   clip_ratio_low=_unset_to(cfg, "clip_ratio_low", 3e-4),
                   clip_ratio_high=_unset_to(cfg, "clip_ratio_high", 4e-4))


@register_policy_loss("cispo")
def _cispo(batch, cfg):
  # The paper sets no lower bound on the weight (low 1); the upper one is clip_ratio's.
  return cispo_loss(*_policy_inputs(batch, "cispo"),
                    clip_ratio_low=_unset_to(cfg, "clip_ratio_low", 1.0),
                    clip_ratio_high=_unset_to(cfg, "clip_ratio_high", cfg.get("clip_ratio", 0.2)))


@register_policy_loss("sapo")
def _sapo(batch, cfg):
  return sapo_loss(*_policy_inputs(batch, "sapo"), tau_pos=cfg.get("tau_pos", 1.0),
                   tau_neg=cfg.get("tau_neg", 1.05))


@register_policy_loss("gmpo", "geo_mean")  # geo_mean: verl's name
def _gmpo(batch, cfg):
  return gmpo_loss(*_policy_inputs(batch, "gmpo"),
                   clip_ratio_low=_unset_to(cfg, "clip_ratio_low", 0.4),
                   clip_ratio_high=_unset_to(cfg, "clip_ratio_high", 0.4))
