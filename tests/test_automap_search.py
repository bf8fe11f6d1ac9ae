"""The auto-mapper's search: placements, layouts, reasons, the config it hands over."""
import time

import jax
import pytest

from hflax.models.config import ModelConfig
from hflax.sharding import automap
from hflax.sharding.automap import MeshShape, Overheads, Planner, Simulator, Workload
from hflax.sharding.placement import build_placement

PPO_ROLES = ("actor", "critic", "ref", "reward")
A100 = automap.get_profile("a100-80gb")


def tiny_workload():
  cfg = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2)
  return Workload.ppo(cfg, prompts_per_step=16, samples_per_prompt=2, prompt_len=16,
                      response_len=16, mini_batch_size=8, micro_batch_size=4)


@pytest.mark.parametrize("n, bell", [(1, 1), (2, 2), (3, 5), (4, 15), (5, 52), (6, 203)])
def test_placements_are_the_set_partitions(n, bell):
  items = [f"r{i}" for i in range(n)]
  parts = automap.placements(items)
  assert len(parts) == bell
  assert len(set(parts)) == bell
  for p in parts:  # every role exactly once
    assert sorted(r for g in p for r in g) == sorted(items)


def test_ppo_has_15_placements_and_52_with_a_cost_model():
  assert len(automap.placements(PPO_ROLES)) == 15
  assert len(automap.placements(PPO_ROLES + ("cost",))) == 52
  labels = {automap.label(p) for p in automap.placements(PPO_ROLES)}
  assert {"colocate", "split", "standalone"} <= labels


def test_device_counts_are_powers_of_two_then_whole_nodes():
  assert automap.device_counts(32, 8) == [1, 2, 4, 8, 16, 24, 32]
  assert automap.device_counts(8, 8) == [1, 2, 4, 8]


@pytest.mark.parametrize("size, billions", [("7b", 6.74), ("13b", 13.0), ("34b", 33.7),
                                            ("70b", 69.0)])
def test_llama2_shapes(size, billions):
  assert automap.llama2_config(size).num_params / 1e9 == pytest.approx(billions, abs=0.05)


def test_reshard_volume_is_table2_with_no_pipeline():
  # A link of 1 byte/s and no latency: the reshard time is the bytes each device receives.
  prof = A100.replace(intra_node_bandwidth=1.0, inter_node_bandwidth=1.0,
                      bandwidth_efficiency=1.0, collective_latency=0.0)
  wl = Workload.ppo(automap.llama2_config("7b"))
  sim = Simulator(wl, prof)
  M = 2 * wl.models["actor"].num_params  # bf16 bytes
  for mesh, t_g in [(MeshShape(1, 8, 1), 2), (MeshShape(2, 2, 2), 1), (MeshShape(1, 4, 2), 4)]:
    t = mesh.shards
    assert sim.reshard(mesh, t_g) == pytest.approx((t - t_g) / (t_g * t) * M)
  assert sim.reshard(MeshShape(4, 1, 2), 2) == 0.0  # generation shard = training shard
  assert sim.reshard(MeshShape(1, 32, 1), 8, strided=False) == pytest.approx(M / 8)


@pytest.fixture(scope="module")
def cpu_profile(tmp_path_factory):
  return automap.calibrate(path=str(tmp_path_factory.mktemp("profile") / "cpu.json"))


def test_tiny_config_on_8_cpu_devices_gives_feasible_plans(cpu_profile):
  wl = tiny_workload()
  plans = automap.search(wl, cpu_profile, jax.device_count(), top_k=10)
  assert plans and all(p.feasible for p in plans)
  times = [p.step_time for p in plans]
  assert times == sorted(times) and 0 < times[0] < float("inf")
  for p in plans:
    assert sum(p.devices) <= jax.device_count()
    for group, n in zip(p.placement, p.devices):
      assert all(p.meshes[r].size == n for r in group)
    assert set(p.stage_times) == {"generate", "forward", "train"}
    assert all(b > 0 for b in p.peak_memory)
  # The controller's placement builder accepts the best plan as it is.
  placed = build_placement(plans[0].to_config(), jax.devices())
  assert set(placed) == set(wl.roles)


