"""The auto-mapper on mixture-of-experts models: total against active parameters, the
expert axis in memory, FLOPs and traffic, and a search that proposes one."""
import jax
import pytest

from hflax.models import create
from hflax.models.config import ModelConfig
from hflax.sharding import automap
from hflax.sharding.automap import MeshShape, Planner, Simulator, Workload, terms
from hflax.sharding.placement import build_placement

A100 = automap.get_profile("a100-80gb")
# A link of 1 byte/s and no latency: a collective's time is the bytes a device receives.
UNIT_LINKS = A100.replace(intra_node_bandwidth=1.0, inter_node_bandwidth=1.0,
                          bandwidth_efficiency=1.0, collective_latency=0.0)


def tiny_moe(**kw):
  """tests/moe_models.py's tiny Qwen3-MoE: 3 layers, the middle one dense, 8 experts, top 2."""
  fields = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_layers=3,
                num_heads=4, num_kv_heads=2, head_dim=32, family="qwen3_moe", qk_norm=True,
                num_experts=8, num_experts_per_tok=2, moe_intermediate_size=48,
                norm_topk_prob=True, mlp_only_layers=(1,))
  return ModelConfig(**{**fields, **kw})


def small_workload(cfg, **kw):
  return Workload(models={"actor": cfg}, **{**dict(
      prompts_per_step=8, samples_per_prompt=2, prompt_len=16, response_len=16,
      mini_batch_size=8, micro_batch_size=4), **kw})


def test_total_and_active_parameters_by_hand():
  cfg = tiny_moe()
  d, v = 64, 128
  attention = 2 * d * 4 * 32 + 2 * d * 2 * 32 + 2 * 32  # q, o; k, v; q and k norms
  layer = attention + 2 * d  # and the two layer norms
  dense_mlp = 3 * d * 160
  expert = 3 * d * 48
  router = d * 8
  outside = 2 * v * d + d  # embedding, untied head, final norm
  total = outside + 3 * layer + dense_mlp + 2 * (router + 8 * expert)
  active = outside + 3 * layer + dense_mlp + 2 * (router + 2 * expert)
  assert (total, active) == (269952, 159360)
  assert cfg.num_params == total and cfg.num_active_params == active
  assert terms.expert_params(cfg) == 2 * 8 * expert
  # The real model holds exactly the total.
  _, state = create(cfg)
  assert sum(x.size for x in jax.tree.leaves(state)) == total


def test_flops_count_active_experts_with_sorted_dispatch_and_all_with_dense():
  T, d, f, sparse = 32, 64, 48, 2

  def flops(**kw):
    return terms.forward_flops(tiny_moe(**kw), T)

  per_expert = 2 * T * sparse * 3 * d * f  # one more expert's matmuls for every token
  router = 2 * T * sparse * d  # one more expert's router column
  # Sorted: each token runs its top k; the number of experts only widens the router.
  assert flops(moe_dispatch="sorted", num_experts_per_tok=4) - \
      flops(moe_dispatch="sorted") == 2 * per_expert
  assert flops(moe_dispatch="sorted", num_experts=16) - flops(moe_dispatch="sorted") == \
      8 * router
  # Dense dispatch runs every expert on every token, whatever k.
  assert flops(num_experts_per_tok=4) == flops()
  assert flops(num_experts=16) - flops() == 8 * (per_expert + router)
  assert terms.compute_params(tiny_moe(moe_dispatch="sorted")) == 159360
  assert terms.compute_params(tiny_moe()) == 269952
  dense = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_layers=3,
                      num_heads=4, num_kv_heads=2)
  assert terms.compute_params(dense) == dense.num_params and terms.expert_params(dense) == 0


