"""Expert parallelism: the tiny Qwen3-MoE's experts split over an "expert" mesh axis on 8
simulated devices compute what one device computes (forward, gradients, an update); the
tiny Qwen2-MoE too, its shared expert split like a dense MLP."""
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
  def loss(params, tokens, mask):
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), moe.recording() as record:
      model, hidden = forward(graphdef, params, tokens, mask)
      aux = moe.load_balancing_loss(moe.stacked(record)[1], cfg.num_experts_per_tok, mask)
    logp = jax.nn.log_softmax(model.logits(hidden)[:, :-1], axis=-1)
    token_logp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    m = mask[:, 1:].astype(jnp.float32)
    nll = -(token_logp * m).sum() / m.sum()
    return nll + cfg.router_aux_loss_coef * aux, (nll, aux, hidden)
  return loss


@pytest.mark.parametrize("family,shape", [("qwen3_moe", dict(data=2, fsdp=1, expert=4)),
                                          ("qwen3_moe", dict(fsdp=2, expert=4)),
                                          ("qwen2_moe", dict(fsdp=2, expert=4))])
def test_expert_parallel_step_equals_one_device(ckpts, family, shape):
  devices = jax.devices()
  assert len(devices) == 8
  mesh = train_mesh(devices, **shape)
  cfg, graphdef, state = hf.load_checkpoint(ckpts[family])
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

  def step(params, opt_state, tokens, mask):
    (loss, (nll, aux, hidden)), grads = jax.value_and_grad(
        _loss_fn(graphdef, cfg, mesh), has_aux=True)(params, tokens, mask)
    updates, opt_state = opt.update(grads, opt_state, params)
    return loss, aux, hidden, grads, optax.apply_updates(params, updates)

  rows = batch_sharding(mesh)
  assert set(rows.spec[0]) >= {"expert"}  # the expert group is data parallel elsewhere
  got = jax.jit(step)(sharded, opt.init(sharded), jax.device_put(tokens, rows),
                      jax.device_put(mask, rows))
  assert got[3]["layers"][0]["mlp"]["down"][...].sharding.spec[0] == "expert"
  one = jax.devices()[0]
  single = jax.device_put(state, one)
  want = jax.jit(step)(single, opt.init(single), jax.device_put(tokens, one),
                       jax.device_put(mask, one))
  names = ["loss", "aux", "hidden", "grads", "params"]
  for name, a, b in zip(names, got, want):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
      np.testing.assert_allclose(np.asarray(x), np.asarray(y), atol=1e-5, rtol=1e-5,
                                 err_msg=name)
  # The update moved the experts (a router gradient, expert gradients that are not zero).
  assert float(jnp.abs(want[3]["layers"][0]["mlp"]["router"][...]).max()) > 1e-4
  assert float(jnp.abs(want[3]["layers"][2]["mlp"]["gate"][...]).max()) > 1e-4


def test_trainer_runs_expert_parallel_from_a_placement(tmp_path, monkeypatch):
  """A custom placement's mesh with an expert axis (fsdp 2 x expert 4 on 8 devices): the
  tiny GRPO job on the tiny MoE trains with the actor's experts split over it, with
  routing replay on, and its first mini-batch is exactly on-policy."""
  import json
  from hflax.launch.trainer import Trainer
  from hflax.models.tokenizer import ByteTokenizer
  from tiny_config import get_config
  path = tmp_path / "moe"
  tiny_moe(vocab_size=ByteTokenizer().vocab_size, bos_token_id=None, eos_token_id=None,
           pad_token_id=None).save_pretrained(path)
  c = get_config()
  c.model.update(path=str(path), tokenizer="byte")
  c.actor.update(router_replay=True, recompute_log_prob=True, use_kl_loss=False)
  c.data.max_response_length = 8
  c.data.train_batch_size = 8
  c.actor.ppo_mini_batch_size = 8  # prompts: 16 rows, 2 a data-parallel device
  c.placement.update(kind="custom", pools={"all": 8},
                     roles={"actor": {"pool": "all", "mesh": {"fsdp": 2, "expert": 4}}})
  c.trainer.update(total_steps=1, save_every=1, devices=8, run_dir=str(tmp_path / "run"),
                   export_hf=False, compile_cache_dir="")
  trainer = Trainer(c, log=lambda *_: None)
  gate = trainer.roles.actor.params["layers"][0]["mlp"]["gate"][...]
  assert gate.sharding.spec[0] == "expert"
  assert {s.data.shape[0] for s in gate.addressable_shards} == {2}
  trainer.fit()
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    row = next(r for r in map(json.loads, f) if r.get("step") == 1)
  assert row["actor/ppo_kl_first_minibatch"] == 0.0
  assert trainer.roles.actor.params["layers"][0]["mlp"]["gate"][...].sharding.spec[0] == "expert"