def test_to_config_format():
  # Dense attention named, so the pinned KV budget does not follow the runtime's choice.
  wl = Workload.ppo(automap.llama2_config("7b"), attention="dense")
  meshes = {"actor": MeshShape(1, 4, 2), "ref": MeshShape(8, 1, 1),
            "critic": MeshShape(2, 2, 2), "reward": MeshShape(8, 1, 1)}
  plan = Planner(wl, A100).evaluate((("actor", "ref"), ("critic", "reward")), (8, 8), meshes,
                                    generate_tensor=2)
  assert plan.feasible, plan.reason
  # The KV cache gets what the pool's resident state and the generation weights leave:
  # 72 GB usable - actor 16 B/param over 8 shards - ref 2 B/param unsharded - weights
  # 2 B/param over t_g=2, in sequences of 2 x 32 layers x 16 KV heads x 128 x 2 B for
  # 2048 decode slots and the prompt's 1024 prefill slots (the sampler holds both while
  # it grows the cache), plus the prefill's four dense fp32 score-sized buffers of one
  # layer: 4 x 16 heads x 1024 x 1024 x 4 B.
  P = wl.models["actor"].num_params
  per_seq = 2 * 32 * 16 * 128 * 2 * (2048 + 1024) + 4 * 16 * 1024 * 1024 * 4
  fits = int((72e9 - 16 * P / 8 - 2 * P - 2 * P / 2) // per_seq)
  assert fits == 35
  assert plan.to_config() == {
      "pools": {"pool0": 8, "pool1": 8},
      "roles": {"actor": {"pool": "pool0", "mesh": {"data": 1, "fsdp": 4, "tensor": 2},
                          "generate_tensor": 2, "max_num_seqs": fits},
                "ref": {"pool": "pool0", "mesh": {"data": 8, "fsdp": 1, "tensor": 1}},
                "critic": {"pool": "pool1", "mesh": {"data": 2, "fsdp": 2, "tensor": 2}},
                "reward": {"pool": "pool1", "mesh": {"data": 8, "fsdp": 1, "tensor": 1}}}}
  assert plan.step_time == pytest.approx(sum(plan.stage_times.values()))
  assert plan.label == "split"


def test_infeasible_plans_carry_their_reason():
  wl = Workload.ppo(automap.llama2_config("13b"))
  planner = Planner(wl, A100)
  colocate = (PPO_ROLES,)
  heads = planner.evaluate(colocate, (6,), {r: MeshShape(1, 2, 3) for r in PPO_ROLES})
  assert not heads.feasible and "indivisible shape" in heads.reason and "num_heads" in heads.reason
  oom = planner.evaluate(colocate, (2,), {r: MeshShape(1, 2, 1) for r in PPO_ROLES})
  assert not oom.feasible and "OOM" in oom.reason
  assert oom.step_time == float("inf")
  # 70B's four models cannot fit on one node in any placement: every placement says why.
  big = automap.search(Workload.ppo(automap.llama2_config("70b")), A100, 8,
                       include_infeasible=True)
  assert len(big) == 15 and not any(p.feasible for p in big)
  assert all("OOM" in p.reason for p in big)


def test_search_128_devices_4_roles_under_60s():
  start = time.perf_counter()
  plans = automap.search(Workload.ppo(automap.llama2_config("13b")), A100, 128)
  elapsed = time.perf_counter() - start
  assert elapsed < 60, f"search took {elapsed:.1f}s"
  assert plans[0].feasible and sum(plans[0].devices) <= 128


def test_roofline_overheads_are_zero():
  ovh = Overheads.roofline()
  assert ovh.call_time(128) == 0 and ovh.decode_step == 0 and ovh.hide(2.0, 1.0) == 2.0


def test_on_a_shared_host_pools_share_the_cores_and_any_pool_gets_the_whole_host():
  """Simulated CPU devices share the cores: a stage costs its pools' total over the host's
  concurrency (but never less than its longest pool), and a pool of 2 computes as fast as
  a pool of 8 (the rates are per device, all busy)."""
  wl = Workload.ppo(automap.llama2_config("7b"))
  split = (("actor", "ref"), ("critic", "reward"))
  meshes = {"actor": MeshShape(1, 8, 1), "ref": MeshShape(8, 1, 1),
            "critic": MeshShape(1, 8, 1), "reward": MeshShape(8, 1, 1)}
  in_turn = A100.replace(shared_compute=True)
  profiles = ((A100, max), (in_turn, sum),
              (in_turn.replace(host_concurrency=1.5), lambda t: max(max(t), sum(t) / 1.5)),
              (in_turn.replace(host_concurrency=100.0), max))
  steps = []
  for prof, stage_time in profiles:
    plan = Planner(wl, prof).evaluate(split, (8, 8), meshes)
    assert plan.feasible, plan.reason
    for stage, t in plan.stage_times.items():
      assert t == pytest.approx(stage_time([p.get(stage, 0.0) for p in plan.pool_stage_times]))
    steps.append(plan.step_time)
  assert steps[1] > steps[2] > steps[3]
  shared = in_turn
  hardware_only = Overheads.roofline()
  small, big = (Simulator(wl, shared.replace(devices_per_node=8), hardware_only)
                .forward("ref", MeshShape(n, 1, 1), free=1e12) for n in (2, 8))
  assert small.time == pytest.approx(big.time)
  own = Simulator(wl, A100, hardware_only)
  assert own.forward("ref", MeshShape(2, 1, 1), 1e12).time == pytest.approx(
      4 * own.forward("ref", MeshShape(8, 1, 1), 1e12).time)


def test_a_data_split_that_does_not_divide_costs_its_padding():
  # 1024 sequences over 6 data shards: the runtime pads to 6 x 171 = 1026 rows.
  model = automap.llama2_config("7b")
  sims = [Simulator(Workload.ppo(model, prompts_per_step=n, mini_batch_size=n), A100)
          for n in (1024, 1026, 1020)]
  six = MeshShape(6, 1, 1)
  padded, exact, fewer = (sim.forward("ref", six, free=60e9).time for sim in sims)
  assert padded == pytest.approx(exact) and fewer < exact
  assert sims[0].mesh_problem("ref", six) is None


def test_lora_actor_keeps_optimizer_state_for_adapters_and_computes_the_reference():
  from hflax.models.lora import lora_config
  base = automap.llama2_config("7b")
  lora = lora_config(base, 16, 32.0, "all-linear")
  # Llama-2-7B, rank 16 on every linear layer: PEFT reports 39,976,960 trainable parameters.
  assert lora.num_lora_params == 39_976_960
  full = Simulator(Workload(models={"actor": base}), A100)
  adapted = Simulator(Workload(models={"actor": lora}), A100)
  mesh = MeshShape(1, 8, 1)
  # 16 bytes per trained parameter, 2 per frozen one.
  assert full.resident("actor", mesh) == pytest.approx(16 * base.num_params / 8)
  assert adapted.resident("actor", mesh) == pytest.approx(
      (2 * base.num_params + 16 * lora.num_lora_params) / 8)
  # No weight gradients for the base: 3 forward-equivalents with remat instead of 4, and
  # an optimizer update of the adapters alone.
  free = 40e9
  assert adapted.train("actor", mesh, free).time < 0.8 * full.train("actor", mesh, free).time
  # The reference log-probs run as a second forward pass on the actor's pool.
  for_ref = Workload(models={"actor": lora}, reference_in_actor=True)
  one = Planner(Workload(models={"actor": lora}), A100).evaluate_pool(("actor",), 8, {"actor": mesh})
  two = Planner(for_ref, A100).evaluate_pool(("actor",), 8, {"actor": mesh})
  assert two.stage_times["forward"] == pytest.approx(2 * one.stage_times["forward"])
