"""The main job: config validation, the CLI, an end-to-end run with every artifact, exact
resume, and real data / custom reward / HF checkpoint inputs."""
import copy
import dataclasses
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from hflax.launch.config import base_config, validate
from hflax.launch.trainer import Trainer
from hflax.models import hf
from hflax.rewards import validation_metrics
from hflax.rewards.validation import concat_extra_info

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def tiny(tmp_path, name="grpo", **trainer):
  c = base_config()
  c.algorithm.name = name
  c.algorithm.adv_estimator = "gae" if name == "ppo" else "grpo"
  c.actor.use_kl_loss = name == "grpo"
  c.rollout.n = 2
  c.data.train_batch_size = 4
  c.actor.ppo_mini_batch_size = c.critic.ppo_mini_batch_size = 2
  c.data.builtin.update(num_train=64, num_val=8)
  c.data.val_batch_size = 8
  c.model.builtin.update(hidden_size=32, intermediate_size=64, num_layers=1)
  c.trainer.update(total_steps=4, save_every=2, val_every=2, devices=2, run_dir=str(tmp_path / "run"),
                   log=("jsonl", "tensorboard"))
  c.trainer.sft_warmup.update(steps=3, batch_size=8, cache_dir=str(tmp_path / "sft"))
  c.trainer.update(**trainer)
  return c


@pytest.mark.parametrize("field,value,message", [
    ("algorithm.name", "a2c", "config.algorithm.name: 'a2c' is not one of"),
    ("actor.ppo_mini_batch_size", 3, "config.actor.ppo_mini_batch_size: 3 does not divide"),
    ("rollout.n", 0, "config.rollout.n: must be an integer >= 1"),
    ("actor.loss_agg_mode", "mean", "config.actor.loss_agg_mode: 'mean' is not one of"),
    ("placement.kind", "scattered", "config.placement.kind: 'scattered' is not one of"),
    # Fields otherwise read only deep inside a step, after warm-up and role building.
    ("critic.ppo_mini_batch_size", 0, "config.critic.ppo_mini_batch_size: must be an integer"),
    ("critic.ppo_epochs", 0, "config.critic.ppo_epochs: must be an integer >= 1"),
    ("actor.ppo_micro_batch_size", -1, "config.actor.ppo_micro_batch_size: must be an integer"),
    ("algorithm.kl_ctrl.type", "adaptiv", "config.algorithm.kl_ctrl.type: 'adaptiv' is not"),
    ("actor.kl_loss_type", "bogus", "config.actor.kl_loss_type: 'bogus' is not one of"),
    ("actor.optim.schedule", "cosinee", "config.actor.optim.schedule: 'cosinee' is not"),
    ("rollout.top_p", 2.0, "config.rollout.top_p: must be in (0, 1]"),
    ("rollout.top_k", -1, "config.rollout.top_k: must be an integer >= 0"),
    ("rollout.val_top_p", 0.0, "config.rollout.val_top_p: must be in (0, 1]"),
    ("rollout.val_n", 0, "config.rollout.val_n: must be an integer >= 1"),
    ("rollout.val_n", 4, "config.rollout.val_n: 4 samples per prompt with rollout.val_temperature=0"),
    ("trainer.save_every", 0, "config.trainer.save_every: must be an integer >= 1"),
    ("trainer.keep", 0, "config.trainer.keep: must be an integer >= 1"),
    ("data.val_batch_size", 0, "config.data.val_batch_size: must be an integer >= 1"),
    ("model.dtype", "float17", "config.model.dtype: 'float17' is not one of"),
    ("rollout.dtype", "foo", "config.rollout.dtype: 'foo' is not one of"),
    ("trainer.log", ("jsonl,",), "config.trainer.log: unknown metrics backends"),
    ("actor.policy_loss", "gspo", "config.actor.loss_agg_mode: 'token-mean' with policy_loss"),
    ("data.builtin.num_val", 0, "config.data.builtin.num_val: must be an integer >= 1"),
])
def test_validation_names_the_field(field, value, message):
  c = base_config()
  *path, key = field.split(".")
  section = c
  for name in path:
    section = section[name]
  section[key] = value
  with pytest.raises(ValueError, match=message.replace("(", r"\(")):
    validate(c)


