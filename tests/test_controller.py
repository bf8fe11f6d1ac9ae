"""Role workers on per-role meshes: placements, equivalence with the single-device run,
the hybrid engine, and concurrency of roles on disjoint pools."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_step import build_workers, ppo_step, prompts_batch, CFG, SAMPLING
from hflax.controller.training import UpdateConfig
from hflax.models import create
from hflax.rollout.sampler import _generate, decode_segments
from hflax.sharding.hybrid_engine import (HybridEngine, bytes_to_move, generate_mesh,
                                          shard_bytes)
from hflax.sharding.layouts import TRAIN_RULES, state_shardings, train_mesh
from hflax.sharding.placement import build_placement, colocated, standalone

ROLES = ["actor", "ref", "critic", "reward"]
SPLIT = {"pools": {"policy": 4, "scoring": 4},
         "roles": {"actor": {"pool": "policy", "mesh": {"fsdp": 2, "tensor": 2},
                             "generate_tensor": 2},
                   "ref": {"pool": "policy", "mesh": {"data": 2, "fsdp": 2}},
                   "critic": {"pool": "scoring", "mesh": {"fsdp": 4}},
                   "reward": {"pool": "scoring", "mesh": {"data": 4}}}}
PLACEMENTS = {"colocated": colocated(ROLES, 8, generate_tensor=2), "split": SPLIT,
              "standalone": standalone(ROLES, 2, generate_tensor=2)}


@pytest.fixture(scope="module")
def reference():
  """The unsharded computation: every role on one device."""
  workers = build_workers(colocated(ROLES, 1))
  batch, metrics = ppo_step(workers, prompts_batch())
  return workers, batch, metrics


@pytest.fixture(scope="module")
def first_step():
  """Each placement's workers after one PPO step on prompts_batch(), built once a module:
  later tests go on from them (the split pools' concurrency, the colocated optimizer
  offload) instead of compiling the same programs again. Returns (workers, batch,
  metrics, the actor's and critic's parameters as they were right after the step)."""
  done = {}

  def get(name):
    if name not in done:
      workers = build_workers(PLACEMENTS[name])
      batch, metrics = ppo_step(workers, prompts_batch())
      params = {role: [np.asarray(x) for x in jax.tree.leaves(workers[role].params)]
                for role in ("actor", "critic")}
      done[name] = workers, batch, metrics, params
    return done[name]
  return get


@pytest.mark.parametrize("name", list(PLACEMENTS))
def test_ppo_step_matches_single_device(name, reference, first_step):
  ref_workers, ref_batch, ref_metrics = reference
  workers, batch, metrics, params = first_step(name)
  np.testing.assert_array_equal(np.asarray(batch["responses"]), np.asarray(ref_batch["responses"]))
  for key in ("old_log_probs", "ref_log_prob", "values", "token_level_scores", "advantages"):
    np.testing.assert_allclose(np.asarray(batch[key]), np.asarray(ref_batch[key]), atol=2e-5,
                               err_msg=key)
  for key, value in ref_metrics.items():
    if not key.startswith(("timing_s", "reshard")):
      np.testing.assert_allclose(float(metrics[key]), float(value), rtol=1e-4, atol=1e-6,
                                 err_msg=key)
  # Adam moves an element whose gradient is near its eps by lr times the gradient's relative
  # error, so a few of 20k elements differ by 1e-5..1e-4; a lost or doubled shard would
  # move them by about lr (1e-2).
  for role in ("actor", "critic"):
    for a, b in zip(params[role], jax.tree.leaves(ref_workers[role].params)):
      np.testing.assert_allclose(a, np.asarray(b), atol=1e-4)
  # Each role really lives on its own pool's devices.
  pools = {r: set(w.mesh.devices.flat) for r, w in workers.items()}
  if name == "standalone":
    assert all(not (pools[a] & pools[b]) for a in ROLES for b in ROLES if a < b)
  assert metrics["actor/ppo_kl_first_minibatch"] == pytest.approx(0, abs=1e-6)
  assert metrics["actor/pg_clipfrac_first_minibatch"] == pytest.approx(0, abs=1e-6)


def test_placement_errors_name_the_field():
  with pytest.raises(ValueError, match=r"placement.pools asks for 12 devices .* only 8 exist"):
    build_placement({"pools": {"a": 8, "b": 4}, "roles": {"actor": {"pool": "a"}}})
  with pytest.raises(ValueError, match=r"placement.roles.critic.mesh: .* multiplies to 6 but "
                                       r"pool 'a' has 4"):
    build_placement({"pools": {"a": 4}, "roles": {"critic": {"pool": "a",
                                                             "mesh": {"fsdp": 3, "tensor": 2}}}})
  with pytest.raises(ValueError, match=r"placement.roles.actor.generate_tensor: 3 does not divide"):
    build_placement({"pools": {"a": 4}, "roles": {"actor": {"pool": "a", "generate_tensor": 3}}})
  with pytest.raises(ValueError, match=r"placement.roles.actor.pool: 'b' is not one of \['a'\]"):
    build_placement({"pools": {"a": 4}, "roles": {"actor": {"pool": "b"}}})
  with pytest.raises(ValueError, match="unknown role"):
    build_placement({"pools": {"a": 4}, "roles": {"judge": {"pool": "a"}}})
  with pytest.raises(ValueError, match=r"placement.roles.actor: unknown fields "
                                       r"\['generate_tensr'\]"):
    build_placement({"pools": {"a": 4}, "roles": {"actor": {"pool": "a", "generate_tensr": 2}}})


def test_rows_the_data_parallel_size_does_not_divide_are_padded(reference):
  """8 prompts (16 rows, mini-batches of 16, micro-batches of 8) on 3-way data parallelism:
  prompts (8 -> 9), rows (16 -> 18) and every micro-batch (8 -> 9) are padded, and the
  step equals the unpadded one-device step (the module's reference, same settings)."""
  ref_workers, ref_batch, ref_metrics = reference
  workers = build_workers(colocated(ROLES, 3))
  assert workers["actor"].data_parallel_rows == 3 and workers["actor"].engine.mesh.shape["data"] == 3
  batch, metrics = ppo_step(workers, prompts_batch())
  assert len(batch) == 16
  np.testing.assert_array_equal(np.asarray(batch["responses"]), np.asarray(ref_batch["responses"]))
  for key in ("old_log_probs", "ref_log_prob", "values", "token_level_scores", "advantages"):
    np.testing.assert_allclose(np.asarray(batch[key]), np.asarray(ref_batch[key]), atol=2e-5,
                               err_msg=key)
  for key, value in ref_metrics.items():
    if not key.startswith(("timing_s", "reshard")):
      np.testing.assert_allclose(float(metrics[key]), float(value), rtol=1e-4, atol=1e-6,
                                 err_msg=key)
  for role in ("actor", "critic"):
    for a, b in zip(jax.tree.leaves(workers[role].params),
                    jax.tree.leaves(ref_workers[role].params)):
      # Adam at lr 1e-2 turns float noise in near-zero gradients into ~lr/100 steps.
      np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)