def test_memory_per_device_falls_as_the_expert_axis_grows():
  cfg = tiny_moe()
  wl = Workload(models={"actor": cfg, "ref": cfg}, prompts_per_step=8, mini_batch_size=8)
  sim = Simulator(wl, A100)
  experts, total = terms.expert_params(cfg), cfg.num_params
  trained, frozen = [], []
  for e in (1, 2, 4, 8):
    mesh = MeshShape(data=8 // e, expert=e)
    trained.append(sim.resident("actor", mesh))
    frozen.append(sim.resident("ref", mesh))
    # Weights, gradients and Adam's state of every expert: 16 bytes each, experts split e
    # ways, the rest replicated; the reference holds its float32 weights alone.
    assert trained[-1] == pytest.approx(16 * (total - experts) + 16 * experts / e)
    assert frozen[-1] == pytest.approx(4 * (total - experts) + 4 * experts / e)
  assert trained == sorted(trained, reverse=True) and len(set(trained)) == 4
  assert frozen == sorted(frozen, reverse=True) and len(set(frozen)) == 4
  # fsdp splits every weight, the expert axis on top only the experts.
  both = sim.resident("actor", MeshShape(fsdp=2, expert=4))
  assert both == pytest.approx((16 * (total - experts) + 16 * experts / 4) / 2)


def test_expert_exchange_bytes_by_hand():
  mesh = MeshShape(data=2, expert=4)
  # 8 prompts x 2 samples of 16 tokens over 8 row shards: 2 sequences a device, one a
  # call. The call's 8 x 16 tokens are fewer than an expert stack's 8 x 48 columns, so
  # XLA gathers the tokens.
  cfg = tiny_moe()
  sim = Simulator(small_workload(cfg, prompt_len=8, response_len=8, micro_batch_size=1),
                  UNIT_LINKS)
  tokens, e, sparse, calls = 16, 4, 2, 2
  group = e * tokens * 64 * 4  # the expert group's tokens, float32
  one_pass = sparse * 3 * group * (e - 1) / e  # all-gather in, all-reduce out
  assert sim._expert_exchange(cfg, mesh, tokens, 1) == pytest.approx((one_pass, one_pass))
  assert sim._forward("actor", mesh)[2] == pytest.approx(calls * one_pass)
  # Training (one mini-batch): forward and backward, and the recomputed forward with remat.
  assert sim._train("actor", mesh, False)[2] == pytest.approx(calls * 2 * one_pass)
  assert sim._train("actor", mesh, True)[2] == pytest.approx(calls * 3 * one_pass)
  # More tokens than the stack's columns: XLA gathers the experts instead, their three
  # stacks per sparse layer, whole over the expert axis (and held in flight as FSDP's).
  stacks = 4 * 3 * 8 * 64 * 48
  assert sim._expert_exchange(cfg, mesh, 4 * tokens, 1)[1] == pytest.approx(
      sparse * stacks * (e - 1) / e)
  # FSDP splits the experts too (their width): its devices gather tokens the same way, and
  # its layer gathers leave the experts out.
  for m, g in ((MeshShape(fsdp=8), 8), (MeshShape(data=2, fsdp=2, expert=2), 4)):
    group = g * tokens * 64 * 4
    assert sim._expert_exchange(cfg, m, tokens, 1)[1] == pytest.approx(
        sparse * 3 * group * (g - 1) / g)
  gather = sim._layer_comm(cfg, MeshShape(fsdp=8), tokens, 1)[1]
  assert gather == pytest.approx(4 * (cfg.num_params - terms.expert_params(cfg)) * 7 / 8)
  # Sorted dispatch all-reduces every device's picked rows (k per token) over the pool,
  # with an expert axis or without.
  cfg = tiny_moe(moe_dispatch="sorted")
  sim = Simulator(small_workload(cfg), UNIT_LINKS)
  picks = 8 * tokens * 2 * 64 * 4
  for m in (mesh, MeshShape(data=8)):
    assert sim._expert_exchange(cfg, m, tokens, 1) == pytest.approx(
        (sparse * 2 * picks * 7 / 8,) * 2)
  assert sim._expert_exchange(cfg, MeshShape(tensor=2), tokens, 1) == (0.0, 0.0)
  # Dense dispatch on replicated experts (data parallel, tensor) moves nothing.
  for m in (MeshShape(data=8), MeshShape(data=4, tensor=2)):
    assert Simulator(small_workload(tiny_moe()), UNIT_LINKS)._expert_exchange(
        tiny_moe(), m, tokens, 1) == (0.0, 0.0)


def test_all_to_all_exchange_bytes_by_hand():
  """All-to-all dispatch: per sparse layer and pass, two all-to-alls of a device's buffer
  (e blocks of `capacity` rows of width 64, float32) over the expert axis, and its own
  experts gathered whole over fsdp x tensor; the traffic of a device does not grow with
  the data axis (sorted dispatch's does); without an expert axis it is sorted dispatch."""
  cfg = tiny_moe(moe_dispatch="all_to_all")
  sim = Simulator(small_workload(cfg), UNIT_LINKS)
  tokens, sparse, k = 16, 2, 2
  stacks = 4 * 3 * 8 * 64 * 48  # a sparse layer's three expert stacks, float32
  for m, e, group in ((MeshShape(data=2, expert=4), 4, 1),
                      (MeshShape(data=4, expert=2), 2, 1),
                      (MeshShape(fsdp=2, expert=4), 4, 2),
                      (MeshShape(expert=4, tensor=2), 4, 2)):
    buffer = e * tokens * k * 64 * 4  # capacity factor 0: all of a device's picks
    own = stacks / e
    want = sparse * (2 * buffer * (e - 1) / e + own * (group - 1) / group)
    assert sim._expert_exchange(cfg, m, tokens, 1) == pytest.approx((want, want)), m
  # A capacity factor sends that multiple of a balanced share (rounded up) to each device.
  capped = tiny_moe(moe_dispatch="all_to_all", moe_capacity_factor=1.25)
  buffer = 4 * 10 * 64 * 4  # ceil(1.25 x 32 picks / 4) = 10 rows a block
  assert sim._expert_exchange(capped, MeshShape(data=2, expert=4), tokens, 1)[1] == \
      pytest.approx(sparse * 2 * buffer * 3 / 4)
  # With no expert axis it computes as sorted dispatch, and counts the same.
  sorted_cfg = tiny_moe(moe_dispatch="sorted")
  for m in (MeshShape(data=8), MeshShape(fsdp=4, data=2)):
    assert sim._expert_exchange(cfg, m, tokens, 1) == \
        sim._expert_exchange(sorted_cfg, m, tokens, 1)
  # A device's traffic at data 2 x expert 4 and at data 8 x expert 4 (32 devices) is the
  # same; sorted dispatch's all-reduce carries the whole pool's picks.
  assert sim._expert_exchange(cfg, MeshShape(data=8, expert=4), tokens, 1) == \
      sim._expert_exchange(cfg, MeshShape(data=2, expert=4), tokens, 1)
  assert sim._expert_exchange(sorted_cfg, MeshShape(data=8, expert=4), tokens, 1)[1] > \
      3 * sim._expert_exchange(sorted_cfg, MeshShape(data=2, expert=4), tokens, 1)[1]
  # FLOPs count the active experts, as sorted dispatch's.
  assert terms.compute_params(cfg) == terms.compute_params(sorted_cfg)


def test_expert_axis_must_divide_the_experts():
  sim = Simulator(small_workload(tiny_moe(num_experts=6)), A100)
  assert "does not divide num_experts=6" in sim.mesh_problem("actor", MeshShape(expert=4))
  assert sim.mesh_problem("actor", MeshShape(data=2, expert=3)) is None
  dense = small_workload(ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=160,
                                     num_layers=2, num_heads=4, num_kv_heads=2))
  assert "no experts" in Simulator(dense, A100).mesh_problem("actor", MeshShape(expert=2))


