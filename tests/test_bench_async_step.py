"""bench/async_step.py without its timed runs (its --quick smoke launches two launcher
processes, over a minute on a loaded 2-core machine): the launcher config it writes puts
the actor and its generation on pools of their own and passes the launcher's checks, and
its ratio and accuracy rate are the arithmetic the docstring states."""
import importlib.util
import pathlib
import sys

import pytest

from hflax.launch.backends import make_backend
from hflax.launch.cli import load_config

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _bench():
  sys.path.insert(0, str(ROOT / "bench"))
  spec = importlib.util.spec_from_file_location("async_step", ROOT / "bench" / "async_step.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def test_config_is_a_split_the_launcher_accepts(tmp_path):
  path = _bench().config_file(tmp_path, toy=True)
  c = load_config(["--config", str(path), "--config.trainer.mode=one_step_off",
                   f"--config.trainer.run_dir={tmp_path / 'run'}"])
  assert dict(c.placement.pools) == {"train": 1, "rollout": 1}
  assert c.placement.roles.rollout.pool == "rollout" and c.placement.roles.actor.pool == "train"
  assert c.trainer.mode == "one_step_off"
  make_backend(c, log=lambda *_: None)  # the placement's checks, no device work


def test_ratio_and_accuracy_rate():
  run = lambda steps, acc=None: {"step_s": steps, "accuracy": acc}  # noqa: E731
  out = _bench().summary({
      "sync": [run([9.0, 2.0, 2.2, 2.1], 0.5), run([9.0, 2.0, 2.4, 2.0], None)],
      "one_step_off": [run([9.0, 1.2, 1.0, 1.1], 0.6), run([9.0, 1.3, 1.3, 1.4], None)]})
  assert out["medians"] == {"sync": [2.1, 2.0], "one_step_off": [1.1, 1.3]}
  assert out["ratio"] == pytest.approx(1.2 / 2.05)
  assert out["accuracy_per_s"] == {"sync": [pytest.approx(0.5 / 15.3)],
                                   "one_step_off": [pytest.approx(0.6 / 12.3)]}