def test_micro_batch_smaller_than_data_parallel_size_is_rejected(reference):
  """Both updates refuse the step's batch (the single-device run's, every field there):
  feeding it to them directly skips generating and scoring it again on 8 devices."""
  workers = build_workers(colocated(ROLES, 8), update=UpdateConfig(mini_batch_size=16,
                                                                   micro_batch_size=4))
  batch = reference[1]
  for role, update in (("critic", workers["critic"].update_critic),
                       ("actor", workers["actor"].update_actor)):
    with pytest.raises(ValueError, match=f"{role}.* micro_batch_size=4 rows is less than the "
                                         "data-parallel size 8"):
      update(batch)


def _param_bytes(state):
  return sum(x.nbytes for x in jax.tree.leaves(state))


@pytest.mark.parametrize("tensor", [2, 4])
def test_strided_grouping_moves_the_papers_volume(tensor):
  """Per device, HybridFlow moves (tp - t_g)/(t_g tp) * M (p = p_g = 1), less than naive."""
  _, state = create(CFG)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  mesh = train_mesh(jax.devices()[:8], fsdp=8)
  train = state_shardings(abstract, mesh, TRAIN_RULES)
  engine = HybridEngine(mesh, abstract, train, tensor)
  tp = 8
  # Norm scales are replicated in both layouts; everything else is split both times.
  model_parallel = sum(np.prod(x.shape) * 4 for x in jax.tree.leaves(abstract) if x.ndim == 2)
  expected = (tp - tensor) / (tensor * tp) * model_parallel
  assert engine.moved["max_per_device"] == expected
  assert all(v == expected for v in engine.moved["per_device"].values())
  naive_mesh = generate_mesh(mesh, tensor, strided=False)
  from hflax.sharding.layouts import GENERATE_RULES
  naive = bytes_to_move(abstract, train, state_shardings(abstract, naive_mesh, GENERATE_RULES))
  assert naive["total"] > engine.moved["total"]


