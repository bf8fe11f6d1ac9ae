"""A verl user's setup runs unchanged: a GSM8K-format parquet as verl's preprocessing
example writes it, a reward file with verl's compute_score signature, and a verl command
line (hydra-style overrides with verl's names) given to hflax's entry point."""
import json
import os
import shutil
import subprocess
import sys

import pytest

from hflax.launch.cli import load_config
from hflax.launch.verl_names import VERL_NAMES, translate_overrides

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
QUESTIONS = [("Tom has 3 apples and buys 4 more. How many apples does he have?", "7"),
             ("A box holds 6 eggs. How many eggs are in 2 boxes?", "12"),
             ("Sara read 10 pages on Monday and 5 on Tuesday. How many pages in all?", "15"),
             ("There are 9 birds and 2 fly away. How many are left?", "7"),
             ("Ben has 8 coins and gives 3 away. How many coins remain?", "5"),
             ("A class has 4 rows of 5 desks. How many desks?", "20")]

# verl's signature: called by keyword. The score depends on the text only, and every call
# is recorded, so the test can check what was logged against what this file computed.
REWARD_FILE = '''
import json, os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    score = (len(solution_str) % 5) / 4.0
    with open(os.environ["REWARD_CALLS"], "a") as f:
        f.write(json.dumps({"data_source": data_source, "text": solution_str,
                            "truth": ground_truth, "split": (extra_info or {}).get("split"),
                            "score": score}) + "\\n")
    return score
'''


def write_gsm8k_parquet(path, split):
  """Rows as verl's examples/data_preprocess/gsm8k.py writes them."""
  import pyarrow as pa
  import pyarrow.parquet as pq
  rows = [{"data_source": "openai/gsm8k",
           "prompt": [{"role": "user", "content": f"{q} {INSTRUCTION}"}],
           "ability": "math",
           "reward_model": {"style": "rule", "ground_truth": a},
           "extra_info": {"split": split, "index": i, "answer": f"... #### {a}", "question": q}}
          for i, (q, a) in enumerate(QUESTIONS)]
  pq.write_table(pa.Table.from_pylist(rows), path)


def test_a_verl_setup_runs_unchanged_and_logs_the_reward_its_file_computes(tmp_path):
  write_gsm8k_parquet(tmp_path / "train.parquet", "train")
  write_gsm8k_parquet(tmp_path / "test.parquet", "test")
  (tmp_path / "reward.py").write_text(REWARD_FILE)
  calls = tmp_path / "calls.jsonl"
  run = tmp_path / "ckpts"
  verl_args = [
      f"data.train_files=[{tmp_path}/train.parquet]", f"data.val_files={tmp_path}/test.parquet",
      "data.train_batch_size=2", "data.max_prompt_length=256", "data.max_response_length=6",
      "data.prompt_key=prompt", "algorithm.adv_estimator=grpo",
      "actor_rollout_ref.rollout.n=2", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
      "actor_rollout_ref.actor.optim.lr=1e-3", "actor_rollout_ref.actor.use_kl_loss=True",
      "actor_rollout_ref.actor.kl_loss_coef=0.001",
      "actor_rollout_ref.rollout.name=vllm",  # verl's engine choice: ignored, said so
      f"custom_reward_function.path={tmp_path}/reward.py",
      "trainer.logger=['console','jsonl']", "trainer.project_name=gsm8k_grpo",
      "trainer.experiment_name=smoke", f"trainer.default_local_dir={run}",
      "trainer.total_training_steps=2", "trainer.test_freq=2", "trainer.save_freq=2",
      "trainer.val_before_train=False", "trainer.n_gpus_per_node=2"]
  # What hflax needs besides (a tiny built-in model so the run is quick, no warm-up).
  hflax_args = ["--config.trainer.sft_warmup.steps=0", "--config.trainer.export_hf=False",
                f"--config.trainer.rollout_data_dir={tmp_path}/rollouts",
                "--config.model.builtin.hidden_size=32", "--config.model.builtin.num_layers=1",
                "--config.model.builtin.intermediate_size=64"]
  env = {**os.environ, "REWARD_CALLS": str(calls), "HFLAX_CPU_DEVICES": "2"}
  done = subprocess.run([sys.executable, "-m", "hflax.launch", "--config", "grpo.py",
                         *verl_args, *hflax_args], cwd=tmp_path, env=env,
                        capture_output=True, text=True, timeout=900)
  assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
  assert "actor_rollout_ref.rollout.name: ignored" in done.stderr
  recorded = [json.loads(line) for line in calls.read_text().splitlines()]
  assert {r["data_source"] for r in recorded} == {"openai/gsm8k"}
  assert {r["split"] for r in recorded} == {"train", "test"}
  answers = dict(QUESTIONS)
  assert all(r["truth"] in answers.values() for r in recorded)
  rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
  for step in (1, 2):
    samples = [json.loads(line) for line in
               (tmp_path / "rollouts" / f"{step}.jsonl").read_text().splitlines()]
    assert len(samples) == 4
    # Every logged score is what the file computes for that sample's text.
    for s in samples:
      assert s["score"] == pytest.approx((len(s["output"]) % 5) / 4.0)
    logged = next(r for r in rows if r["step"] == step and "critic/score/mean" in r)
    assert logged["critic/score/mean"] == pytest.approx(sum(s["score"] for s in samples) / 4)
  # verl's validation metric name for a reward function that returns a number.
  assert any("val-core/openai/gsm8k/reward/mean@1" in r for r in rows)
  assert (run / "checkpoints" / "2").is_dir()


