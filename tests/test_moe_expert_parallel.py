"""Expert parallelism: the tiny Qwen3-MoE's experts split over an "expert" mesh axis on 8
simulated devices compute what one device computes (forward, gradients, an update); the
tiny Qwen2-MoE too, its shared expert split like a dense MLP."""
import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from hflax.models import forward, hf, moe
from hflax.sharding.layouts import (TRAIN_RULES, batch_sharding, partition_spec,
                                    state_shardings, train_mesh)
from moe_models import saved_tiny_moe, tiny_moe, tiny_qwen2_moe


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
  return {"qwen3_moe": saved_tiny_moe(tmp_path_factory, "qwen3_moe_ep", seed=1),
          "qwen2_moe": saved_tiny_moe(tmp_path_factory, "qwen2_moe_ep", seed=1,
                                      build=tiny_qwen2_moe)}


def _loss_fn(graphdef, cfg, mesh):
  """The loss traced under `mesh` as the trainer traces it (None: no mesh, one device)."""
  def loss(params, tokens, mask):
    context = (jax.sharding.use_abstract_mesh(mesh.abstract_mesh) if mesh is not None
               else contextlib.nullcontext())
    with context, moe.recording() as record:
      model, hidden = forward(graphdef, params, tokens, mask)
      aux = moe.load_balancing_loss(moe.stacked(record)[1], cfg.num_experts_per_tok, mask)
    logp = jax.nn.log_softmax(model.logits(hidden)[:, :-1], axis=-1)
    token_logp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    m = mask[:, 1:].astype(jnp.float32)
    nll = -(token_logp * m).sum() / m.sum()
    return nll + cfg.router_aux_loss_coef * aux, (nll, aux, hidden)
  return loss


@pytest.mark.parametrize("family,shape,dispatch", [
    ("qwen3_moe", dict(data=2, fsdp=1, expert=4), "dense"),
    ("qwen3_moe", dict(fsdp=2, expert=4), "dense"),
    ("qwen2_moe", dict(fsdp=2, expert=4), "dense"),
    ("qwen3_moe", dict(data=2, expert=4), "all_to_all"),
    ("qwen2_moe", dict(fsdp=2, expert=4), "all_to_all")])
def test_expert_parallel_step_equals_one_device(ckpts, family, shape, dispatch):
  """all_to_all: on one device (no mesh) the same model computes "sorted"."""
  devices = jax.devices()
  assert len(devices) == 8
  mesh = train_mesh(devices, **shape)
  cfg, graphdef, state = hf.load_checkpoint(ckpts[family], moe_dispatch=dispatch)
  assert cfg.family == family
  shardings = state_shardings(state, mesh, TRAIN_RULES)
  sharded = jax.device_put(state, shardings)
  # The experts really are split over the expert axis: 2 of the 8 on each device.
  gate = sharded["layers"][0]["mlp"]["gate"][...]
  assert gate.sharding.spec[0] == "expert"
  assert {s.data.shape[0] for s in gate.addressable_shards} == {2}
  assert partition_spec(("expert", "embed", "expert_mlp"), (8, 64, 48), TRAIN_RULES,
                        mesh)[0] == "expert"

  rs = np.random.RandomState(0)
  tokens = jnp.asarray(rs.randint(3, 128, size=(8, 20)), jnp.int32)
  mask = np.ones((8, 20), bool)
  mask[3, :5] = False
  mask = jnp.asarray(mask)
  # Adam's first step is lr * g / (|g| + eps): with the default eps a gradient entry of
  # rounding size (1e-8, an embedding row no token uses much) moves by lr times its sign,
  # so eps sits above float32's rounding of the gradients for the comparison to mean
  # something.
  opt = optax.adamw(1e-2, eps=1e-4)

  def stepper(on_mesh):
    def step(params, opt_state, tokens, mask):
      (loss, (nll, aux, hidden)), grads = jax.value_and_grad(
          _loss_fn(graphdef, cfg, on_mesh), has_aux=True)(params, tokens, mask)
      updates, opt_state = opt.update(grads, opt_state, params)
      return loss, aux, hidden, grads, optax.apply_updates(params, updates)
    return step

  rows = batch_sharding(mesh)
  assert set(rows.spec[0]) >= {"expert"}  # the expert group is data parallel elsewhere
  args = (sharded, opt.init(sharded), jax.device_put(tokens, rows), jax.device_put(mask, rows))
  compiled = jax.jit(stepper(mesh)).lower(*args).compile()
  got = compiled(*args)
  assert got[3]["layers"][0]["mlp"]["down"][...].sharding.spec[0] == "expert"
  # The picks travel by all-to-all (forward and backward) only where asked to.
  # Under all_to_all the picks travel by all-to-all: each device's buffer of its rows'
  # picks for each expert device (8 rows / 8 devices x 20 tokens x top-2 = 40 rows of
  # width 64, capacity factor 0), out and back in each sparse layer's forward (2 layers)
  # and again in the backward: 8 exchanges. Dense dispatch exchanges no rows.
  exchanges = [line for line in compiled.as_text().splitlines()
               if "all-to-all(" in line and "f32[40,64]" in line]
  assert len(exchanges) == (8 if dispatch == "all_to_all" else 0)
  one = jax.devices()[0]
  single = jax.device_put(state, one)
  want = jax.jit(stepper(None))(single, opt.init(single), jax.device_put(tokens, one),
                                jax.device_put(mask, one))
  names = ["loss", "aux", "hidden", "grads", "params"]
  for name, a, b in zip(names, got, want):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=1e-5,
                                 err_msg=name)
  # The update moved the experts (a router gradient, expert gradients that are not zero).
  assert float(jnp.abs(want[3]["layers"][0]["mlp"]["router"][...]).max()) > 1e-4
  assert float(jnp.abs(want[3]["layers"][2]["mlp"]["gate"][...]).max()) > 1e-4