@pytest.mark.parametrize("data, fsdp, tensor, t_g", [(4, 1, 2, 2), (2, 2, 2, 2), (2, 2, 2, 4),
                                                     (2, 4, 1, 2), (4, 2, 1, 4)])
def test_strided_grouping_with_data_replicas(data, fsdp, tensor, t_g):
  """With a data axis, each replica's m = fsdp * tensor devices form the groups: a device
  receives (m - t_g) / (t_g m) * M (nothing once t_g >= m), what the auto-mapper charges,
  and the generation weights equal the training weights."""
  graphdef, state = create(CFG)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  mesh = train_mesh(jax.devices()[:8], data=data, fsdp=fsdp, tensor=tensor)
  train = state_shardings(abstract, mesh, TRAIN_RULES)
  engine = HybridEngine(mesh, abstract, train, t_g)
  m = fsdp * tensor
  model_parallel = sum(np.prod(x.shape) * 4 for x in jax.tree.leaves(abstract) if x.ndim == 2)
  expected = max(m - t_g, 0) / (t_g * m) * model_parallel
  assert engine.moved["max_per_device"] == expected
  params = jax.device_put(state, train)
  gen, _ = engine.to_generate(params)
  for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(gen)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_hybrid_engine_switch():
  workers = build_workers(colocated(ROLES, 8, generate_tensor=4))
  actor = workers["actor"]
  before = [np.asarray(x).copy() for x in jax.tree.leaves(actor.params)]
  gen_state, metrics = actor.engine.to_generate(actor.params)
  # Memory during the switch: train shard + generate shard per device, never the model.
  whole = _param_bytes(actor.params)
  train_held, gen_held = shard_bytes(actor.params), shard_bytes(gen_state)
  for device in actor.mesh.devices.flat:
    assert gen_held[device] < whole / 2
    assert train_held[device] + gen_held[device] < whole / 2
  assert metrics["reshard/bytes_moved"] == actor.engine.moved["total"] > 0
  # Generating in the generate layout gives what generating in the train layout gives.
  prompts = prompts_batch()
  args = (jnp.asarray(prompts["prompts"]), jnp.asarray(prompts["prompt_mask"]), jax.random.key(4))
  kw = dict(params=SAMPLING, segments=decode_segments(SAMPLING.max_new_tokens))
  out_gen = _generate(actor.engine.graphdef, gen_state, *args, **kw)
  out_train = _generate(actor.graphdef, actor.params, *args, **kw)
  np.testing.assert_array_equal(np.asarray(out_gen["responses"]), np.asarray(out_train["responses"]))
  np.testing.assert_allclose(np.asarray(out_gen["rollout_log_probs"]),
                             np.asarray(out_train["rollout_log_probs"]), atol=1e-5)
  del gen_state
  # train -> generate -> train leaves the training parameters bit-identical.
  rollout = actor.generate_sequences(prompts)
  # On CPUs the engine's copy is the sampler's decoding copy: the actor holds no other.
  assert rollout.meta["metrics"]["reshard/decoding_layout"] == 1.0
  for a, b in zip(before, jax.tree.leaves(actor.params)):
    np.testing.assert_array_equal(a, np.asarray(b))


