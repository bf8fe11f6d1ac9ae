"""On-policy distillation: the reverse-KL advantage against a hand computation, the distill
config's checks, and the tiny GRPO job with a teacher exported from a tiny model."""
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from hflax.algorithms.distill import distill_advantage, distill_metrics, reverse_kl_advantage
from hflax.launch.config import base_config, validate
from hflax.launch.trainer import Trainer
from hflax.models import hf
from tiny_config import get_config as tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _logps(seed=0, shape=(3, 5)):
  rng = np.random.default_rng(seed)
  student = np.log(rng.uniform(0.05, 1.0, shape)).astype(np.float32)
  teacher = np.log(rng.uniform(0.05, 1.0, shape)).astype(np.float32)
  mask = np.array([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0], [1, 0, 0, 0, 0]], np.float32)
  return student, teacher, mask


def test_reverse_kl_advantage_is_teacher_minus_student_on_response_tokens():
  student, teacher, mask = _logps()
  student[2, 3] = -np.inf  # a padded position's value must not leak (inf * 0 is nan)
  teacher[1, 4] = np.nan
  got = np.asarray(reverse_kl_advantage(student, teacher, mask))
  want = np.zeros_like(student)
  for b in range(3):
    for t in range(5):
      if mask[b, t]:
        want[b, t] = -(student[b, t] - teacher[b, t])
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-7)
  assert np.all(got[mask == 0] == 0)


def test_distill_advantage_weights_and_task_advantage():
  student, teacher, mask = _logps(1)
  task = np.random.default_rng(2).normal(size=student.shape).astype(np.float32)
  got = np.asarray(distill_advantage(student, teacher, mask, coef=0.5, task_advantage=task,
                                     task_reward_coef=2.0))
  want = (0.5 * (teacher - student) + 2.0 * task) * mask
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  alone = np.asarray(distill_advantage(student, teacher, mask, coef=1.0, task_advantage=task,
                                       task_reward_coef=0.0))
  np.testing.assert_allclose(alone, (teacher - student) * mask, rtol=1e-6, atol=1e-6)


def test_distill_metrics_are_means_over_response_tokens():
  student, teacher, mask = _logps(3)
  m = {k: float(v) for k, v in distill_metrics(student, teacher, mask).items()}
  on = mask > 0
  assert m["distill/reverse_kl"] == pytest.approx(float(np.mean((student - teacher)[on])), rel=1e-5)
  assert m["distill/teacher_log_prob/mean"] == pytest.approx(float(np.mean(teacher[on])), rel=1e-5)
  same = distill_metrics(student, student, mask)
  assert float(same["distill/reverse_kl"]) == 0.0


def test_apply_distillation_replaces_the_advantages_and_adds_the_metrics():
  from ml_collections import FrozenConfigDict
  from hflax.algorithms.drivers.common import apply_distillation
  from hflax.controller.batch import Batch
  student, teacher, mask = _logps(4)
  task = np.random.default_rng(5).normal(size=student.shape).astype(np.float32)
  batch = Batch({"old_log_probs": student, "teacher_log_prob": teacher, "response_mask": mask,
                 "advantages": task}, meta={"metrics": {"kept": 1}})
  settings = FrozenConfigDict({"teacher_path": "t", "coef": 0.7, "task_reward_coef": 0.3})
  out = apply_distillation(batch, settings)
  np.testing.assert_allclose(np.asarray(out["advantages"]),
                             (0.7 * (teacher - student) + 0.3 * task) * mask, atol=1e-6)
  assert set(out.meta["metrics"]) == {"kept", "distill/reverse_kl",
                                      "distill/teacher_log_prob/mean"}
  assert apply_distillation(batch, None) is batch  # no teacher: the algorithm's own


def _grpo():
  c = base_config()
  c.algorithm.name, c.algorithm.adv_estimator = "grpo", "grpo"
  c.rollout.n = 2
  return c


@pytest.mark.parametrize("setting,message", [
    ({"algorithm.name": "ppo", "algorithm.adv_estimator": "gae"},
     "config.distill.teacher_path: on-policy distillation runs with algorithm.name in"),
    ({"distill.coef": 0.0}, "config.distill.coef: and distill.task_reward_coef are both 0"),
    ({"distill.coef": -1.0}, "config.distill.coef: must be a finite number >= 0"),
    ({"distill.task_reward_coef": float("nan")}, "config.distill.task_reward_coef:"),
])
def test_distill_config_errors(setting, message):
  c = _grpo()
  c.distill.teacher_path = "/some/teacher"
  for field, value in setting.items():
    section, name = field.split(".")
    c[section][name] = value
  with pytest.raises(ValueError, match=None) as e:
    validate(c)
  assert str(e.value).startswith(message), str(e.value)
  assert "\n" not in str(e.value)


def test_without_a_teacher_nothing_is_checked():
  c = _grpo()
  c.algorithm.name, c.algorithm.adv_estimator = "ppo", "gae"
  validate(c)  # teacher_path "": distillation is off whatever the algorithm