def test_verl_names_and_hydra_overrides_map_onto_hflax_fields():
  args = translate_overrides(["trainer.total_training_steps=7", "--config.trainer.save_freq=3",
                              "actor_rollout_ref.actor.optim.lr=2e-6",
                              "actor_rollout_ref.rollout.val_kwargs.temperature=0.6",
                              "trainer.resume_mode=disable", "trainer.logger=['console','jsonl']",
                              "--config", "grpo.py", "data.train_batch_size=8",
                              "trainer.nnodes=1"])
  assert args == ["--config.trainer.total_steps=7", "--config.trainer.save_every=3",
                  "--config.actor.optim.lr=2e-6", "--config.rollout.val_temperature=0.6",
                  "--config.trainer.resume=False", "--config.trainer.log=('console','jsonl')",
                  "--config", "grpo.py", "--config.data.train_batch_size=8"]
  c = load_config(["--config", "grpo.py", "trainer.total_training_steps=7",
                   "actor_rollout_ref.rollout.n=3", "trainer.logger=['console','jsonl']",
                   "critic.model.path=/x", "custom_reward_function.name=score"])
  assert (c.trainer.total_steps, c.rollout.n, c.critic.model_path) == (7, 3, "/x")
  assert tuple(c.trainer.log) == ("console", "jsonl") and c.reward.custom_fn.name == "score"
  # Every mapped name lands on a field that exists.
  fields = load_config(["--config", "grpo.py"])
  for field in set(VERL_NAMES.values()):
    node = fields
    for key in field.split("."):
      assert key in node, field
      node = node[key]


def test_configs_ship_inside_the_package_and_a_regular_install_runs_them(tmp_path):
  """`pip install .` (a wheel, not an editable install) run from another directory."""
  wheel_dir, target, source = tmp_path / "wheel", tmp_path / "site", tmp_path / "source"
  # A copy of the sources: the build's own files stay out of the checkout.
  shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(
      ".git", ".venv", "build", "runs", "*.egg-info", "__pycache__", ".pytest_cache"))
  build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps",
                          "--no-build-isolation", "-q", "-w", str(wheel_dir), str(source)],
                         capture_output=True, text=True, timeout=300)
  assert build.returncode == 0, build.stderr[-2000:]
  (wheel,) = wheel_dir.glob("hflax-*.whl")
  install = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q",
                            "--target", str(target), str(wheel)],
                           capture_output=True, text=True, timeout=300)
  assert install.returncode == 0, install.stderr[-2000:]
  elsewhere = tmp_path / "elsewhere"
  elsewhere.mkdir()
  # The installed copy first on the path (the dependencies come from this environment).
  env = {**os.environ, "PYTHONPATH": str(target), "HFLAX_CPU_DEVICES": "2"}
  where = subprocess.run([sys.executable, "-c", "import hflax; print(hflax.__file__)"],
                         cwd=elsewhere, env=env, capture_output=True, text=True)
  assert where.stdout.startswith(str(target)), where.stdout + where.stderr
  helped = subprocess.run([sys.executable, "-m", "hflax.launch", "--config", "grpo.py",
                           "--help"], cwd=elsewhere, env=env, capture_output=True, text=True,
                          timeout=300)
  assert helped.returncode == 0, helped.stderr[-2000:]
  assert "--config.trainer.total_steps=" in helped.stdout and "grpo_smollm2.py" in helped.stdout
  ran = subprocess.run([sys.executable, "-m", "hflax.launch", "--config", "grpo.py",
                        "trainer.total_training_steps=2", "--config.trainer.val_every=0",
                        "--config.trainer.val_before_train=False",
                        "--config.trainer.sft_warmup.steps=0", "--config.data.train_batch_size=4",
                        "--config.actor.ppo_mini_batch_size=4", "--config.rollout.n=2",
                        "--config.trainer.export_hf=False", "--config.trainer.log=('jsonl',)",
                        "--config.model.builtin.num_layers=1"],
                       cwd=elsewhere, env=env, capture_output=True, text=True, timeout=600)
  assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]
  metrics = (elsewhere / "runs" / "grpo" / "metrics.jsonl").read_text().splitlines()
  assert [json.loads(line)["step"] for line in metrics if "actor/pg_loss" in line] == [1, 2]


def test_ray_defaults_are_rays_own_and_the_test_settings_are_the_tests():
  from hflax.launch.config import base_config
  k = base_config().cluster
  assert k.require_loopback is False and k.log_to_driver is True
  assert k.include_dashboard is None  # Ray's own default


def test_the_gpu_extra_installs_what_the_kernel_imports():
  import ast
  from test_metrics import _setup_kwargs  # setup.py's arguments, as setuptools gets them
  captured = _setup_kwargs()
  imported = set()
  kernels = os.path.join(ROOT, "hflax", "platforms", "gpu")  # the GPU kernels' package
  for name in os.listdir(kernels):
    if name.endswith(".py"):
      tree = ast.parse(open(os.path.join(kernels, name)).read())
      imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
                   if isinstance(n, ast.ImportFrom)}
      imported |= {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
                   for a in n.names}
  assert "jax_triton" not in imported
  assert captured["extras_require"]["gpu"] == ["jax[cuda12]"]
