"""On-policy distillation: a teacher's per-token log-probs on the student's own samples.

The student samples; the teacher scores each sampled token. The per-token reverse KL
(the single-sample estimate of KL(student || teacher) at that position) is

  reverse_kl[t] = student_logp[t] - teacher_logp[t]

and its negative is the token's advantage (Thinking Machines' "On-Policy Distillation",
2025; the Qwen3 report's on-policy distillation): a token the teacher finds likelier than
the student did is pushed up, one it finds less likely is pushed down. No discounting:
each token's advantage is its own reverse KL, not a sum over the tokens after it.

With a task reward besides, the advantages add:

  advantage = task_reward_coef * task_advantage + coef * (teacher_logp - student_logp)

(task_reward_coef 0: distillation alone).
"""
from __future__ import annotations

import jax.numpy as jnp

from hflax.algorithms.masked import f32, masked_mean


def reverse_kl_advantage(student_logp, teacher_logp, mask):
  """[B, T] advantages -(student_logp - teacher_logp), zero where mask is 0."""
  # where, not a product: a padded position's log-probs may be anything (inf included).
  return jnp.where(f32(mask) > 0, f32(teacher_logp) - f32(student_logp), 0.0)


def distill_advantage(student_logp, teacher_logp, mask, *, coef: float = 1.0,
                      task_advantage=None, task_reward_coef: float = 0.0):
  """coef * reverse_kl_advantage, plus task_reward_coef * task_advantage when given."""
  out = coef * reverse_kl_advantage(student_logp, teacher_logp, mask)
  if task_advantage is not None and task_reward_coef:
    out = out + task_reward_coef * f32(task_advantage) * f32(mask)
  return out


def distill_metrics(student_logp, teacher_logp, mask) -> dict:
  """distill/reverse_kl (mean per response token) and distill/teacher_log_prob/mean."""
  on = f32(mask) > 0
  return {"distill/reverse_kl": masked_mean(-reverse_kl_advantage(student_logp, teacher_logp,
                                                                  mask), mask),
          "distill/teacher_log_prob/mean": masked_mean(jnp.where(on, f32(teacher_logp), 0.0),
                                                       mask)}


def check_distill_vocab(teacher_vocab: int, student_vocab: int) -> str | None:
  """Why a teacher cannot score the student's tokens (None: it can)."""
  if teacher_vocab != student_vocab:
    return (f"the teacher embeds {teacher_vocab} token ids, the student {student_vocab}: "
            "on-policy distillation needs the student's tokenizer (the same vocabulary)")
  return None


__all__ = ["reverse_kl_advantage", "distill_advantage", "distill_metrics",
           "check_distill_vocab"]