@pytest.mark.parametrize("dispatch", ["dense", "all_to_all"])
def test_trainer_runs_expert_parallel_from_a_placement(tmp_path, monkeypatch, dispatch):
  """A custom placement's mesh with an expert axis (fsdp 2 x expert 4 on 8 devices): the
  tiny GRPO job on the tiny MoE trains with the actor's experts split over it, with
  routing replay on, and its first mini-batch is exactly on-policy; all_to_all: its
  training programs exchange the picks by all-to-all (the trainer traces them under the
  pool's mesh), generation computes them sorted on its own mesh."""
  import json
  from hflax.launch.trainer import Trainer
  from hflax.models.tokenizer import ByteTokenizer
  from tiny_config import get_config
  path = tmp_path / "moe"
  tiny_moe(vocab_size=ByteTokenizer().vocab_size, bos_token_id=None, eos_token_id=None,
           pad_token_id=None).save_pretrained(path)
  c = get_config()
  c.model.update(path=str(path), tokenizer="byte", moe_dispatch=dispatch)
  c.actor.update(router_replay=True, recompute_log_prob=True, use_kl_loss=False)
  c.data.max_response_length = 8
  c.data.train_batch_size = 8
  c.actor.ppo_mini_batch_size = 8  # prompts: 16 rows, 2 a data-parallel device
  c.placement.update(kind="custom", pools={"all": 8},
                     roles={"actor": {"pool": "all", "mesh": {"fsdp": 2, "expert": 4}}})
  c.trainer.update(total_steps=1, save_every=1, devices=8, run_dir=str(tmp_path / "run"),
                   export_hf=False, compile_cache_dir="")
  from hflax.models import experts
  traced = []  # the exchanges traced into the run's programs, by experts per device
  exchange = experts._exchange
  monkeypatch.setattr(experts, "_exchange",
                      lambda *a, **kw: traced.append(a[3].shape[0]) or exchange(*a, **kw))
  trainer = Trainer(c, log=lambda *_: None)
  gate = trainer.roles.actor.params["layers"][0]["mlp"]["gate"][...]
  assert gate.sharding.spec[0] == "expert"
  assert {s.data.shape[0] for s in gate.addressable_shards} == {2}
  trainer.fit()
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    row = next(r for r in map(json.loads, f) if r.get("step") == 1)
  assert row["actor/ppo_kl_first_minibatch"] == 0.0
  # all_to_all: the update and the log-prob passes exchanged the picks (each device holds
  # 2 of the 8 experts); dense never does.
  assert (set(traced) == {2}) if dispatch == "all_to_all" else not traced
  assert trainer.roles.actor.params["layers"][0]["mlp"]["gate"][...].sharding.spec[0] == "expert"


@pytest.mark.parametrize("capacity_factor", [0.0, 0.5])
def test_all_to_all_dispatch_drops_only_the_picks_past_capacity(capacity_factor):
  """all_to_all dispatch on data 2 x expert 4 (one row a device, 2 of 8 experts a device)
  against a hand computation: each device's picks, in expert order, go to their expert's
  device up to `capacity` rows per destination; later ones contribute nothing. The
  routes crowd experts 0 and 1 so that the factor 0.5 (capacity 2 of 12 picks) drops
  some, while 0 (capacity 12) drops none."""
  from hflax.models import experts
  B, T, D, F, E, k = 8, 6, 16, 8, 8, 2
  rs = np.random.RandomState(3)
  x = rs.randn(B, T, D).astype(np.float32)
  first = rs.choice([0, 1, 2, 5], size=(B, T))
  routes = np.stack([first, (first + 1 + rs.randint(0, E - 1, size=(B, T))) % E], -1)
  weights = rs.rand(B, T, k).astype(np.float32)
  gate, up = (rs.randn(E, D, F).astype(np.float32) * 0.3 for _ in range(2))
  down = rs.randn(E, F, D).astype(np.float32) * 0.3

  def expert_out(e, v):
    g = v @ gate[e]
    return (g / (1 + np.exp(-g)) * (v @ up[e])) @ down[e]

  picks = T * k
  capacity = picks if not capacity_factor else int(np.ceil(capacity_factor * picks / 4))
  want, dropped = np.zeros_like(x), 0
  for b in range(B):
    flat = routes[b].reshape(-1)
    taken = dict.fromkeys(range(4), 0)
    for i in np.argsort(flat, kind="stable"):
      dest = flat[i] // 2
      taken[dest] += 1
      if taken[dest] > capacity:
        dropped += 1
        continue
      t, j = divmod(int(i), k)
      want[b, t] += weights[b, t, j] * expert_out(flat[i], x[b, t])
  assert (dropped > 0) == bool(capacity_factor)

  mesh = train_mesh(jax.devices(), data=2, expert=4)
  rows = NamedSharding(mesh, P(("data", "expert")))
  split = NamedSharding(mesh, P("expert"))

  def run(*args):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return experts.all_to_all_experts(*args, capacity_factor=capacity_factor)
  got = jax.jit(run)(*(jax.device_put(a, rows) for a in (x, routes.astype(np.int32),
                                                          weights)),
                     *(jax.device_put(w, split) for w in (gate, up, down)))
  np.testing.assert_allclose(np.asarray(got), want, atol=1e-5, rtol=1e-5)