def test_generate_dtype_halves_the_bytes_moved():
  _, state = create(CFG)
  abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)
  mesh = train_mesh(jax.devices()[:8], fsdp=8)
  train = state_shardings(abstract, mesh, TRAIN_RULES)
  fp32 = HybridEngine(mesh, abstract, train, 2)
  bf16 = HybridEngine(mesh, abstract, train, 2, dtype="bfloat16")
  assert bf16.moved["total"] * 2 == fp32.moved["total"]
  gen, _ = bf16.to_generate(jax.device_put(state, train))
  assert {x.dtype for x in jax.tree.leaves(gen)} == {jnp.dtype("bfloat16")}


def test_roles_on_disjoint_pools_are_in_flight_together(first_step):
  """The controller does not block: the critic's update is still running when the actor's
  has been dispatched, so the two pools compute at the same time."""
  workers, batch, _, _ = first_step("split")  # a step run: its programs are compiled
  # Eight epochs keep the critic busy (about 8 steps) well past the actor's dispatch (a
  # few ms) even when another test process holds one of the two cores. Epochs are a
  # host loop over the same compiled step; one untimed update compiles the averaging of
  # 16 mini-batches' metrics, which would otherwise let the critic finish meanwhile.
  critic = workers["critic"]
  critic.update_cfg = dataclasses.replace(critic.update_cfg, epochs=8)
  jax.block_until_ready(critic.update_critic(batch).meta["metrics"])
  jax.block_until_ready((batch.arrays, workers["actor"].params, critic.params))
  critic_metrics = critic.update_critic(batch).meta["metrics"]
  actor_metrics = workers["actor"].update_actor(batch).meta["metrics"]
  in_flight = not all(v.is_ready() for v in critic_metrics.values())
  jax.block_until_ready((critic_metrics, actor_metrics))
  assert in_flight
  assert set(workers["critic"].mesh.devices.flat).isdisjoint(workers["actor"].mesh.devices.flat)


@pytest.mark.parametrize("src_spec,dst_spec,dst_shape", [
    (("fsdp", None), (None, "tensor"), (4, 2)),   # rows -> columns
    ((None, ("fsdp", "tensor")), ("data", "tensor"), (2, 4)),  # 2-D grid of pieces
    ((None, None), ("data", None), (4, 2)),       # replicated -> split
    (("fsdp", "tensor"), (None, None), (8, 1)),   # split -> replicated
])
@pytest.mark.parametrize("path", ["_assemble_by_copies", "_assemble_in_host_memory"])
def test_assemble_matches_the_values_for_any_pair_of_layouts(src_spec, dst_spec, dst_shape, path):
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from hflax.sharding import hybrid_engine
  assemble = getattr(hybrid_engine, path)
  devices = np.array(jax.devices()[:8])
  src_mesh = Mesh(devices.reshape(1, 4, 2), ("data", "fsdp", "tensor"))
  dst_mesh = Mesh(devices[::-1].reshape(dst_shape), ("data", "tensor"))
  value = np.arange(16 * 24, dtype=np.float32).reshape(16, 24)
  x = jax.device_put(value, NamedSharding(src_mesh, P(*src_spec)))
  out = assemble(x, NamedSharding(dst_mesh, P(*dst_spec)))
  assert out.sharding == NamedSharding(dst_mesh, P(*dst_spec))
  for shard in out.addressable_shards:
    np.testing.assert_array_equal(np.asarray(shard.data), value[shard.index])
  jax.block_until_ready(jax.jit(lambda a: a * 2)(out))  # usable as a program input