def dense_meshes(n, per_node=8):
  """The (data, fsdp, tensor) candidates the search always enumerated for n devices."""
  return [MeshShape(n // t // f, f, t) for t in (1, 2, 4, 8) if t <= min(n, per_node)
          and n % t == 0 for f in range(1, n // t + 1) if (n // t) % f == 0]


@pytest.mark.parametrize("n", [1, 4, 8, 16])
def test_candidates_add_an_expert_axis_for_moe_only(n):
  dense = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_layers=2,
                      num_heads=8, num_kv_heads=8)
  got, _ = Planner(small_workload(dense), A100).meshes("actor", n)
  assert got == dense_meshes(n)
  moe, _ = Planner(small_workload(tiny_moe(num_heads=8, num_kv_heads=8, head_dim=8)),
                   A100).meshes("actor", n)
  assert [m for m in moe if m.expert == 1] == dense_meshes(n)
  experts = {m.expert for m in moe}
  assert experts == {e for e in (1, 2, 4, 8) if e <= n}  # the divisors of 8 and of n
  assert all(m.size == n for m in moe)


def test_search_proposes_an_expert_axis_where_memory_forces_the_experts_apart():
  # Two sparse layers of 16 wide experts, 2 heads (tensor at most 2), 130 MB a device:
  # only meshes that split the experts 8 ways fit. FSDP splits them too (over their width,
  # as hflax's layouts do) but gathers every other weight for each pass of each of 64
  # micro-batches over slow links; an expert axis keeps those whole, so it wins.
  cfg = ModelConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_layers=2,
                    num_heads=2, num_kv_heads=2, family="qwen3_moe", qk_norm=True,
                    num_experts=16, num_experts_per_tok=2, moe_intermediate_size=1024,
                    moe_dispatch="sorted")
  wl = Workload(models={"actor": cfg}, prompts_per_step=64, prompt_len=16, response_len=16,
                mini_batch_size=64, micro_batch_size=1)
  prof = A100.replace(memory_bytes=130e6, usable_memory=1.0, intra_node_bandwidth=1e9)
  planner = Planner(wl, prof)
  meshes, _ = planner.meshes("actor", 8)

  def best(mesh):
    pools = [planner.evaluate_pool(("actor",), 8, {"actor": mesh}, *gen)
             for gen in planner.generate_layouts(mesh)]
    fits = [p.busy for p in pools if p.reason is None]
    assert fits or any("OOM" in p.reason for p in pools)
    return min(fits, default=None)

  times = {m: best(m) for m in meshes}
  assert all(t is None for m, t in times.items() if m.expert_shards < 8)  # out of memory
  fsdp = [t for m, t in times.items() if t is not None and m.expert == 1]
  assert fsdp and min(fsdp) > 1.05 * min(t for t in times.values() if t is not None)
  plans = automap.search(wl, prof, 8)
  assert plans and plans[0].meshes["actor"].expert > 1
  top = plans[0]
  assert top.step_time == pytest.approx(min(t for t in times.values() if t is not None))
  total, active, moved = top.experts["actor"]
  assert (total, active) == (cfg.num_params, cfg.num_active_params)
  assert moved > 0  # sorted dispatch on 8 row shards
  text = top.describe()
  assert f"e={top.meshes['actor'].expert}" in text
  assert "actor: 25.8M params, 3.81M active, expert exchange" in text
  # The controller builds the plan's mesh with its expert axis.
  spec = top.to_config()
  assert spec["roles"]["actor"]["mesh"]["expert"] == top.meshes["actor"].expert
  placed = build_placement(spec, jax.devices()[:8])
  assert placed["actor"].mesh.shape["expert"] == top.meshes["actor"].expert


def test_explanations_name_active_parameters_and_traffic():
  wl = small_workload(tiny_moe())
  chosen = automap.pick(wl, A100, 8, "one_step_off")
  assert "270k params, 159k active, expert exchange" in chosen.explanation
  dense = small_workload(ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=160,
                                     num_layers=2, num_heads=4, num_kv_heads=2))
  plan = automap.search(dense, A100, 8)[0]
  assert plan.experts == {} and "active" not in plan.describe()
  assert "expert" not in plan.to_config()["roles"]["actor"]["mesh"]
