"""What every driver shares: its config, the step state, the advantage step and per-stage
timing.

Algorithm settings read here (see hflax/launch/config.py): adv_estimator, gamma, lam,
norm_adv_by_std_in_grpo, use_kl_in_reward, kl_penalty, kl_ctrl {type, kl_coef, target_kl,
horizon}, lambda_init.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax

from hflax import algorithms as alg
from hflax.controller.batch import Batch
from hflax.controller.roles import Roles
from hflax.metrics import reduce_batch_metrics

STAGE_NAMES = {"generate_sequences": "gen", "compute_reward": "reward",
               "compute_log_prob": "old_log_prob", "old_log_probs": "old_log_prob",
               "compute_ref_log_prob": "ref", "compute_teacher_log_prob": "teacher",
               "compute_values": "values", "update_critic": "update_critic",
               "update_actor": "update_actor"}


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepConfig:
  """What a driver's step reads: the algorithm section and the few batch facts it needs
  (not the whole run's config)."""
  algorithm: Any  # the algorithm section, read-only (attribute and .get access)
  train_batch_size: int  # prompts per step (DAPO fills its batch up to this)
  max_response_length: int
  critic_warmup: int = 0  # steps that train only the critic
  # On-policy distillation's weights (the config's distill section); None: no teacher.
  distill: Any = None


@dataclasses.dataclass
class StepState:
  """Host-side algorithm state carried across steps (and checkpointed)."""
  step: int = 0
  kl_ctrl: Any = None  # alg.KLControlState when KL is in the reward
  lagrange_lambda: float = 1.0  # Safe-RLHF


class Timed:
  """A role whose method calls are timed as verl's timing_s/<stage>.

  With block=True each stage waits for its results (per-stage times, as verl reports
  them); block=False keeps dispatch asynchronous so roles on disjoint pools overlap, and
  only the whole step is timed.
  """

  def __init__(self, worker, metrics: dict, block: bool = True):
    self._worker, self._metrics, self._block = worker, metrics, block

  def __getattr__(self, name):
    method = getattr(self._worker, name)
    if name not in STAGE_NAMES:
      return method

    def call(*args, **kwargs):
      start = time.perf_counter()
      out = method(*args, **kwargs)
      if self._block:
        # An update returns only metrics (in meta): waiting on them waits for the step.
        jax.block_until_ready((out.arrays, out.meta) if isinstance(out, Batch) else out)
        key = f"timing_s/{STAGE_NAMES[name]}"
        self._metrics[key] = self._metrics.get(key, 0.0) + time.perf_counter() - start
      return out
    return call


def timed_roles(roles: Roles, metrics: dict, block: bool = True) -> Roles:
  return Roles(**{f.name: None if getattr(roles, f.name) is None else
                  Timed(getattr(roles, f.name), metrics, block)
                  for f in dataclasses.fields(roles)})


def init_state(algo_cfg) -> StepState:
  state = StepState(lagrange_lambda=float(algo_cfg.get("lambda_init", 1.0)))
  if algo_cfg.get("use_kl_in_reward", False):
    kl = algo_cfg.kl_ctrl
    state.kl_ctrl = (alg.adaptive_kl_controller(kl.kl_coef, kl.target_kl, kl.horizon)
                     if kl.type == "adaptive" else alg.fixed_kl_controller(kl.kl_coef))
  return state


def compute_advantage(batch: Batch, algo_cfg, state: StepState, rows_per_step: int) -> Batch:
  """Token-level rewards (with the KL penalty when it is in the reward) and advantages."""
  metrics = {}
  rewards = batch["token_level_scores"]
  if state.kl_ctrl is not None:
    rewards, mean_kl = alg.apply_kl_penalty(rewards, batch["old_log_probs"], batch["ref_log_prob"],
                                            batch["response_mask"], state.kl_ctrl.coef,
                                            algo_cfg.get("kl_penalty", "kl"))
    metrics.update({"actor/reward_kl_penalty": mean_kl,
                    "actor/reward_kl_penalty_coeff": state.kl_ctrl.coef})
    state.kl_ctrl = alg.update_kl_controller(state.kl_ctrl, mean_kl, rows_per_step)
  fields = {"token_level_rewards": rewards, **{k: batch[k] for k in (
      "response_mask", "values", "group_ids", "reward_baselines") if k in batch}}
  cfg = {**dict(algo_cfg), "num_groups": len(batch)}
  if "segment_head" in batch:  # trajectories as several rows: one advantage a trajectory
    from hflax.algorithms.segmented import trajectory_advantages
    advantages, returns = trajectory_advantages(
        lambda sub: alg.advantage_fn(algo_cfg.adv_estimator, {
            **cfg, "num_groups": len(sub["response_mask"])})(sub),
        fields, batch["segment_head"])
  else:
    advantages, returns = alg.advantage_fn(algo_cfg.adv_estimator, cfg)(fields)
  out = Batch({"token_level_rewards": rewards, "advantages": advantages, "returns": returns},
              meta={"metrics": metrics})
  return batch.union(out)


def apply_distillation(batch: Batch, distill) -> Batch:
  """With a teacher (distill set and teacher_log_prob in the batch): each response token's
  advantage becomes coef * (teacher log-prob - student log-prob) plus task_reward_coef
  times the advantage compute_advantage gave it (hflax.algorithms.distill). The student's
  log-probs are old_log_probs: the sampling policy's, on the same rows."""
  if distill is None or "teacher_log_prob" not in batch:
    return batch
  from hflax.algorithms import distill as od
  student, teacher, mask = (batch["old_log_probs"], batch["teacher_log_prob"],
                            batch["response_mask"])
  advantages = od.distill_advantage(student, teacher, mask, coef=float(distill.coef),
                                    task_advantage=batch["advantages"],
                                    task_reward_coef=float(distill.task_reward_coef))
  metrics = {**batch.meta.get("metrics", {}), **od.distill_metrics(student, teacher, mask)}
  return Batch({**batch.arrays, "advantages": advantages}, batch.objects,
               {**batch.meta, "metrics": metrics})


def step_metrics(batch: Batch, max_response_length: int, max_prompt_length=None) -> dict:
  """verl's batch statistics (critic/score/mean, response_length/mean, ...), on device."""
  return reduce_batch_metrics(max_prompt_length=max_prompt_length,
      scores=batch["token_level_scores"].sum(axis=1),
      token_level_rewards=batch["token_level_rewards"], advantages=batch["advantages"],
      returns=batch["returns"], response_mask=batch["response_mask"],
      prompt_mask=batch["prompt_mask"], max_response_length=max_response_length,
      values=batch["values"] if "values" in batch else None)
