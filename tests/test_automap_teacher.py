"""The auto-mapper plans on-policy distillation's teacher: a forward-only role of its own
size, beside the actor, beside other scorers or on a pool of its own; plans without a
teacher as before; and placement.kind='auto' runs a distillation job on its plan."""
import math

import jax
import numpy as np
import pytest

from hflax.models.config import ModelConfig
from hflax.sharding import automap
from hflax.sharding.automap import MeshShape, Overheads, Planner, Simulator, Workload
from hflax.sharding.automap import memory

A100 = automap.get_profile("a100-80gb")
TPU_V5E = automap.get_profile("tpu-v5e")

# An actor and a larger teacher of the same vocabulary, float32, untied heads.
ACTOR = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, tie_word_embeddings=False)
TEACHER = ModelConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_layers=3,
                      num_heads=4, num_kv_heads=2, tie_word_embeddings=False)


def _teacher_params_by_hand():
  """TEACHER's parameters from its shapes: V=256, d=128, f=256, 3 layers, 4 heads of 32,
  2 KV heads."""
  V, d, f, layers, hd, kv = 256, 128, 256, 3, 32, 2
  attention = d * d + 2 * d * kv * hd + d * d  # q, k, v, o
  per_layer = attention + 3 * d * f + 2 * d  # gate, up, down; two RMS norms
  embedding, head = V * d, V * d
  return embedding + layers * per_layer + d + head, embedding  # final norm


def _workload(**kw):
  base = dict(prompts_per_step=8, samples_per_prompt=1, prompt_len=16, response_len=16,
              mini_batch_size=8, micro_batch_size=2, attention="dense")
  return Workload(models={"actor": ACTOR, "teacher": TEACHER}, **{**base, **kw})


def test_teacher_memory_and_flops_are_a_forward_pass_by_hand():
  params, embedding = _teacher_params_by_hand()
  assert TEACHER.num_params == params == 508_800
  wl = _workload()
  assert wl.roles == ("actor", "teacher")
  sim = Simulator(wl, A100, Overheads.roofline())
  # Resident: the weights alone (4 bytes each in float32), split over fsdp x tensor; no
  # gradients, no master copy, no Adam moments (the trained actor keeps 16 bytes a param).
  mesh = MeshShape(data=2, fsdp=2)
  assert sim.resident("teacher", mesh) == params * 4 / 2
  assert sim.resident("actor", mesh) == ACTOR.num_params * 16 / 2
  # FLOPs: 2 x parameters x tokens through the matmuls (the embedding lookup is free; the
  # module counts the norms with them) plus causal attention's 2 x layers x heads x
  # head_dim x T^2, for 8 sequences of T = 32 tokens, once a step. On a data-parallel mesh
  # with no overheads a forward's time is those FLOPs over the pool's rate.
  T, sequences = 32, 8
  flops = sequences * (2 * (params - embedding) * T + 2 * 3 * 4 * 32 * T * T)
  data4 = MeshShape(data=4)
  cost = sim.forward("teacher", data4, free=math.inf)
  assert cost.time * 4 * sim.flops_rate == pytest.approx(flops, rel=1e-12)
  # Its transient memory is a forward pass's over one micro-batch (2 rows of 32 tokens),
  # not an update's activations.
  forward = memory.forward_bytes(TEACHER, 2, T, 16, "dense").transient
  assert cost.transient == forward < memory.activation_bytes(TEACHER, 2, T, 16, "dense")
  # A pool of its own: one forward stage, peak = weights + that forward.
  pool = Planner(wl, A100, Overheads.roofline()).evaluate_pool(("teacher",), 4,
                                                               {"teacher": data4})
  assert pool.stage_times == {"forward": cost.time}
  assert pool.peak_memory == params * 4 + forward
  # Beside the actor its forward adds to the pool's forward stage, nothing to the others.
  planner = Planner(wl, A100, Overheads.roofline())
  alone = planner.evaluate_pool(("actor",), 4, {"actor": data4})
  both = planner.evaluate_pool(("actor", "teacher"), 4, {"actor": data4, "teacher": data4})
  assert both.stage_times["forward"] == pytest.approx(alone.stage_times["forward"] + cost.time)
  assert both.stage_times["train"] == alone.stage_times["train"]


# Long-response distillation on 16 TPU v5e chips (16 GiB each): a 1.3B student with full
# multi-head attention (its KV cache splits at most t_g = 8 ways), 32 samples of 17k
# tokens per prompt generated together.
STUDENT = ModelConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                      num_layers=22, num_heads=32, num_kv_heads=32, dtype="bfloat16",
                      param_dtype="bfloat16", max_position_embeddings=65536)


def _distill(teacher):
  return Workload(models={"actor": STUDENT, "teacher": teacher}, prompts_per_step=64,
                  samples_per_prompt=32, prompt_len=1024, response_len=16384,
                  mini_batch_size=16, micro_batch_size=1, attention="blockwise")