def test_cpu_switch_writes_each_generate_shard_once():
  """On CPU the replicas of a generate shard share one host buffer, and that buffer is
  the new array's own: donating the training copy afterwards leaves it intact."""
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
  from hflax.sharding.hybrid_engine import assemble
  devices = np.array(jax.devices()[:8])
  value = np.arange(64 * 8, dtype=np.float32).reshape(64, 8)
  train = jax.device_put(value, NamedSharding(Mesh(devices, ("fsdp",)), P("fsdp", None)))
  gen = assemble(train, NamedSharding(Mesh(devices.reshape(2, 4), ("tensor", "data")),
                                      P("tensor", None)))
  buffers = {}
  for shard in gen.addressable_shards:
    buffers.setdefault(shard.index[0].start, set()).add(shard.data.unsafe_buffer_pointer())
  assert sorted(buffers) == [0, 32] and all(len(b) == 1 for b in buffers.values())
  train_buffers = {s.data.unsafe_buffer_pointer() for s in train.addressable_shards}
  assert train_buffers.isdisjoint(set().union(*buffers.values()))
  jax.block_until_ready(jax.jit(lambda a: a + 1, donate_argnums=0)(train))
  np.testing.assert_array_equal(np.asarray(gen), value)
  # A shard a device already holds is kept: the same buffer, nothing written.
  train = jax.device_put(value, NamedSharding(Mesh(devices, ("fsdp",)), P("fsdp", None)))
  same = assemble(train, NamedSharding(Mesh(devices, ("tensor",)), P("tensor", None)))
  assert ([s.data.unsafe_buffer_pointer() for s in same.addressable_shards]
          == [s.data.unsafe_buffer_pointer() for s in train.addressable_shards])


def test_optimizer_offload_during_generation_changes_no_number(first_step):
  """With optimizer_offload the actor's optimizer state sits in host memory from
  generation to the next update, in its own sharding; two steps give bit-identical
  parameters and optimizer state to the run without it (that run goes on from the
  colocated placement's first step, prompts_batch(seed=0), which the other run repeats)."""
  assert PLACEMENTS["colocated"] == colocated(ROLES, 8, generate_tensor=2)
  runs = {}
  for offload in (False, True):
    if offload:
      workers = build_workers(PLACEMENTS["colocated"])
      workers["actor"].optimizer_offload = True
      ppo_step(workers, prompts_batch(seed=0))
    else:
      workers = first_step("colocated")[0]
      assert not workers["actor"].optimizer_offload
    actor = workers["actor"]
    ppo_step(workers, prompts_batch(seed=1))
    actor.generate_sequences(prompts_batch(seed=2))  # as validation does, before a step
    batch = actor.generate_sequences(prompts_batch(seed=3))
    kinds = {x.sharding.memory_kind for x in jax.tree.leaves(actor.opt_state)}
    assert kinds == ({"pinned_host"} if offload else {"device"})
    if offload:  # reported while it is off the device, not only by the call that moved it
      assert batch.meta["metrics"]["offload/optimizer_bytes"] == sum(
          x.nbytes for x in jax.tree.leaves(actor.opt_state))
      assert all(x.sharding.spec == y.spec for x, y in
                 zip(jax.tree.leaves(actor.opt_state), jax.tree.leaves(actor._opt_on_device)))
    actor._reload_optimizer()
    runs[offload] = [np.asarray(x) for x in jax.tree.leaves((actor.params, actor.opt_state))]
  for a, b in zip(runs[False], runs[True]):
    np.testing.assert_array_equal(a, b)