def test_sft_warmup_fields_are_checked():
  for field, value, message in [("steps", -1, "must be an integer >= 0"),
                                ("target_loss", -0.5, "must be >= 0")]:
    c = base_config()
    c.trainer.sft_warmup[field] = value
    with pytest.raises(ValueError, match=f"config.trainer.sft_warmup.{field}: {message}"):
      validate(c)


def test_sft_warmup_stops_at_its_target_loss(tmp_path):
  from hflax.launch.roles import policy_model
  from hflax.launch.sft import LOSS_WINDOW, sft_warmup
  from hflax.launch.trainer import load_datasets
  from hflax.models.tokenizer import load_tokenizer
  c = tiny(tmp_path)
  tokenizer = load_tokenizer("byte")
  rows = list(load_datasets(c)[0])

  def run(steps, target_loss):
    c.trainer.sft_warmup.update(steps=steps, target_loss=target_loss)
    logs = []
    sft_warmup(c, policy_model(c, tokenizer.vocab_size, tokenizer), tokenizer, rows,
               log=logs.append)
    return logs

  stopped = run(200, 100.0)  # every loss is below 100: stops once the window is full
  assert any(f"reached target_loss=100.0 at step {LOSS_WINDOW}" in line for line in stopped)
  assert not any("step 200/200" in line for line in stopped)
  full = run(LOSS_WINDOW + 5, 1e-9)  # never reached: every step runs
  assert not any("reached" in line for line in full)
  assert any(f"step {LOSS_WINDOW + 5}/{LOSS_WINDOW + 5}" in line for line in full)


def _cli(*args, timeout=120):
  return subprocess.run([sys.executable, "-m", "hflax.launch", *args], cwd=ROOT, timeout=timeout,
                        capture_output=True, text=True,
                        env={**os.environ, "PYTHONPATH": ROOT, "HFLAX_CPU_DEVICES": "2"})


def test_cli_help_and_errors_before_any_device_work():
  helped = _cli("--config", "grpo.py", "--help")
  assert helped.returncode == 0, helped.stderr
  assert "--config.actor.optim.lr=" in helped.stdout and "--config.rollout.n=8" in helped.stdout
  missing = _cli("--config", "nope.py")
  assert missing.returncode != 0 and "grpo.py" in missing.stderr  # lists the known configs
  bad = _cli("--config", "grpo.py", "--config.rollout.n=0")
  assert bad.returncode != 0 and "config.rollout.n: must be an integer >= 1" in bad.stderr
  assert "sft warm-up" not in bad.stdout  # rejected before anything ran


def test_validation_with_several_samples_per_prompt(tmp_path):
  reward = tmp_path / "first_byte.py"
  reward.write_text("def score(text, truth, info):\n"
                    "  return {'score': ord(text[0]) % 7 / 6 if text else 0.0,"
                    " 'pred': text[:1] or None}\n")
  c = tiny(tmp_path, total_steps=1)
  c.trainer.sft_warmup.steps = 0
  c.reward.custom_fn.update(path=str(reward), name="score")
  c.rollout.update(val_n=4, val_temperature=1.0)
  c.data.builtin.num_val = 12  # two batches of 8 prompts, the second short
  trainer = Trainer(c, log=lambda *_: None)
  seen, prompts = [], []
  score = trainer.reward_fn

  def spy(batch, details):
    prompts.extend(p[0]["content"] for p in batch["raw_prompt"])
    seen.append(score(batch, details))
    return seen[-1]
  trainer.reward_fn = spy
  m = trainer.validate()
  texts = [t for out in seen for t in out["response_text"]]
  assert len(texts) == 48 and all(len(set(texts[i:i + 4])) > 1 for i in range(0, 48, 4))
  # Rows i*4 .. i*4+3 are one prompt's samples, and the 12 prompts are all there.
  assert all(len(set(prompts[i:i + 4])) == 1 for i in range(0, 48, 4))
  assert len(set(prompts)) == 12
  scores = np.concatenate([out["scores"] for out in seen])
  extras = concat_extra_info([out["reward_extra_info"] for out in seen],
                             [len(out["scores"]) for out in seen])
  assert m == validation_metrics(scores, ["arithmetic"] * 48, 4, [t[:1] or None for t in texts],
                                 extra_info=extras)
  core, aux = "val-core/arithmetic/reward", "val-aux/arithmetic/reward"
  assert m[f"{core}/best@4/mean"] > m[f"{aux}/best@2/mean"] > m[f"{core}/mean@4"] > \
      m[f"{aux}/worst@2/mean"] > m[f"{aux}/worst@4/mean"]
  assert f"{core}/maj@4/mean" in m and m[f"{aux}/std@4"] > 0
  trainer.reward_fn = score
  assert trainer.validate() == m  # the same sampling keys every time
  # rollout.max_num_seqs=4: one prompt's 4 samples per wave, and the same samples.
  c.rollout.max_num_seqs = 4
  capped = Trainer(c, log=lambda *_: None)
  assert capped.roles.actor.max_num_seqs == 4 and capped.validate() == m
  c.rollout.max_num_seqs = 0
  c.rollout.update(val_n=1, val_temperature=0.0)
  # The dict's score is also reported as an extra, under val-aux (as verl does).
  assert sorted(Trainer(c, log=lambda *_: None).validate()) == [
      "val-aux/arithmetic/score/mean@1", f"{core}/mean@1"]