def test_big_teacher_gets_its_own_pool_and_a_small_one_shares_the_actors():
  small = automap.pick(_distill(STUDENT), TPU_V5E, 16)
  assert small.plan.placement == (("actor", "teacher"),)
  assert small.plan.devices == (16,)
  assert "the teacher (1.26B params, forward only) runs on pool0 with actor (16 devices)" \
      in small.explanation
  assert "on a pool of its own the best plan steps in" in small.explanation
  # A 13B teacher's weights beside the actor leave its generation too little memory for a
  # prompt's 32 samples on every layout: the teacher takes 8 chips of its own.
  big = automap.pick(_distill(automap.llama2_config("13b")), TPU_V5E, 16)
  assert big.plan.placement == (("actor",), ("teacher",))
  assert big.plan.devices == (8, 8)
  config = big.plan.to_config()
  assert config["pools"] == {"pool0": 8, "pool1": 8}
  assert config["roles"]["teacher"]["pool"] == "pool1"
  said = big.explanation
  assert "the teacher (13B params, forward only) runs on pool1 of its own (8 devices)" in said
  assert "beside the actor no plan runs (actor+teacher: OOM: actor generate KV" in said
  colocated = Planner(_distill(automap.llama2_config("13b")), TPU_V5E).search(
      16, top_k=0, include_infeasible=True)
  assert [p.reason for p in colocated if p.placement == (("actor", "teacher"),)][0] \
      .startswith("actor+teacher: OOM: actor generate KV")


def test_a_reference_and_a_teacher_are_weighed_apart():
  """With a reference too the big teacher may share the reference's pool; the explanation
  weighs each other kind of place."""
  wl = _distill(automap.llama2_config("13b"))
  wl = Workload(**{**wl.__dict__, "models": {**wl.models, "ref": STUDENT}})
  assert wl.roles == ("actor", "ref", "teacher")
  chosen = automap.pick(wl, TPU_V5E, 16)
  group = next(g for g in chosen.plan.placement if "teacher" in g)
  assert "actor" not in group
  assert "beside the actor no plan runs (actor+ref+teacher: OOM" in chosen.explanation
  assert "on a pool of its own the best plan steps in" in chosen.explanation


# Plans of workloads without a teacher, as the auto-mapper made them before it knew one
# (commit 4917ab9, from tests/test_automap_search.py's tiny PPO workload and the 7B PPO):
# the same placement dict and the same explanation, to the character.
TINY_PPO_CONFIG = {
    "pools": {"pool0": 1, "pool1": 1, "pool2": 1, "pool3": 1},
    "roles": {"actor": {"pool": "pool0", "mesh": {"data": 1, "fsdp": 1, "tensor": 1},
                        "generate_tensor": 1, "max_num_seqs": 2511086},
              "critic": {"pool": "pool1", "mesh": {"data": 1, "fsdp": 1, "tensor": 1}},
              "ref": {"pool": "pool2", "mesh": {"data": 1, "fsdp": 1, "tensor": 1}},
              "reward": {"pool": "pool3", "mesh": {"data": 1, "fsdp": 1, "tensor": 1}}}}
TINY_PPO_EXPLANATION = (
    "auto placement for trainer.mode=sync on 8 devices: standalone, a step of 140ms  "
    "[actor]x1  [critic]x1  [ref]x1  [reward]x1  actor=(1,1,1) critic=(1,1,1) ref=(1,1,1) "
    "reward=(1,1,1) t_g=1  generate=100ms forward=20ms train=20ms  peak 3.28 MB/3.28 MB/689 "
    "kB/689 kB; sync steps generate, score and train in turn, so a rollout pool of its own "
    "would idle")
PPO_7B_CONFIG = {
    "pools": {"pool0": 16},
    "roles": {"actor": {"pool": "pool0", "mesh": {"data": 1, "fsdp": 8, "tensor": 2},
                        "generate_tensor": 4, "generate_strided": False, "max_num_seqs": 128},
              "critic": {"pool": "pool0", "mesh": {"data": 1, "fsdp": 8, "tensor": 2}},
              "ref": {"pool": "pool0", "mesh": {"data": 2, "fsdp": 8, "tensor": 1}},
              "reward": {"pool": "pool0", "mesh": {"data": 2, "fsdp": 8, "tensor": 1}}}}
PPO_7B_EXPLANATION = (
    "auto placement for trainer.mode=one_step_off on 16 devices: colocate wins: the best plan "
    "generating on its training devices (colocate, 16 devices: generate 57.3s + forward "
    "50.8s + train 76.2s = 184s), against the best split, 4 rollout devices (t_g=4, 1 "
    "replica) generating in 220s, beside 12 training devices ([actor]x4 [critic+ref+reward]x8 "
    "actor=(1,2,2) critic=(1,4,2) ref=(4,2,1) reward=(8,1,1)) scoring and updating in 215s "
    "(forward 71.2s + train 144s); overlapped 220s + weight sync 168ms (3.37 GB to each "
    "rollout device) = 220s; the split loses because each side gets fewer devices: "
    "generation on 4 devices and training on 12 take longer than the colocated stages one "
    "after the other")


