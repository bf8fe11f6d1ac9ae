"""The auto-mapper's rollout split for trainer.mode one_step_off / async: a rollout pool of
k devices generating beside the training pools, weighed against the sync plans, on the
cost model (A100 cluster of the HybridFlow paper's preset) and through the launcher."""
import json
import math

import jax
import pytest

from hflax.launch.plan import picked_plan
from hflax.launch.trainer import Trainer
from hflax.sharding import automap
from hflax.sharding.automap import split as split_mod
from hflax.sharding.automap.cost import Simulator
from hflax.sharding.automap.mesh import MeshShape
from hflax.sharding.automap.search import Planner
from tiny_config import get_config as tiny_config

A100 = automap.get_profile("a100-80gb")
LLAMA_7B = automap.llama2_config("7b")


def grpo(model=LLAMA_7B, response_len=4096, **kw):
  """GRPO on Llama-2 7B: 128 prompts x 8 samples, 512-token prompts, long responses."""
  models = {"actor": model} if kw.get("reference_in_actor") else {"actor": model, "ref": model}
  return automap.Workload(models=models, prompts_per_step=128, samples_per_prompt=8,
                          prompt_len=512, response_len=response_len, micro_batch_size=8,
                          attention="blockwise", kv_cache="paged",
                          **{"mini_batch_size": 32, **kw})


def test_split_wins_when_generation_dominates_on_many_devices():
  chosen = automap.pick(grpo(), A100, 128, "one_step_off")
  split, sync = chosen.split, chosen.sync
  assert sync.label == "colocate" and sync.stage_times["generate"] > 0.6 * sync.step_time
  assert chosen.plan is split and split.step_time < 0.9 * sync.step_time
  k = split.rollout_devices
  assert 0 < k < 128 and sum(split.train.devices) <= 128 - k
  assert f"split into {k} rollout and {sum(split.train.devices)} training devices" in \
      chosen.explanation
  assert f"t_g={split.rollout.generate_tensor}" in chosen.explanation
  assert "faster than the best plan generating on its training devices" in chosen.explanation
  spec = chosen.plan.to_config()
  assert spec["pools"]["rollout"] == k and spec["roles"]["rollout"] == {"pool": "rollout"}
  assert spec["roles"]["actor"]["generate_tensor"] == split.rollout.generate_tensor
  assert sum(spec["pools"].values()) <= 128
  # async is costed the same way (the engine streams; each step still waits for its sync)
  assert automap.pick(grpo(), A100, 128, "async").plan.step_time == split.step_time


def test_colocated_wins_when_the_weight_sync_is_very_expensive():
  # LoRA: the update all-reduces only the adapters' gradients, so a slow interconnect hits
  # the weight sync (every weight, to every rollout device) and not the colocated plan.
  lora = LLAMA_7B.replace(lora_rank=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))
  wl = grpo(lora, reference_in_actor=True, mini_batch_size=128)
  slow = A100.replace(intra_node_bandwidth=1e7, inter_node_bandwidth=1e7)
  chosen = automap.pick(wl, slow, 64, "one_step_off")
  assert chosen.plan is chosen.sync and chosen.split is not None
  assert chosen.sync.label == "colocate"
  assert chosen.split.weight_sync > chosen.sync.step_time
  assert "colocate wins" in chosen.explanation
  assert "the split loses because the weight sync" in chosen.explanation
  assert "rollout" not in chosen.plan.to_config()["roles"]