def _read_jsonl(path):
  with open(path) as f:
    return {row["step"]: row for row in map(json.loads, f)}


def _leaves(state):
  return [np.asarray(x) for x in jax.tree.leaves(state)]


def test_end_to_end_run_artifacts_and_exact_resume(tmp_path):
  straight = Trainer(tiny(tmp_path / "a", log_val_generations=3), log=lambda *_: None)
  result = straight.fit()
  run_dir = tmp_path / "a" / "run"
  # verl's log_val_generations: the same 3 held-out prompts at every validation.
  shown = [json.loads(line) for line in (run_dir / "val_generations.jsonl").open()]
  assert [row["step"] for row in shown] == [0, 2, 4]
  assert len({tuple(s["input"] for s in row["samples"]) for row in shown}) == 1
  assert all(len(row["samples"]) == 3 for row in shown)
  rows = _read_jsonl(run_dir / "metrics.jsonl")
  assert sorted(rows) == [0, 1, 2, 3, 4]  # step 0: validation before training
  assert rows[0] == {"step": 0, **result["before"]}
  for key in ("actor/pg_loss", "actor/pg_clipfrac", "actor/ppo_kl", "actor/entropy",
              "actor/kl_loss", "actor/grad_norm", "critic/score/mean", "response_length/mean",
              "timing_s/gen", "timing_s/step", "perf/throughput", "reshard/bytes_moved",
              "prompt_length/clip_ratio"):
    assert key in rows[1], key
  assert "val-core/arithmetic/reward/mean@1" in rows[2]
  assert 0 <= result["before"]["val-core/arithmetic/reward/mean@1"] <= 1
  assert os.listdir(run_dir / "tensorboard")
  assert (run_dir / "metrics.png").read_bytes()[:4] == b"\x89PNG"
  import transformers
  exported = transformers.AutoModelForCausalLM.from_pretrained(run_dir / "hf_actor")
  assert exported.config.vocab_size == straight.model_cfg.vocab_size
  # The export carries its tokenizer: model.path alone starts a new run from it.
  from hflax.launch.config import tokenizer_spec
  from hflax.models.tokenizer import ByteTokenizer, load_tokenizer
  again = tiny(tmp_path / "from_export")
  again.model.path = str(run_dir / "hf_actor")
  assert isinstance(load_tokenizer(tokenizer_spec(again)), ByteTokenizer)

  # Stop after 2 steps, then resume to 4: the same parameters and metrics as straight.
  Trainer(tiny(tmp_path / "b", total_steps=2), log=lambda *_: None).fit()
  resumed = Trainer(tiny(tmp_path / "b"), log=lambda *_: None)
  resumed.fit()
  for a, b in zip(_leaves(straight.roles.actor.params), _leaves(resumed.roles.actor.params)):
    np.testing.assert_array_equal(a, b)
  rows_b = _read_jsonl(tmp_path / "b" / "run" / "metrics.jsonl")
  for step in (3, 4):
    for key in ("actor/pg_loss", "critic/score/mean", "response_length/mean"):
      assert rows_b[step][key] == rows[step][key], (step, key)


