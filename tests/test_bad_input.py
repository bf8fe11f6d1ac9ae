"""Malformed inputs: each gives a one-line error naming the problem and a non-zero exit,
before any training work where the problem is knowable up front."""
import json
import os

import pytest

from hflax.launch.__main__ import cli

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "tiny_config.py")


def _files(tmp_path):
  """Inputs the cases point at."""
  good = {"data_source": "arithmetic", "prompt": [{"role": "user", "content": "What is 1+1?"}],
          "reward_model": {"ground_truth": "2"}}
  (tmp_path / "no_prompt.jsonl").write_text(json.dumps({"data_source": "x",
                                                        "reward_model": {"ground_truth": "1"}}))
  rows = [good] * 5
  rows[2] = {**good, "prompt": [{"role": "user", "content": "x" * 500}]}
  (tmp_path / "long.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  (tmp_path / "raises.py").write_text("raise RuntimeError('broken on import')\n")
  (tmp_path / "gpt2").mkdir()
  (tmp_path / "gpt2" / "config.json").write_text(json.dumps(
      {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"}))
  (tmp_path / "noweights").mkdir()
  (tmp_path / "noweights" / "config.json").write_text(json.dumps(
      {"architectures": ["LlamaForCausalLM"], "vocab_size": 261, "hidden_size": 32,
       "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4}))
  (tmp_path / "smallvocab").mkdir()
  (tmp_path / "smallvocab" / "config.json").write_text(json.dumps(
      {"architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 32,
       "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4}))
  (tmp_path / "bad_truth.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
      [good] * 3 + [{**good, "reward_model": {"ground_truth": "forty"}}])))
  (tmp_path / "typo_source.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
      [good, {**good, "data_source": "gsm8kk"}])))
  corrupt = tmp_path / "corrupt_run" / "checkpoints" / "2"
  corrupt.mkdir(parents=True)
  (corrupt / "commit_success.txt").write_text("ok")
  (corrupt / "host").mkdir()
  (corrupt / "host" / "metadata").write_text("not json")
  return good


CASES = {
    "unknown config field": (["--config.actor.nope=1"], "--config.actor.nope: no such config field"),
    "wrong type": (["--config.rollout.n=abc"], "--config.rollout.n=abc"),
    "unknown config file": (["--config=nope_cfg.py"], "is neither a file nor one of"),
    "mini-batch does not divide": (["--config.actor.ppo_mini_batch_size=3"],
                                   "config.actor.ppo_mini_batch_size: 3 does not divide"),
    "micro-batch does not divide": (["--config.actor.ppo_micro_batch_size=3"],
                                    "config.actor.ppo_micro_batch_size: 3 rows do not divide"),
    "mesh larger than the devices": (["--config.placement.kind=standalone", "--config.trainer.devices=3"],
                                     "'standalone' needs the 3 devices to divide"),
    "unknown algorithm": (["--config.algorithm.name=a3c"], "config.algorithm.name: 'a3c'"),
    "unknown estimator": (["--config.algorithm.adv_estimator=magic"],
                          "config.algorithm.adv_estimator: 'magic'"),
    "n too small for grpo": (["--config.rollout.n=1"], "config.rollout.n: grpo compares samples"),
    "missing dataset file": (["--config.data.train_files=/nonexistent/train.parquet"],
                             "config.data.train_files: '/nonexistent/train.parquet' does not exist"),
    "row without a prompt": (["--config.data.train_files={tmp}/no_prompt.jsonl"],
                             "row 0 (line 1): missing field 'prompt'"),
    "prompt too long": (["--config.data.train_files={tmp}/long.jsonl"],
                        "row 2: field 'prompt' is 519 tokens, longer than max_prompt_length=48 "
                        "(raise data.max_prompt_length, leave such rows out: "
                        "data.filter_overlong_prompts=True, or keep their last tokens: "
                        "data.truncate_prompts=True)"),
    "reward file that raises": (["--config.reward.custom_fn.path={tmp}/raises.py",
                                 "--config.reward.custom_fn.name=score"],
                                "importing it raised RuntimeError: broken on import"),
    "reward function without its file": (["--config.reward.custom_fn.name=score"],
                                         "config.reward.custom_fn.path: custom_fn.name='score' "
                                         "needs the Python file"),
    "unsupported architecture": (["--config.model.path={tmp}/gpt2"],
                                 "unsupported architecture ['GPT2LMHeadModel']"),
    "checkpoint without weights": (["--config.model.path={tmp}/noweights",
                                    "--config.model.tokenizer=byte"],
                                   "has neither model.safetensors nor"),
    "missing tokenizer": (["--config.model.tokenizer={tmp}/no_such_tokenizer"], "no_such_tokenizer"),
    "corrupt trainer checkpoint": (["--config.trainer.run_dir={tmp}/corrupt_run"],
                                   "no checkpoint in {tmp}/corrupt_run/checkpoints can be "
                                   "restored (steps [2])"),
    "existing run without resume": (["--config.trainer.run_dir={tmp}/corrupt_run",
                                     "--config.trainer.resume=False"],
                                    "already holds checkpoints up to step 2"),
    "checkpoint older than total_steps asks": (
        ["--config.trainer.run_dir={tmp}/corrupt_run", "--config.trainer.total_steps=1"],
        "config.trainer.total_steps: 1, but"),
    "ground truth the rule cannot judge": (
        ["--config.data.train_files={tmp}/bad_truth.jsonl"],
        "bad_truth.jsonl): row 3: arithmetic ground truth must be an integer, got 'forty'"),
    "data_source without a rule": (["--config.data.val_files={tmp}/typo_source.jsonl"],
                                   "row 1: no rule reward for data_source 'gsm8kk'"),
    "tokenizer larger than the model's vocabulary": (
        ["--config.model.path={tmp}/smallvocab", "--config.model.tokenizer=byte"],
        "config.model.tokenizer: 'byte' has 261 token ids but the model"),
    "more devices than exist": (["--config.trainer.devices=64"], "config.trainer.devices: 64"),
    "misspelled field with a suggestion": (["--config.actor.optim.lrr=1e-5"],
                                           "--config.actor.optim.lrr: no such config field"),
    "bad placement kind": (["--config.placement.kind=scattered"], "config.placement.kind"),
    "negative temperature": (["--config.rollout.temperature=-1.0"], "config.rollout.temperature"),
    "generation width that does not divide the actor's pool": (
        ["--config.rollout.generate_tensor=3"],
        "config.rollout.generate_tensor: 3 does not divide the actor's pool of 2 devices"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gives_one_line_error(name, tmp_path, capsys):
  _files(tmp_path)
  args, message = CASES[name]
  args = [a.replace("{tmp}", str(tmp_path)) for a in args]
  code = cli(["--config", TINY, f"--config.trainer.run_dir={tmp_path}/run", *args])
  err = capsys.readouterr().err.strip()
  assert code != 0
  assert len(err.splitlines()) == 1, err
  assert err.startswith("error: ") and message.replace("{tmp}", str(tmp_path)) in err, err


def test_ray_run_refuses_an_existing_run_dir_before_ray_starts(tmp_path, capsys):
  # On Ray a second run with resume=False used to train, then delete the first run's newer
  # pool checkpoints; now the run_dir is checked before any process starts.
  pytest.importorskip("ray")
  _files(tmp_path)
  code = cli(["--config", TINY, "--config.cluster.backend=ray",
              f"--config.trainer.run_dir={tmp_path}/corrupt_run", "--config.trainer.resume=False"])
  err = capsys.readouterr().err
  assert code == 2 and "already holds checkpoints up to step 2" in err, err
  assert sorted(os.listdir(tmp_path / "corrupt_run" / "checkpoints")) == ["2"]


# Problems found only once the roles are built: each must stop the run before the warm-up
# (2000 steps in the shipped configs), which is made to fail here if it ever starts.
BEFORE_WARMUP = {
    "reward model directory missing": (
        ["--config.reward.kind=model", "--config.reward.model_path={tmp}/nonexistent"],
        "config.reward.model_path: no config.json in checkpoint directory"),
    "critic model directory missing": (
        ["--config.algorithm.name=ppo", "--config.algorithm.adv_estimator=gae",
         "--config.critic.model_path={tmp}/nonexistent"],
        "config.critic.model_path: no config.json"),
    "a needed role without a pool": (
        ["--config={tmp}/actor_only.py", "--config.reward.kind=model",
         "--config.reward.model_path={tmp}/nonexistent"],
        "config.placement.roles: no pool for reward for reward.kind='model'"),
    "negative validation temperature": (["--config.rollout.val_temperature=-1.0"],
                                        "config.rollout.val_temperature: must be >= 0"),
    "warm-up batch of zero rows": (["--config.trainer.sft_warmup.batch_size=0"],
                                   "config.trainer.sft_warmup.batch_size: must be an integer >= 1"),
    "wandb without a project": (["--config.trainer.log=('jsonl','wandb')"],
                                "config.trainer.wandb_project: trainer.log has 'wandb'"),
    "gamma above 1": (["--config.algorithm.gamma=1.5"], "config.algorithm.gamma: must be in [0, 1]"),
    "micro-batch smaller than the data width": (
        ["--config.trainer.devices=4", "--config.actor.ppo_micro_batch_size=2"],
        "config.actor.ppo_micro_batch_size: 2 rows per micro-batch are fewer than the actor's "
        "data-parallel size 4"),
    "generation width of zero": (["--config.rollout.generate_tensor=0"],
                                 "config.rollout.generate_tensor: must be an integer >= 1"),
    "ray pool that processes cannot split": (
        ["--config.cluster.backend=ray", "--config.cluster.devices_per_process=3"],
        "config.cluster.devices_per_process: 3 does not divide"),
}


@pytest.mark.parametrize("name", list(BEFORE_WARMUP))
def test_bad_input_stops_the_run_before_the_warmup(name, tmp_path, capsys, monkeypatch):
  import hflax.launch.trainer as trainer
  if "ray" in name:
    pytest.importorskip("ray")

  def warmup(*args, **kwargs):
    raise AssertionError("the warm-up started")
  monkeypatch.setattr(trainer, "sft_warmup", warmup)
  (tmp_path / "actor_only.py").write_text(
      f"import runpy\nget = runpy.run_path({TINY!r})['get_config']\n\n"
      "def get_config():\n  c = get()\n  c.placement.kind = 'custom'\n"
      "  c.placement.pools = {'all': 2}\n"
      "  c.placement.roles = {r: {'pool': 'all'} for r in ('actor', 'ref')}\n  return c\n")
  args, message = BEFORE_WARMUP[name]
  args = [a.replace("{tmp}", str(tmp_path)) for a in args]
  config = next((a.split("=", 1)[1] for a in args if a.startswith("--config=")), TINY)
  args = [a for a in args if not a.startswith("--config=")]
  code = cli(["--config", config, f"--config.trainer.run_dir={tmp_path}/run",
              "--config.trainer.sft_warmup.steps=5", *args])
  err = capsys.readouterr().err.strip()
  assert code != 0 and len(err.splitlines()) == 1, err
  assert err.startswith("error: ") and message in err, err