def test_custom_placement_without_a_teacher_entry_puts_it_where_the_reference_is():
  from hflax.launch.roles import needed_roles, placement_spec
  c = _grpo()
  c.actor.use_kl_loss = True
  c.distill.teacher_path = "/some/teacher"
  c.placement.update(kind="custom", pools={"policy": 1, "reference": 1},
                     roles={"actor": {"pool": "policy"}, "ref": {"pool": "reference"}})
  roles = needed_roles(c)
  assert roles == ["actor", "ref", "teacher"]
  spec = placement_spec(c, roles, 2)
  assert spec["roles"]["teacher"] == spec["roles"]["ref"] == {"pool": "reference"}
  c.placement.roles["teacher"] = {"pool": "policy"}  # or a pool of its own choosing
  assert placement_spec(c, roles, 2)["roles"]["teacher"] == {"pool": "policy"}


def tiny(tmp_path, **trainer):
  c = tiny_config()
  c.trainer.update(total_steps=2, save_every=2, run_dir=str(tmp_path / "run"), export_hf=False,
                   compile_cache_dir="", **trainer)
  return c


def _export_policy(c, path, shift=0.0, vocab=None):
  """The tiny job's own initial policy (the built-in model at its seed) as an HF directory;
  shift moves every weight (another teacher), vocab another vocabulary size."""
  from hflax.launch.models import builtin_config
  from hflax.models import create
  from hflax.models.tokenizer import ByteTokenizer
  tok = ByteTokenizer()
  model_cfg = builtin_config(c, vocab or tok.vocab_size, tok)
  _, state = create(model_cfg, seed=c.trainer.seed)
  state = jax.tree.map(lambda x: x + shift, state)
  hf.export_checkpoint(str(path), model_cfg, state)
  return str(path)


def _metrics(run_dir):
  with open(run_dir / "metrics.jsonl") as f:
    return {row["step"]: row for row in map(json.loads, f) if "step" in row}


def test_teacher_with_another_vocabulary_is_refused_before_any_role_is_built(tmp_path):
  c = tiny(tmp_path)
  c.distill.teacher_path = _export_policy(c, tmp_path / "teacher", vocab=300)
  with pytest.raises(ValueError, match=r"^config\.distill\.teacher_path: .*teacher embeds 300 "
                     r"token ids, the student \d+"):
    Trainer(c, log=lambda *_: None)
  c.distill.teacher_path = str(tmp_path / "missing")
  with pytest.raises(ValueError, match=r"^config\.distill\.teacher_path: "):
    Trainer(c, log=lambda *_: None)
  # A GGUF teacher (the shipped SmolLM2's) is read the same way: its vocabulary is not the
  # byte-level student's.
  c.distill.teacher_path = "smollm2-135m-instruct"
  with pytest.raises(ValueError, match=r"^config\.distill\.teacher_path: smollm2-135m-instruct: "
                     r"the teacher embeds 49152 token ids"):
    Trainer(c, log=lambda *_: None)


def test_distillation_from_the_students_own_weights_has_zero_reverse_kl(tmp_path):
  c = tiny(tmp_path)
  c.distill.teacher_path = _export_policy(c, tmp_path / "teacher")
  trainer = Trainer(c, log=lambda *_: None)
  assert trainer.roles.teacher is not None
  trainer.fit()
  rows = _metrics(tmp_path / "run")
  for step in (1, 2):
    assert "distill/reverse_kl" in rows[step] and "distill/teacher_log_prob/mean" in rows[step]
  # Step 1 samples from the weights the teacher holds: reverse KL 0 to float32 rounding.
  assert abs(rows[1]["distill/reverse_kl"]) < 1e-5
  assert rows[1]["distill/teacher_log_prob/mean"] < 0
  # Distillation alone: the advantages are the per-token reverse KL's negative, so ~0 too.
  assert abs(rows[1]["critic/advantages/max"]) < 1e-4
  assert abs(rows[1]["critic/advantages/min"]) < 1e-4


def test_distillation_from_another_teacher_with_a_task_reward(tmp_path):
  c = tiny(tmp_path)
  c.distill.update(teacher_path=_export_policy(c, tmp_path / "teacher", shift=0.02),
                   coef=1.0, task_reward_coef=1.0)
  Trainer(c, log=lambda *_: None).fit()
  rows = _metrics(tmp_path / "run")
  # A single-sample estimate of KL(student || teacher) may be negative per token, but the
  # teacher is another model: not 0.
  assert abs(rows[1]["distill/reverse_kl"]) > 1e-4
  assert np.isfinite(rows[2]["distill/reverse_kl"])


def test_cli_distils_on_packed_rows_with_the_teacher_on_the_reference_pool(tmp_path):
  """`python -m hflax.launch --config ... distill.teacher_path=DIR`, placed as grpo.py places
  its roles (a custom placement naming no teacher: it takes the reference's pool)."""
  c = tiny(tmp_path)
  teacher = _export_policy(c, tmp_path / "teacher")
  run_dir = tmp_path / "cli"
  args = [sys.executable, "-m", "hflax.launch", "--config", os.path.join(ROOT, "tests",
          "tiny_config.py"), f"distill.teacher_path={teacher}", "trainer.total_steps=1",
          f"trainer.run_dir={run_dir}", "trainer.compile_cache_dir=", "trainer.export_hf=False",
          "model.use_remove_padding=True", "placement.kind=custom",
          "placement.pools={'policy': 1, 'reference': 1}",
          "placement.roles={'actor': {'pool': 'policy'}, 'ref': {'pool': 'reference'}}"]
  done = subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  row = _metrics(run_dir)[1]
  assert abs(row["distill/reverse_kl"]) < 1e-5
  assert "timing_s/teacher" in row