def test_resume_restores_the_packed_shape_floors(tmp_path):
  """Packed passes never shrink their (length, slots) within a run (shape_floor); a resumed
  run starts from the floors the checkpoint saved, so it packs as the uninterrupted one."""
  c = tiny(tmp_path, name="ppo", total_steps=2, val_before_train=False, val_every=0)
  c.model.use_remove_padding = True
  first = Trainer(c, log=lambda *_: None)
  first.fit()
  floors = {r: dict(getattr(first.roles, r)._shape_floors) for r in ("actor", "critic")}
  assert all(floors.values()) and all(min(v) > 0 for f in floors.values() for v in f.values())
  c.trainer.total_steps = 3
  resumed = Trainer(c, log=lambda *_: None)
  assert resumed.resume() == 2
  assert {r: getattr(resumed.roles, r)._shape_floors for r in floors} == floors


def test_lora_ppo_reference_in_actor_merged_export_and_exact_resume(tmp_path):
  from hflax.models.transformer import logits_fn

  def lora(path, **trainer):  # PPO: LoRA on the actor and on the critic
    c = tiny(path, name="ppo", val_every=0, val_before_train=False, **trainer)
    c.actor.use_kl_loss = True
    c.model.update(lora_rank=4, lora_alpha=8.0, target_modules="q_proj,v_proj,up_proj")
    c.critic.update(lora_rank=2, lora_alpha=4.0, target_modules="k_proj,down_proj")
    c.actor.optim.lr = 1e-2  # adapters start at B = 0: let them move within 4 steps
    return c

  straight = Trainer(lora(tmp_path / "a"), log=lambda *_: None)
  actor = straight.roles.actor
  assert straight.roles.ref is actor  # no reference worker, pool or weight copy
  straight.fit()
  run_dir = tmp_path / "a" / "run"
  rows = _read_jsonl(run_dir / "metrics.jsonl")
  assert rows[4]["actor/kl_loss"] > 0 and "timing_s/ref" in rows[4]
  # hf_actor holds the adapters merged in; lora_adapter is PEFT's format.
  _, graphdef, merged = hf.load_checkpoint(str(run_dir / "hf_actor"))
  tokens = np.random.RandomState(0).randint(3, 200, (2, 12))
  np.testing.assert_allclose(logits_fn(graphdef, merged, tokens, np.ones_like(tokens)),
                             logits_fn(actor.graphdef, actor.params, tokens, np.ones_like(tokens)),
                             atol=1e-5)
  adapter = json.loads((run_dir / "lora_adapter" / "adapter_config.json").read_text())
  assert (adapter["r"], adapter["lora_alpha"]) == (4, 8.0)
  assert sorted(adapter["target_modules"]) == ["q_proj", "up_proj", "v_proj"]
  # A new run starts its adapters from that directory (the same seed gives the same base).
  from hflax.models.lora import split_adapters
  c = lora(tmp_path / "from_adapter")
  c.model.lora_adapter_path = str(run_dir / "lora_adapter")
  started = Trainer(c, log=lambda *_: None).roles.actor.params
  for a, b in zip(_leaves(split_adapters(started)[0]), _leaves(split_adapters(actor.params)[0]),
                  strict=True):
    np.testing.assert_array_equal(a, b)

  # Checkpoints keep the adapters, not the frozen base (resume rebuilds it from the seed).
  saved = json.loads((run_dir / "checkpoints" / "4" / "actor_params" / "_METADATA").read_text())
  names = list(saved["tree_metadata"])
  assert names and all("lora_a" in n or "lora_b" in n for n in names), names[:5]
  Trainer(lora(tmp_path / "b", total_steps=2), log=lambda *_: None).fit()
  resumed = Trainer(lora(tmp_path / "b"), log=lambda *_: None)
  resumed.fit()
  for role in ("actor", "critic"):
    for a, b in zip(_leaves(getattr(straight.roles, role).params),
                    _leaves(getattr(resumed.roles, role).params), strict=True):
      np.testing.assert_array_equal(a, b)
  assert split_adapters(resumed.roles.critic.params)[0]  # the critic has adapters too
  # A base that is not the one the adapters were trained on (another seed) is refused.
  with pytest.raises(ValueError, match="frozen base weights .* not the ones checkpoint step 4"):
    Trainer(lora(tmp_path / "b", seed=1), log=lambda *_: None).fit()


