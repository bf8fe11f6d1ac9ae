"""Numbers in the config: every float finite and each numeric field in its range, checked
by hflax.launch.config.validate before any device work, each error one line naming the
field; the shipped configs pass; and the CLI turns such a value into exit status 2."""
import glob
import math
import os
import runpy
import subprocess
import sys

import ml_collections
import pytest

from hflax.launch.config import base_config, validate
from hflax.launch.ranges import RANGES, Range, check_numbers

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "hflax", "configs", "[!_]*.py")))
NAN, INF = float("nan"), float("inf")


def _grpo():
  return runpy.run_path(os.path.join(ROOT, "hflax", "configs", "grpo.py"))["get_config"]()


def _set(c, field, value):
  *path, key = field.split(".")
  for name in path:
    c = c[name]
  c[key] = value


CASES = [
    # field, value, what the message says after "config.<field>: "
    ("actor.optim.lr", NAN, "must be a finite number > 0, got nan"),
    ("actor.optim.lr", INF, "must be a finite number > 0, got inf"),
    ("actor.optim.lr", float("1e400"), "must be a finite number > 0, got inf"),
    ("actor.optim.lr", -1.0, "must be a finite number > 0, got -1.0"),
    ("actor.optim.lr", 0.0, "must be a finite number > 0, got 0.0"),
    ("critic.optim.lr", NAN, "must be a finite number > 0, got nan"),
    ("actor.kl_loss_coef", NAN, "must be a finite number >= 0, got nan"),
    ("actor.kl_loss_coef", INF, "must be a finite number >= 0, got inf"),
    ("algorithm.kl_ctrl.kl_coef", NAN, "must be a finite number >= 0, got nan"),
    ("algorithm.kl_ctrl.kl_coef", -0.1, "must be a finite number >= 0, got -0.1"),
    ("algorithm.kl_ctrl.target_kl", 0.0, "must be a finite number > 0"),
    ("actor.entropy_coeff", INF, "must be a finite number >= 0, got inf"),
    ("actor.entropy_coeff", -0.01, "must be a finite number >= 0, got -0.01"),
    ("actor.optim.b2", 1.0, "must be a finite number in [0, 1) (Adam's decay rate; 1 never "
                            "forgets), got 1.0"),
    ("actor.optim.b1", -0.1, "must be a finite number in [0, 1)"),
    ("actor.optim.weight_decay", -0.01, "must be a finite number >= 0, got -0.01"),
    ("actor.optim.grad_clip", NAN, "must be a finite number >= 0 (0: no clipping), got nan"),
    ("actor.optim.min_lr_ratio", 1.5, "must be a finite number in [0, 1], got 1.5"),
    ("rollout.temperature", INF, "must be a finite number, got inf"),
    ("rollout.val_temperature", NAN, "must be a finite number, got nan"),
    ("data.seed", -1, "must be an integer in [0, 2**63), got -1"),
    ("trainer.seed", -5, "must be an integer in [0, 2**63), got -5"),
    ("trainer.seed", 2**63, "must be an integer in [0, 2**63)"),
    ("rollout.top_p", 0.0, "must be in (0, 1], got 0.0"),
    ("algorithm.gamma", 1.5, "must be in [0, 1], got 1.5"),
    ("algorithm.lam", NAN, "must be a finite number, got nan"),
    ("actor.clip_ratio", INF, "must be a finite number, got inf"),
    ("algorithm.lambda_max", INF, "must be a finite number, got inf"),
    ("algorithm.lambda_lr", -0.5, "must be a finite number >= 0"),
    ("algorithm.cost_limit", NAN, "must be a finite number, got nan"),
    ("trainer.sft_warmup.lr", 0.0, "must be a finite number > 0, got 0.0"),
    ("trainer.sft_warmup.target_loss", INF, "must be a finite number, got inf"),
    ("model.builtin.rope_theta", -1.0, "must be a finite number > 0"),
    ("data.builtin.digits", (0, 2), "must be an integer >= 1 (operand digit count, or a (min, "
                                    "max) range), got 0 in (0, 2)"),
    ("trainer.profile_steps", (3, -1), "must be an integer >= 0 (steps to trace), got -1 in "
                                       "(3, -1)"),
]


@pytest.mark.parametrize("field,value,message", CASES,
                         ids=[f"{f}={v!r}" for f, v, _ in CASES])
def test_a_bad_number_is_refused_naming_the_field(field, value, message):
  c = _grpo()
  _set(c, field, value)
  with pytest.raises(ValueError) as e:
    validate(c)
  text = str(e.value)
  assert "\n" not in text, text
  assert text.startswith(f"config.{field}: "), text
  assert message in text, text


def test_a_non_finite_number_inside_a_list_names_its_position():
  c = _grpo()
  c.trainer.profile_steps = (1, NAN)
  with pytest.raises(ValueError, match=r"^config\.trainer\.profile_steps\[1\]: must be a "
                                       r"finite number, got nan$"):
    validate(c)


@pytest.mark.parametrize("path", CONFIGS, ids=os.path.basename)
def test_the_shipped_configs_pass(path):
  c = runpy.run_path(path)["get_config"]()
  validate(c)
  check_numbers(c, lambda field, why: pytest.fail(f"{field}: {why}"))


def test_every_range_names_a_field_of_the_tree():
  """A misspelt path would be skipped silently as a field the tree lacks."""
  c = base_config()
  for field in RANGES:
    node = c
    for key in field.split("."):
      assert key in node, field
      node = node[key]


def test_fields_a_tree_lacks_are_skipped():
  calls = []
  check_numbers(ml_collections.ConfigDict({"actor": {"optim": {"lr": 0.1}}, "x": [1.0, 2]}),
                lambda field, why: calls.append((field, why)))
  assert calls == []
  check_numbers({"data": {"seed": -1}}, lambda field, why: calls.append((field, why)))
  assert calls == [("data.seed", "must be an integer in [0, 2**63), got -1")]


def test_range_descriptions():
  assert Range(low=0, high=1, low_open=True).describe() == "a finite number in (0, 1]"
  assert Range(high=5, high_open=True).describe() == "a finite number < 5"
  assert not Range(low=0).holds(True) and not Range(low=0).holds("1")
  assert not Range(low=0, integer=True).holds(1.0) and Range(low=0).holds(10**400)
  assert not Range().holds(math.inf)


@pytest.mark.parametrize("value", ["nan", "1e400"])
def test_cli_exits_2_with_one_line_naming_the_field(value):
  out = subprocess.run(
      [sys.executable, "-m", "hflax.launch", "--config", "grpo.py",
       f"--config.actor.optim.lr={value}"], cwd=ROOT, capture_output=True, text=True,
      timeout=300, env={**os.environ, "PYTHONPATH": ROOT, "HFLAX_CPU_DEVICES": "2"})
  assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
  shown = "nan" if value == "nan" else "inf"
  assert out.stderr.strip() == (f"error: config.actor.optim.lr: must be a finite number > 0, "
                                f"got {shown}"), out.stderr
  assert "Traceback" not in out.stdout + out.stderr
  assert "warm-up" not in out.stdout  # refused before any work
