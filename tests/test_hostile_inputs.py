"""Hostile inputs, one class after another (configs, data, models, reward code, run
directories, environment variables): each ends the launcher with exit status 2 and one
line naming the field, file, row or function, and leaves no new checkpoint or export."""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from hflax.launch.__main__ import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "tiny_config.py")
GOOD = {"data_source": "arithmetic", "prompt": [{"role": "user", "content": "What is 1+1?"}],
        "reward_model": {"ground_truth": "2"}}
VERL_SIGNATURE = "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"


def _jsonl(path, rows):
  path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def _inputs(t):
  """The files the cases point at, under the test's tmp_path `t`."""
  (t / "syntax.py").write_text("def get_config(:\n  pass\n")
  (t / "returns_none.py").write_text("def get_config():\n  return None\n")
  (t / "no_get_config.py").write_text("X = 1\n")
  (t / "config_raises.py").write_text("raise ImportError('no module named secrets_lib')\n")
  _jsonl(t / "wizard.jsonl", [{**GOOD, "prompt": [{"role": "wizard", "content": "hi"}]}] * 4)
  _jsonl(t / "gsm8k_words.jsonl", [{**GOOD, "data_source": "openai/gsm8k",
                                    "reward_model": {"ground_truth": "forty two"}}] * 4)
  _jsonl(t / "good.jsonl", [GOOD] * 8)
  _jsonl(t / "no_prompt.jsonl", [{"data_source": "arithmetic",
                                  "reward_model": {"ground_truth": "1"}}])
  (t / "empty_dir").mkdir()
  model = t / "truncated_model"
  model.mkdir()
  (model / "config.json").write_text(json.dumps(
      {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 261,
       "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
       "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}))
  from safetensors.numpy import save_file
  save_file({"model.embed_tokens.weight": np.zeros((261, 32), np.float32)},
            str(model / "model.safetensors"))
  data = (model / "model.safetensors").read_bytes()
  (model / "model.safetensors").write_bytes(data[:len(data) // 2])
  (t / "gpt2").mkdir()
  (t / "gpt2" / "config.json").write_text(json.dumps(
      {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
  rewards = {"exits": "  import sys\n  sys.exit(0)\n",
             "sleeps": "  import time\n  time.sleep(60)\n  return 0.0\n",
             "nan": "  return float('nan')\n", "word": "  return 'high'\n",
             "inf_dict": "  return {'score': float('inf')}\n"}
  for name, body in rewards.items():
    (t / f"reward_{name}.py").write_text(VERL_SIGNATURE + body)
  (t / "reward_import_fails.py").write_text("raise RuntimeError('broken on import')\n")
  (t / "reward_needs_tokenizer.py").write_text(
      "def compute_score(solution_str, ground_truth, tokenizer):\n  return 0.0\n")
  (t / "a_file").write_text("not a directory")
  run = t / "corrupt_run" / "checkpoints" / "2"
  run.mkdir(parents=True)
  (run / "commit_success.txt").write_text("ok")
  (run / "host").mkdir()
  (run / "host" / "metadata").write_text("not json")


R = "--config.reward.custom_fn.path={t}/reward_"
ONE_STEP = "--config.trainer.total_steps=1"
CASES = {
    # configs
    "learning rate nan": (["--config.actor.optim.lr=nan"], "config.actor.optim.lr"),
    "learning rate 1e400": (["--config.actor.optim.lr=1e400"], "config.actor.optim.lr"),
    "negative learning rate": (["--config.actor.optim.lr=-1.0"], "config.actor.optim.lr"),
    "kl coefficient inf": (["--config.actor.kl_loss_coef=inf"], "config.actor.kl_loss_coef"),
    "entropy coefficient nan": (["--config.actor.entropy_coeff=nan"],
                                "config.actor.entropy_coeff"),
    "Adam b2 of 1": (["--config.actor.optim.b2=1.0"], "config.actor.optim.b2"),
    "temperature inf": (["--config.rollout.temperature=inf"], "config.rollout.temperature"),
    "negative data seed": (["--config.data.seed=-1"], "config.data.seed"),
    "negative reward time limit": (["--config.reward.timeout_s=-1.0"], "config.reward.timeout_s"),
    "verl resume_mode of another kind": (["trainer.resume_mode=sometimes"],
                                         "trainer.resume_mode: 'sometimes'"),
    "config file with a syntax error": ([], "--config {t}/syntax.py: line 1: SyntaxError",
                                        "syntax.py"),
    "get_config returns None": ([], "get_config() returned NoneType", "returns_none.py"),
    "config file without get_config": ([], "defines no get_config()", "no_get_config.py"),
    "config file that raises": ([], "running it raised ImportError: no module named "
                                    "secrets_lib", "config_raises.py"),
    # data
    "unknown chat role": (["--config.data.train_files={t}/wizard.jsonl"],
                          "wizard.jsonl: row 0 (line 1): field 'prompt[0].role' is 'wizard'"),
    "gsm8k ground truth in words": (["--config.data.train_files={t}/gsm8k_words.jsonl"],
                                    "row 0: gsm8k ground truth must be a number, got "
                                    "'forty two'"),
    "a missing file in a list": (["data.train_files=[{t}/good.jsonl,{t}/missing.jsonl]"],
                                 "config.data.train_files: '{t}/missing.jsonl' does not exist"),
    "an empty directory": (["--config.data.train_files={t}/empty_dir"],
                           "config.data.train_files: prompt directory '{t}/empty_dir' holds no"),
    "prompt_key naming no column": (["--config.data.train_files={t}/good.jsonl",
                                     "--config.data.prompt_key=question"],
                                    "good.jsonl: row 0 (line 1): missing field 'question'"),
    "row without a prompt": (["--config.data.val_files={t}/no_prompt.jsonl"],
                             "no_prompt.jsonl: row 0 (line 1): missing field 'prompt'"),
    # models
    "truncated safetensors": (["--config.model.path={t}/truncated_model",
                               "--config.model.tokenizer=byte"],
                              "config.model.path: {t}/truncated_model/model.safetensors: not a "
                              "readable safetensors file"),
    "unsupported architecture": (["--config.model.path={t}/gpt2"],
                                 "config.model.path: {t}/gpt2/config.json: unsupported "
                                 "architecture"),
    "missing model directory": (["--config.model.path={t}/no_such_model"],
                                "config.model.path: no config.json in checkpoint directory"),
    "LoRA on the router of a dense model": (["--config.model.lora_rank=4",
                                             "--config.model.target_modules=q_proj,gate"],
                                            "config.model.target_modules: 'gate' names a "
                                            "mixture of experts' router"),
    "LoRA on a shared expert gate the model lacks": (
        ["--config.model.lora_rank=4", "--config.model.target_modules=shared_expert_gate"],
        "config.model.target_modules: 'shared_expert_gate' names Qwen2-MoE's shared expert "
        "gate; the built-in model has no shared expert"),
    # reward code
    "reward exits": ([R + "exits.py", ONE_STEP],
                     "reward function compute_score (reward_exits.py) raised SystemExit(0)"),
    "reward sleeps past its limit": ([R + "sleeps.py", "--config.reward.timeout_s=1.0", ONE_STEP],
                                     "reward function compute_score (reward_sleeps.py) took "
                                     "longer than timeout_s=1"),
    "reward returns nan": ([R + "nan.py", ONE_STEP],
                           "reward function compute_score (reward_nan.py) returned nan"),
    "reward returns a word": ([R + "word.py", ONE_STEP],
                              "reward function compute_score (reward_word.py) returned 'high'"),
    "reward dict with inf": ([R + "inf_dict.py", ONE_STEP],
                             "reward function compute_score (reward_inf_dict.py) returned inf"),
    "reward file raises on import": ([R + "import_fails.py"],
                                     "importing it raised RuntimeError: broken on import"),
    "reward function not in the file": ([R + "nan.py", "--config.reward.custom_fn.name=score"],
                                        "reward_nan.py defines no 'score'"),
    "reward needs an argument verl never passes": ([R + "needs_tokenizer.py"],
                                                   "compute_score (reward_needs_tokenizer.py) is "
                                                   "called verl's way"),
    # run directories
    "run_dir is a file": (["--config.trainer.run_dir={t}/a_file"],
                          "config.trainer.run_dir: '{t}/a_file' is a file"),
    "run_dir under a file": (["--config.trainer.run_dir={t}/a_file/run"],
                             "config.trainer.run_dir: '{t}/a_file/run' lies under"),
    "rollout_data_dir is a file": (["--config.trainer.rollout_data_dir={t}/a_file"],
                                   "config.trainer.rollout_data_dir: '{t}/a_file' is a file"),
    "no checkpoint restores": (["--config.trainer.run_dir={t}/corrupt_run"],
                               "no checkpoint in {t}/corrupt_run/checkpoints can be restored"),
    "existing run without resume": (["--config.trainer.run_dir={t}/corrupt_run",
                                     "--config.trainer.resume=False"],
                                    "already holds checkpoints up to step 2"),
}


def _state(run_dir):
  """What a run leaves: its checkpoint steps and whether it exported."""
  ckpts = run_dir / "checkpoints"
  steps = sorted(os.listdir(ckpts)) if ckpts.is_dir() else []
  return steps, (run_dir / "hf_actor").exists()


@pytest.mark.parametrize("name", list(CASES))
def test_hostile_input_is_one_line_with_status_2(name, tmp_path, capsys):
  _inputs(tmp_path)
  args, message, *config = CASES[name]
  fill = lambda s: s.replace("{t}", str(tmp_path))  # noqa: E731
  args = [fill(a) for a in args]
  run_dir = next((a.split("=", 1)[1] for a in args if a.startswith("--config.trainer.run_dir=")),
                 None)
  if run_dir is None:
    run_dir = str(tmp_path / "run")
    args.append(f"--config.trainer.run_dir={run_dir}")
  before = _state(pathlib.Path(run_dir))
  config = str(tmp_path / config[0]) if config else TINY
  code = cli(["--config", config, *args])
  err = capsys.readouterr().err.strip()
  assert code == 2, err
  assert len(err.splitlines()) == 1, err
  assert err.startswith("error: ") and fill(message) in err, err
  if os.path.isdir(run_dir):
    assert _state(pathlib.Path(run_dir)) == before


def test_a_bad_environment_variable_is_one_line_with_status_2(tmp_path):
  env = {**os.environ, "HFLAX_CPU_DEVICES": "two", "PYTHONPATH": ROOT}
  env.pop("XLA_FLAGS", None)
  done = subprocess.run([sys.executable, "-m", "hflax.launch", "--config", TINY,
                         f"--config.trainer.run_dir={tmp_path}/run"], env=env, cwd=tmp_path,
                        capture_output=True, text=True, timeout=120)
  assert done.returncode == 2
  assert done.stderr.strip() == ("error: environment variable HFLAX_CPU_DEVICES: 'two' is not a "
                                 "whole number >= 1 (simulated CPU devices; unset it for 2)")
  assert not (tmp_path / "run").exists()


def test_hflax_debug_shows_the_traceback_of_a_user_error(tmp_path, capsys, monkeypatch):
  monkeypatch.setenv("HFLAX_DEBUG", "1")
  code = cli(["--config", TINY, f"--config.trainer.run_dir={tmp_path}/run",
              "--config.actor.optim.lr=nan"])
  err = capsys.readouterr().err
  assert code == 2 and "Traceback (most recent call last)" in err
  assert err.strip().splitlines()[-1].startswith("error: config.actor.optim.lr")