def test_jsonl_data_custom_reward_and_hf_checkpoint(tmp_path):
  from hflax.data import save_prompts
  from hflax.launch.roles import policy_model
  from hflax.models.tokenizer import ByteTokenizer
  rows = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"Q{i}?"}],
           "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(i)},
           "extra_info": {"index": i}} for i in range(8)]
  save_prompts(rows, tmp_path / "train.parquet")
  save_prompts(rows, tmp_path / "val.jsonl")
  (tmp_path / "reward.py").write_text(
      "def length_reward(response, ground_truth, extra_info):\n"
      "  return 1.0 + len(response) * 0.0 + extra_info['index'] * 0.0\n")
  c = tiny(tmp_path, name="ppo", total_steps=1, val_every=0, val_before_train=False,
           export_hf=False)
  c.trainer.sft_warmup.steps = 0
  c.data.train_files, c.data.val_files = str(tmp_path / "train.parquet"), str(tmp_path / "val.jsonl")
  c.reward.custom_fn.update(path=str(tmp_path / "reward.py"), name="length_reward")
  model_cfg, _, state = policy_model(c, ByteTokenizer.vocab_size, ByteTokenizer())
  # Weights no fresh initialisation could produce, so the actor must have read the file.
  state = jax.tree.map(lambda x: x + 0.25, state)
  hf.export_checkpoint(str(tmp_path / "init"), model_cfg, state)
  c.model.path, c.model.tokenizer = str(tmp_path / "init"), "byte"
  trainer = Trainer(c, log=lambda *_: None)
  for got, want in zip(_leaves(trainer.roles.actor.params), _leaves(state), strict=True):
    np.testing.assert_array_equal(got, want)
  trainer.fit()
  row = _read_jsonl(tmp_path / "run" / "metrics.jsonl")[1]
  assert row["critic/score/mean"] == 1.0  # every response scored by the user's function
  assert "critic/vf_loss" in row


def test_overlong_prompts_left_out_of_training_and_validation(tmp_path):
  from hflax.data import save_prompts
  rows = [{"data_source": "arithmetic", "prompt": [{"role": "user", "content": q}],
           "reward_model": {"ground_truth": "2"}, "extra_info": {}}
          for q in ["1+1?"] * 5 + ["what is " * 20 + "1+1?"] * 2]
  save_prompts(rows, tmp_path / "data.jsonl")
  c = tiny(tmp_path, total_steps=1)
  c.trainer.sft_warmup.steps = 0
  c.data.train_files = c.data.val_files = str(tmp_path / "data.jsonl")
  c.data.val_batch_size = 2
  with pytest.raises(ValueError, match="row 5: field 'prompt' is .* data.filter_overlong_prompts"):
    Trainer(c, log=lambda *_: None)
  c.data.truncate_prompts = c.data.filter_overlong_prompts = True
  with pytest.raises(ValueError, match="config.data.filter_overlong_prompts: .* choose one"):
    validate(c)
  c.data.truncate_prompts = False
  lines = []
  trainer = Trainer(c, log=lines.append)
  data_lines = [line for line in lines if line.startswith("data.")]
  assert data_lines[:2] == [f"data.{which}: left out 2 of 7 rows longer than max_prompt_length=48 "
                            "(data.filter_overlong_prompts)"
                            for which in ("train_files", "val_files")]
  seen = []
  score = trainer.reward_fn
  trainer.reward_fn = lambda batch, details: seen.append(batch["raw_prompt"]) or score(batch, details)
  trainer.validate()
  assert [len(b) for b in seen] == [2, 2, 1]  # val_batch_size rows at a time, the short kept
  assert all(p[0]["content"] == "1+1?" for b in seen for p in b)
  trainer.reward_fn = score
  trainer.fit()
  batches = [trainer.loader.next_batch()["row_index"] for _ in range(5)]
  assert set(np.concatenate(batches).tolist()) == {0, 1, 2, 3, 4}


