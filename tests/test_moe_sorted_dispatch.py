"""model.moe_dispatch="sorted" (tokens grouped by expert for jax.lax.ragged_dot) computes
what dense dispatch computes on the tiny Qwen3-MoE: logits and gradients, with fresh and
replayed routes, on one device and with the experts split over 8 simulated devices."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from hflax.models import forward, hf, moe
from hflax.models.config import ModelConfig
from hflax.sharding.layouts import TRAIN_RULES, batch_sharding, state_shardings, train_mesh
from moe_models import saved_tiny_moe


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  return saved_tiny_moe(tmp_path_factory, "qwen3_moe_sorted", seed=1)


def _batch():
  rs = np.random.RandomState(0)
  tokens = jnp.asarray(rs.randint(3, 128, size=(8, 20)), jnp.int32)
  mask = np.ones((8, 20), bool)
  mask[3, :5] = False
  mask[6, :11] = False
  return tokens, jnp.asarray(mask)


def _step(graphdef, cfg, mesh=None, routes=None):
  """(params, tokens, mask) -> ((loss, (logits, aux)), grads): a token NLL plus the
  load-balancing term, so the router's gradient has both paths."""
  def loss(params, tokens, mask):
    with moe.recording() as record:
      model, hidden = forward(graphdef, params, tokens, mask, routes_BxTxLxK=routes)
      aux = moe.load_balancing_loss(moe.stacked(record)[1], cfg.num_experts_per_tok, mask)
    logits = model.logits(hidden)
    logp = jax.nn.log_softmax(logits[:, :-1], axis=-1)
    token_logp = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
    m = mask[:, 1:].astype(jnp.float32)
    return -(token_logp * m).sum() / m.sum() + 0.01 * aux, (logits, aux)

  def step(params, tokens, mask):
    if mesh is None:
      return jax.value_and_grad(loss, has_aux=True)(params, tokens, mask)
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
      return jax.value_and_grad(loss, has_aux=True)(params, tokens, mask)
  return jax.jit(step)


def _assert_equal(got, want):
  (loss, (logits, aux)), grads = got
  (loss_w, (logits_w, aux_w)), grads_w = want
  np.testing.assert_allclose(np.asarray(logits), np.asarray(logits_w), atol=1e-5, rtol=0)
  np.testing.assert_allclose(float(loss), float(loss_w), rtol=1e-6)
  np.testing.assert_allclose(float(aux), float(aux_w), rtol=1e-6)
  for path, g in jax.tree_util.tree_leaves_with_path(grads):
    w = next(x for p, x in jax.tree_util.tree_leaves_with_path(grads_w) if p == path)
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), atol=1e-5, rtol=1e-5,
                               err_msg=jax.tree_util.keystr(path))


def test_sorted_equals_dense_on_one_device(ckpt):
  cfg, dense, state = hf.load_checkpoint(ckpt)
  sorted_cfg, grouped, _ = hf.load_checkpoint(ckpt, moe_dispatch="sorted")
  assert sorted_cfg.moe_dispatch == "sorted"
  assert all(m.dispatch == "sorted" for m in moe.sparse_modules(nnx.merge(grouped, state)))
  tokens, mask = _batch()
  want = _step(dense, cfg)(state, tokens, mask)
  got = _step(grouped, cfg)(state, tokens, mask)
  _assert_equal(got, want)
  # The experts and the router have gradients (not a vacuous equality of zeros).
  grads = want[1]["layers"][0]["mlp"]
  assert float(jnp.abs(grads["gate"][...]).max()) > 1e-4
  assert float(jnp.abs(grads["router"][...]).max()) > 1e-4


def test_sorted_equals_dense_with_replayed_routes(ckpt):
  """Replayed routes (here: another token's experts, so they differ from the router's own
  choice) go through the grouped matmul as they go through the combine weights."""
  cfg, dense, state = hf.load_checkpoint(ckpt)
  _, grouped, _ = hf.load_checkpoint(ckpt, moe_dispatch="sorted")
  tokens, mask = _batch()
  with moe.recording() as record:
    forward(dense, state, tokens, mask)
  routes = jnp.roll(moe.stacked(record)[0], 1, axis=2)  # [L, B, T, k], shifted a column
  routes = moe.rows_first(routes.at[:, 0, :3].set(-1))  # some tokens route afresh
  want = _step(dense, cfg, routes=routes)(state, tokens, mask)
  got = _step(grouped, cfg, routes=routes)(state, tokens, mask)
  _assert_equal(got, want)


@pytest.mark.parametrize("shape", [dict(data=2, fsdp=1, expert=4), dict(fsdp=2, expert=4)])
def test_sorted_with_experts_split_over_8_devices_equals_dense_on_one(ckpt, shape):
  mesh = train_mesh(jax.devices(), **shape)
  cfg, dense, state = hf.load_checkpoint(ckpt)
  _, grouped, _ = hf.load_checkpoint(ckpt, moe_dispatch="sorted")
  sharded = jax.device_put(state, state_shardings(state, mesh, TRAIN_RULES))
  gate = sharded["layers"][0]["mlp"]["gate"][...]
  assert {s.data.shape[0] for s in gate.addressable_shards} == {2}  # 2 experts a device
  tokens, mask = _batch()
  rows = batch_sharding(mesh)
  got = _step(grouped, cfg, mesh)(sharded, jax.device_put(tokens, rows),
                                  jax.device_put(mask, rows))
  assert got[1]["layers"][0]["mlp"]["down"][...].sharding.spec[0] == "expert"
  one = jax.devices()[0]
  want = _step(dense, cfg)(jax.device_put(state, one), jax.device_put(tokens, one),
                           jax.device_put(mask, one))
  _assert_equal(got, want)


def test_dispatch_is_validated_in_one_line(ckpt):
  with pytest.raises(ValueError, match=r"^moe_dispatch='grouped' is not one of"):
    ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=1,
                num_kv_heads=1, moe_dispatch="grouped")
  from hflax.launch.config import validate
  from hflax.launch.models import policy_model
  from tiny_config import get_config
  c = get_config()
  c.model.moe_dispatch = "grouped"
  with pytest.raises(ValueError, match=r"^config\.model\.moe_dispatch: 'grouped' is not one of"):
    validate(c)
  c.model.update(moe_dispatch="sorted", path=ckpt)
  assert policy_model(c, 128)[0].moe_dispatch == "sorted"


def test_sorted_in_bfloat16_is_as_close_to_float32_as_dense(ckpt):
  """In bfloat16 the two dispatches round differently (the grouped matmul sums a token's
  picks after the down projection, dense dispatch inside it); both stay within bfloat16's
  rounding of the float32 logits."""
  _, fp32, state = hf.load_checkpoint(ckpt)
  tokens, mask = _batch()

  def logits(graphdef):
    return jax.jit(lambda p: (lambda m, h: m.logits(h))(*forward(graphdef, p, tokens, mask)))(
        state)
  want = np.asarray(logits(fp32))
  for dispatch in ("dense", "sorted"):
    _, graphdef, _ = hf.load_checkpoint(ckpt, dtype="bfloat16", moe_dispatch=dispatch)
    err = np.abs(np.asarray(logits(graphdef)) - want)[np.asarray(mask)].max()
    assert 0 < err < 2e-2, (dispatch, err)