def test_plans_without_a_teacher_are_unchanged():
  tiny = Workload.ppo(ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                  num_layers=2, num_heads=4, num_kv_heads=2),
                      prompts_per_step=16, samples_per_prompt=2, prompt_len=16,
                      response_len=16, mini_batch_size=8, micro_batch_size=4)
  chosen = automap.pick(tiny, A100, 8, "sync")
  assert chosen.plan.to_config() == TINY_PPO_CONFIG
  assert chosen.explanation == TINY_PPO_EXPLANATION
  chosen = automap.pick(Workload.ppo(automap.llama2_config("7b")), A100, 16, "one_step_off")
  assert chosen.plan.to_config() == PPO_7B_CONFIG
  assert chosen.explanation == PPO_7B_EXPLANATION


def test_validation_takes_auto_placement_with_a_teacher():
  from hflax.launch.config import base_config, validate
  c = base_config()
  c.algorithm.name, c.algorithm.adv_estimator = "grpo", "grpo"
  c.rollout.n = 2
  c.distill.teacher_path = "/some/teacher"
  c.placement.kind = "auto"
  validate(c)  # the checkpoint itself is read when the run plans


def _export_teacher(c, path):
  """A teacher of the tiny job's vocabulary, twice its width and layers, as an HF
  directory."""
  from hflax.launch.models import builtin_config
  from hflax.models import create, hf
  from hflax.models.tokenizer import ByteTokenizer
  tok = ByteTokenizer()
  student = builtin_config(c, tok.vocab_size, tok)
  teacher = student.replace(hidden_size=64, intermediate_size=128, num_layers=2)
  _, state = create(teacher, seed=3)
  hf.export_checkpoint(str(path), teacher, state)
  return str(path), student, teacher


def test_launcher_runs_the_auto_plan_of_a_distillation_job(tmp_path):
  """The tiny GRPO job with a teacher of its own size, placement.kind='auto' on 4
  simulated CPU devices planned with the H100 preset (a fixed answer, unlike a measured
  profile of a loaded host): the run places the teacher where the plan says, with the
  checkpoint's shape, and trains a step on the teacher's log-probs."""
  import json

  from hflax.launch.plan import picked_plan, workload
  from hflax.launch.trainer import Trainer
  from tiny_config import get_config
  c = get_config()
  c.trainer.update(total_steps=1, run_dir=str(tmp_path / "run"), devices=4, save_every=10,
                   export_hf=False, compile_cache_dir="")
  c.placement.update(kind="auto", profile="h100-80gb")
  c.distill.teacher_path, student, teacher = _export_teacher(c, tmp_path / "teacher")
  planned = workload(c, student)
  assert planned.models["teacher"].num_params == teacher.num_params > student.num_params
  lines = []
  trainer = Trainer(c, log=lambda *a: lines.append(" ".join(map(str, a))))
  said = next(x for x in lines if x.startswith("auto placement"))
  assert "the teacher (" in said and "forward only) runs on pool" in said
  spec = trainer.plan.placement
  chosen = picked_plan(c, trainer.model_cfg, jax.devices()[:4], "h100-80gb")
  assert chosen.plan.to_config() == spec
  entry = spec["roles"]["teacher"]
  worker = trainer.roles.teacher
  assert worker.mesh.devices.size == spec["pools"][entry["pool"]]
  assert dict(worker.mesh.shape) == {a: entry["mesh"].get(a, 1) for a in worker.mesh.shape}
  held = sum(x.size for x in jax.tree.leaves(worker.params))
  assert held == teacher.num_params  # the checkpoint's model, not the student's shape
  trainer.fit()
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    rows = [json.loads(line) for line in f if '"step"' in line]
  assert rows[-1]["step"] == 1
  assert np.isfinite(rows[-1]["distill/reverse_kl"]) and abs(rows[-1]["distill/reverse_kl"]) > 0


def test_plan_cli_says_where_the_teacher_goes(tmp_path, capsys):
  """python -m hflax.launch.plan with distill.teacher_path: the plans hold role teacher
  and the explanation names its place."""
  import os

  from hflax.launch import plan
  from hflax.sharding.automap.plan import count
  from tiny_config import get_config
  path, _, teacher = _export_teacher(get_config(), tmp_path / "teacher")
  config = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_config.py")
  assert plan.main(["--config", config, "--profile", "a100-80gb", "--devices", "16",
                    f"--config.distill.teacher_path={path}"]) == 0
  out = capsys.readouterr().out
  assert "teacher=(" in out.splitlines()[1]
  assert f"the teacher ({count(teacher.num_params)} params, forward only) " \
      "runs on pool" in out
  assert "'teacher': {'pool': 'pool" in out