def test_generation_dumps_and_validating_a_finished_run(tmp_path, monkeypatch):
  c = tiny(tmp_path, total_steps=2, save_every=1, export_hf=False, log=("jsonl",))
  (tmp_path / "first_byte.py").write_text(  # scores that differ, so advantages do too
      "def score(text, truth, info):\n  return ord(text[0]) % 7 / 6 if text else 0.0\n")
  c.reward.custom_fn.update(path=str(tmp_path / "first_byte.py"), name="score")
  c.trainer.update(rollout_data_dir=str(tmp_path / "rollouts"),
                   validation_data_dir=str(tmp_path / "val"))
  result = Trainer(c, log=lambda *_: None).fit()
  logged = _read_jsonl(tmp_path / "run" / "metrics.jsonl")
  assert sorted(os.listdir(tmp_path / "rollouts")) == ["1.jsonl", "2.jsonl"]
  for step in (1, 2):
    rows = _read_lines(tmp_path / "rollouts" / f"{step}.jsonl")
    assert len(rows) == 4 * 2 and {r["step"] for r in rows} == {step}  # prompts x rollout.n
    assert all("What is" in r["input"] and r["data_source"] == "arithmetic" for r in rows)
    assert np.mean([r["score"] for r in rows]) == pytest.approx(logged[step]["critic/score/mean"])
    # GRPO: a group's advantages sum to zero (its scores' deviations from their mean).
    for group in range(0, 8, 2):
      assert rows[group]["advantage"] == pytest.approx(-rows[group + 1]["advantage"], abs=1e-5)
    assert any(r["advantage"] != 0 for r in rows)
  assert sorted(os.listdir(tmp_path / "val")) == ["0.jsonl", "2.jsonl"]
  val = _read_lines(tmp_path / "val" / "2.jsonl")
  assert len(val) == 8 and "advantage" not in val[0]
  assert np.mean([r["score"] for r in val]) == result["after"]["val-core/arithmetic/reward/mean@1"]
  # val_only: the finished run's latest checkpoint, validated again without training
  # (total_steps need not reach the checkpoint's step).
  c.trainer.update(val_only=True, rollout_data_dir="", total_steps=1)

  def refuse(*_, **__):
    raise AssertionError("val_only saved or exported")
  monkeypatch.setattr(Trainer, "save", refuse)
  monkeypatch.setattr(hf, "export_checkpoint", refuse)
  again = Trainer(c, log=lambda *_: None).fit()
  assert again["before"] == result["after"]  # greedy: the same policy answers alike
  c.rollout.update(val_n=2, val_temperature=1.0)
  Trainer(c, log=lambda *_: None).fit()
  assert "val-core/arithmetic/reward/best@2/mean" in _read_jsonl(tmp_path / "run" / "metrics.jsonl")[2]


def _read_lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


def test_placement_auto_runs_the_best_plan(tmp_path, monkeypatch):
  from hflax.launch.plan import ranked_plans
  from hflax.sharding.automap import calibration
  monkeypatch.setattr(calibration, "CACHE_DIR", str(tmp_path / "cache"))  # measured here
  c = tiny(tmp_path, name="ppo", total_steps=1, val_every=0, val_before_train=False,
           export_hf=False, devices=4)
  c.placement.kind = "auto"
  c.trainer.sft_warmup.steps = 0
  trainer = Trainer(c, log=lambda *_: None)
  best = ranked_plans(c, trainer.model_cfg, jax.devices()[:4], top=1)[0].to_config()
  assert trainer.roles.actor.max_num_seqs == best["roles"]["actor"]["max_num_seqs"] > 0
  for role, spec in best["roles"].items():
    worker = getattr(trainer.roles, role)
    assert worker.mesh.devices.size == best["pools"][spec["pool"]]
    assert dict(worker.mesh.shape) == {a: spec["mesh"].get(a, 1) for a in ("data", "fsdp", "tensor")}
  trainer.fit()
  assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_plan_cli_ranks_plans_and_names_what_cannot_run(capsys):
  from hflax.launch import plan
  preset = ["--config", "ppo.py", "--profile", "a100-80gb", "--devices", "8", "--top", "2"]
  assert plan.main([*preset, "--infeasible"]) == 0
  out = capsys.readouterr().out
  assert out.splitlines()[1].lstrip().startswith("1.") and "best placement" in out
  assert "placements that cannot run" in out
  # A 70B-shaped built-in model on 8 GPUs: the shape alone is planned (no parameters are
  # built), nothing fits, and each placement says why.
  big = [f"--config.model.builtin.{k}={v}" for k, v in (
      ("hidden_size", 8192), ("intermediate_size", 28672), ("num_layers", 80),
      ("num_heads", 64), ("num_kv_heads", 8))]
  assert plan.main([*preset, *big]) == 1
  captured = capsys.readouterr()
  assert captured.out.count("OOM") >= 5 and "no placement" in captured.err
  assert plan.main([*preset, "--config.model.no_such_field=1"]) == 2
  assert "no_such_field" in capsys.readouterr().err