def test_split_step_is_the_overlap_of_its_stage_costs_plus_the_sync():
  wl = grpo(automap.llama2_config("7b"), response_len=1024)
  planner = split_mod.SplitPlanner(wl, A100)
  k, total = 4, 8
  plan = planner.plan(k, total, "one_step_off")
  t = plan.rollout.generate_tensor
  # The rollout pool: Simulator.generate on k / t_g replicas of t_g, nothing else resident.
  sim = Simulator(wl, A100)
  gen = sim.generate(MeshShape(k // t, 1, t), t, sim.capacity)
  assert plan.rollout.time == gen.time and plan.rollout.max_num_seqs == gen.max_num_seqs
  # The training side: the training pools' stage times (no generate stage), by hand.
  train = Planner(wl, A100, generates=False).evaluate(
      plan.train.placement, plan.train.devices, plan.train.meshes)
  assert "generate" not in train.stage_times
  training = train.stage_times["forward"] + train.stage_times["train"]
  assert plan.training_time == pytest.approx(training)
  # The sync: each rollout device receives its t_g shard of the bf16 weights and the
  # training devices send k shards between them; the busier side over NVLink at 80%.
  shard = 2 * LLAMA_7B.num_params / t
  sent = shard * k / sum(plan.train.devices)
  sync = A100.collective_latency + max(shard, sent) / (A100.intra_node_bandwidth * 0.8)
  assert plan.weight_sync == pytest.approx(sync) and plan.sync_bytes == shard
  assert plan.step_time == pytest.approx(max(gen.time, training) + sync)
  # On a shared host the pools also share the cores: at least their total over the
  # measured concurrency.
  host = A100.replace(shared_compute=True, host_concurrency=1.5)
  shared = split_mod.SplitPlanner(wl, host).plan(k, total, "one_step_off")
  g, tr = shared.rollout.time, shared.training_time
  assert shared.step_time == pytest.approx(max(g, tr, (g + tr) / 1.5) + shared.weight_sync)
  assert shared.overlapped == pytest.approx((g + tr) / 1.5)  # two busy pools on one host


def test_sync_runs_never_get_a_split():
  chosen = automap.pick(grpo(), A100, 128, "sync")
  assert chosen.split is None and chosen.plan is chosen.sync
  assert chosen.plan.label != "rollout split"
  assert "rollout" not in chosen.plan.to_config()["roles"]
  assert "sync steps generate, score and train in turn" in chosen.explanation
  with pytest.raises(ValueError, match="overlaps nothing in 'sync' mode"):
    automap.pick(grpo(), A100, 128, "sync", consider_split=True)
  with pytest.raises(ValueError, match="'one_step'"):
    automap.pick(grpo(), A100, 128, "one_step")


def test_launcher_runs_the_auto_split_for_one_step_off(tmp_path):
  """8 simulated CPU devices, the tiny GRPO job planned with the H100 preset (a measured
  profile of a loaded 2-core host would not be a fixed answer): the pick is a split, and
  the run builds it and trains a step with generation on the rollout devices."""
  c = tiny_config()
  c.trainer.update(total_steps=1, run_dir=str(tmp_path / "run"), mode="one_step_off",
                   devices=8, save_every=10, export_hf=False)
  c.placement.update(kind="auto", profile="h100-80gb")
  lines = []
  trainer = Trainer(c, log=lambda *a: lines.append(" ".join(map(str, a))))
  said = next(x for x in lines if x.startswith("auto placement"))
  spec = trainer.plan.placement
  k = spec["pools"]["rollout"]
  assert spec["roles"]["rollout"] == {"pool": "rollout"}
  assert f"split into {k} rollout" in said
  actor = trainer.roles.actor
  gen_devices = set(actor.engine.mesh.devices.flat)
  train_devices = {d for x in jax.tree.leaves(actor.params) for d in x.sharding.device_set}
  assert len(gen_devices) == k and not gen_devices & train_devices
  trainer.fit()
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  assert rows[-1]["step"] == 1
  # The cost model's sync is the run's copy: the metric counts the copied arrays' bytes,
  # of which each rollout device receives its t_g shard.
  chosen = picked_plan(c, trainer.model_cfg, jax.devices()[:8], "h100-80gb")
  assert chosen.plan.to_config() == spec
  t_g = chosen.split.rollout.generate_tensor
  assert rows[-1]["rollout/weight_sync_bytes"] == chosen.split.sync_bytes * t_g > 0
  assert math.isfinite(rows[-1]["actor/pg_loss"])


def test_bad_profile_is_named_before_device_work():
  from hflax.launch.config import validate
  c = tiny_config()
  c.placement.update(kind="auto", profile="a200")
  with pytest.raises(ValueError, match="placement.profile"):
    validate(c)