def test_sft_cache_key_follows_the_data_files_contents(tmp_path):
  from hflax.data import save_prompts
  from hflax.launch.roles import builtin_config
  from hflax.launch.sft import warmup_cache_dir
  c = tiny(tmp_path)
  rows = [{"data_source": "arithmetic", "prompt": "1+1=", "reward_model": {"ground_truth": "2"}}]
  c.data.train_files = str(tmp_path / "train.jsonl")
  save_prompts(rows, c.data.train_files)
  model_cfg = builtin_config(c, 261)
  before = warmup_cache_dir(c, model_cfg)
  assert warmup_cache_dir(c, model_cfg) == before  # a rerun reuses the warm-up
  rows[0]["reward_model"]["ground_truth"] = "3"  # the same path, edited in place
  save_prompts(rows, c.data.train_files)
  assert warmup_cache_dir(c, model_cfg) != before


def test_sft_cache_key_ignores_what_the_warmup_does_not_read(tmp_path):
  from hflax.launch.roles import builtin_config
  from hflax.launch.sft import warmup_cache_dir
  c = tiny(tmp_path)
  model_cfg = builtin_config(c, 261)
  key = os.path.basename(warmup_cache_dir(c, model_cfg))
  same = [("data", "train_batch_size", 8), ("data", "val_batch_size", 3),
          ("data", "val_files", "other.jsonl"), ("trainer", "total_steps", 99)]
  for section, field, value in same:
    d = copy.deepcopy(c)
    d[section][field] = value
    assert os.path.basename(warmup_cache_dir(d, model_cfg)) == key, field
  d = copy.deepcopy(c)
  d.trainer.sft_warmup.cache_dir = str(tmp_path / "elsewhere")
  assert os.path.basename(warmup_cache_dir(d, model_cfg)) == key
  different = [("data", "max_response_length", 9), ("data", "seed", 1), ("trainer", "seed", 1)]
  for section, field, value in different:
    d = copy.deepcopy(c)
    d[section][field] = value
    assert os.path.basename(warmup_cache_dir(d, model_cfg)) != key, field
  d = copy.deepcopy(c)
  d.data.builtin.digits = (1, 1)
  assert os.path.basename(warmup_cache_dir(d, model_cfg)) != key
  bf16 = dataclasses.replace(model_cfg, dtype="bfloat16")  # same weights' shape, other numbers
  assert os.path.basename(warmup_cache_dir(c, bf16)) != key


def test_val_every_none_still_means_no_validation(tmp_path):
  c = tiny(tmp_path)
  c.trainer.val_every = None
  validate(c)


def test_value_model_paths_on_ray_are_the_workers_to_read(tmp_path):
  """A reward model directory may exist only on the worker hosts: the Ray driver checks the
  policy's checkpoint alone; locally every directory is checked up front."""
  from hflax.launch.roles import read_model_configs
  c = tiny(tmp_path)
  c.reward.kind, c.reward.model_path = "model", str(tmp_path / "on_the_gpu_hosts")
  with pytest.raises(ValueError, match="config.reward.model_path: no config.json"):
    read_model_configs(c)
  read_model_configs(c, driver_only=True)
  c.model.path = str(tmp_path / "missing_policy")
  with pytest.raises(ValueError, match="config.model.path: no config.json"):
    read_model_configs(c, driver_only=True)


@pytest.mark.parametrize("has_bf16,model_dtype,rollout_dtype,warned", [
    (False, "bfloat16", None, "model.dtype = 'bfloat16'"),
    (False, "bfloat16", "bfloat16", "model.dtype and rollout.dtype = 'bfloat16'"),
    (False, "float32", "bfloat16", "rollout.dtype = 'bfloat16'"),
    (False, "float32", None, None),
    (True, "bfloat16", None, None),
    (None, "bfloat16", None, None),  # cannot tell: no warning
])
def test_bf16_on_a_cpu_that_emulates_it_is_a_warning(tmp_path, monkeypatch, has_bf16,
                                                       model_dtype, rollout_dtype, warned):
  import hflax.launch.trainer as trainer_module
  monkeypatch.setattr(trainer_module, "cpu_has_bf16", lambda: has_bf16)
  c = tiny(tmp_path, log=())
  c.trainer.sft_warmup.steps = 0
  c.model.dtype, c.rollout.dtype = model_dtype, rollout_dtype
  logs = []
  Trainer(c, log=logs.append).close()
  warnings = [line for line in logs if "instructions" in line]
  if warned is None:
    assert warnings == []
  else:
    assert len(warnings) == 1 and warnings[0].startswith(f"warning: {warned} on a CPU")
