"""Routing replay on the tiny Qwen3-MoE: the rollout records each token's experts and the
training forward replays them."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hflax.algorithms.losses import ppo_clip_loss
from hflax.models import forward, hf, moe
from hflax.models.logprobs import sequence_log_probs
from hflax.rollout import routes as replay
from hflax.rollout.sampler import SamplingParams, generate
from moe_models import tiny_moe

PROMPTS = [[5, 17, 33, 9], [44, 3, 70, 71, 99, 12, 8], [7, 7, 8]]
N_NEW = 10


def _load(tmp_path_factory, name, **kw):
  path = tmp_path_factory.mktemp(name)
  tiny_moe(**kw).save_pretrained(path)
  return str(path)


@pytest.fixture(scope="module")
def wide(tmp_path_factory):
  return _load(tmp_path_factory, "moe_wide")


@pytest.fixture(scope="module")
def narrow(tmp_path_factory):  # a narrow router: near-ties between experts
  return _load(tmp_path_factory, "moe_narrow", router_std=0.02)


def _rollout(graphdef, state, seed=1):
  params = SamplingParams(max_new_tokens=N_NEW, temperature=1.0, n=2, eos_ids=(2,), pad_id=0,
                          record_routes=True)
  return generate(graphdef, state, PROMPTS, params, rng=jax.random.key(seed))


def _training_routes(graphdef, state, out, replay: bool):
  with moe.recording() as record:
    forward(graphdef, state, out["input_ids"], out["attention_mask"],
            routes_BxTxLxK=out["routes"] if replay else None)
  return np.asarray(moe.rows_first(moe.stacked(record)[0]))


def test_rollout_records_every_fed_token_and_replay_reproduces_them(wide):
  cfg, graphdef, state = hf.load_checkpoint(wide)
  out = _rollout(graphdef, state)
  routes = np.asarray(out["routes"])
  mask = np.asarray(out["attention_mask"], bool)
  assert routes.shape == mask.shape + (2, 2)  # 2 sparse layers, top-2
  recorded = routes[..., 0, 0] >= 0
  # Every real token but each row's last (sampled, never fed back) has its experts.
  last = mask.shape[1] - 1 - np.argmax(mask[:, ::-1], axis=1)
  want = mask.copy()
  want[np.arange(len(mask)), last] = False
  np.testing.assert_array_equal(recorded, want)
  assert ((routes >= 0) == recorded[..., None, None]).all()
  assert (routes < cfg.num_experts).all()
  np.testing.assert_array_equal(_training_routes(graphdef, state, out, True)[recorded],
                                routes[recorded])
  # fp32 decoding and teacher forcing agree: the replayed forward's log-probs are the
  # rollout's to rounding.
  logp, _ = sequence_log_probs(graphdef, state, out["input_ids"], out["attention_mask"],
                               last=N_NEW, routes_BxTxLxK=out["routes"])
  response = np.asarray(out["response_mask"], bool)
  assert np.abs(np.asarray(logp) - np.asarray(out["rollout_log_probs"]))[response].max() < 1e-5


def test_replay_matches_the_rollout_where_recomputed_routes_differ(narrow):
  """The trainer's router differs from the rollout's a little (here: the rollout's
  router perturbed by 1%, as one update moves it): near-ties flip, so recomputed routes
  differ from the rollout's; replayed ones are the rollout's exactly."""
  _, graphdef, state = hf.load_checkpoint(narrow)
  out = _rollout(graphdef, state)
  routes = np.asarray(out["routes"])
  recorded = routes >= 0
  noise = jax.random.normal(jax.random.key(7), state["layers"][0]["mlp"]["router"][...].shape)
  moved = jax.tree.map(lambda x: x, state)
  for layer in (0, 2):
    router = moved["layers"][layer]["mlp"]["router"]
    router.set_value(router[...] * (1 + 0.01 * noise))
  off = _training_routes(graphdef, moved, out, replay=False)
  on = _training_routes(graphdef, moved, out, replay=True)
  differ = (np.sort(off, -1) != np.sort(routes, -1))[recorded]
  assert differ.sum() >= 3, differ.sum()
  np.testing.assert_array_equal(on[recorded], routes[recorded])
  # The trainer's metrics: agreement counts the tokens whose every layer's experts the
  # moved router would pick as the rollout did; the load counts every replayed pick.
  fn = replay.replay_log_probs_fn(graphdef, N_NEW, 1.0, 8)
  _, _, stats = jax.jit(fn)(moved, {k: out[k] for k in ("input_ids", "attention_mask", "routes")})
  tokens = recorded[..., 0, 0]
  same = np.all(np.sort(off, -1) == np.sort(routes, -1), axis=(-2, -1)) & tokens
  np.testing.assert_array_equal(np.asarray(stats["agree"]), same.sum(1))
  np.testing.assert_array_equal(np.asarray(stats["tokens"]), tokens.sum(1))
  assert float(np.asarray(stats["load"]).sum()) == tokens.sum() * 2 * 2  # layers x k
  metrics = replay.replay_metrics(stats)
  assert metrics["actor/route_agreement"] == same.sum() / tokens.sum() < 1.0


def test_bfloat16_rollout_routes_replay_exactly_in_float32_training(narrow):
  _, g16, s16 = hf.load_checkpoint(narrow, dtype="bfloat16")
  _, graphdef, state = hf.load_checkpoint(narrow)
  out = _rollout(g16, s16)
  routes = np.asarray(out["routes"])
  recorded = routes >= 0
  np.testing.assert_array_equal(_training_routes(graphdef, state, out, True)[recorded],
                                routes[recorded])


def test_ppo_step_with_replay_is_on_policy_and_trains_the_router(wide):
  """The trainer's two forwards (old log-probs, then the update's) replay the rollout's
  routes: in fp32 the ratio is exactly 1 (ppo_kl 0, nothing clipped), and the router
  still gets its gradient through the combine weights."""
  _, graphdef, state = hf.load_checkpoint(wide)
  out = _rollout(graphdef, state)
  fields = dict(out)
  fields["advantages"] = jnp.asarray(
      np.random.RandomState(0).randn(*out["response_mask"].shape), jnp.float32)

  def logp(params):
    return sequence_log_probs(graphdef, params, fields["input_ids"], fields["attention_mask"],
                              last=N_NEW, routes_BxTxLxK=fields["routes"])[0]

  old = jax.jit(logp)(state)

  def loss(params):
    per_token, metrics = ppo_clip_loss(logp(params), old, fields["advantages"],
                                       fields["response_mask"])
    return per_token.sum() / fields["response_mask"].sum(), metrics

  (_, metrics), grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state)
  assert float(metrics["ppo_kl"]) == 0.0 and float(metrics["pg_clipfrac"]) == 0.0
  assert float(jnp.abs(grads["layers"][0]["mlp"]["router"][...]).max()) > 1e-6
  assert float(jnp.abs(grads["layers"][2]["mlp"]["down"][...]).max()) > 1e-6


def test_recording_needs_a_mixture_of_experts(tmp_path):
  from hf_models import loaded_pair
  _, graphdef, state = loaded_pair("qwen3", tmp_path)
  params = SamplingParams(max_new_tokens=2, temperature=0, record_routes=True)
  with pytest.raises(ValueError, match="no mixture-of-experts layers"):
    generate(graphdef, state, [[5, 6]], params)


def test_trainer_replays_the_rollouts_routes_on_policy(tmp_path, monkeypatch):
  """The tiny GRPO job on the tiny MoE with actor.router_replay: the rollout's routes
  reach the actor's log-prob and update forwards, and the first mini-batch's update is
  exactly on-policy in fp32 (ppo_kl 0, nothing clipped)."""
  import json
  from hflax.launch.trainer import Trainer
  from hflax.models import transformer
  from hflax.models.tokenizer import ByteTokenizer
  from tiny_config import get_config
  path = tmp_path / "moe"
  tiny_moe(vocab_size=ByteTokenizer().vocab_size, bos_token_id=None, eos_token_id=None,
           pad_token_id=None).save_pretrained(path)
  c = get_config()
  c.model.update(path=str(path), tokenizer="byte")
  c.actor.update(router_replay=True, recompute_log_prob=True)
  c.data.max_response_length = 8
  c.trainer.update(total_steps=1, save_every=1, run_dir=str(tmp_path / "run"), export_hf=False,
                   compile_cache_dir="")
  replayed = []
  real = transformer.set_replay
  monkeypatch.setattr(transformer, "set_replay",
                      lambda model, routes: replayed.append(routes.shape) or real(model, routes))
  Trainer(c, log=lambda *_: None).fit()
  # Traced by the log-prob pass and the update: [sparse layers, rows, columns, k].
  assert len(replayed) >= 2 and all(s[0] == 2 and s[-1] == 2 for s in replayed)
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    row = next(r for r in map(json.loads, f) if r.get("step") == 1)
  assert row["actor/ppo_kl_first_minibatch"] == 0.0
  assert row["actor/pg_clipfrac_first_minibatch"] == 0.0
  # fp32 rollout and trainer on the same weights route alike; the load is uneven (a
  # random router) but no expert takes every pick (8 experts: at most 8x an even share).
  assert row["actor/route_agreement"] == 1.0
  assert 1.0 < row["actor/expert_load_max"] < 8.0


def test_router_replay_config_conflicts_are_one_line():
  from hflax.launch.config import validate
  from tiny_config import get_config
  c = get_config()
  c.actor.router_replay = True
  c.model.use_remove_padding = True
  with pytest.raises(ValueError, match=r"^config\.actor\.router_replay: .*use_remove_padding"):
    validate(c)


def test_remat_forward_records_and_replays_as_the_plain_one(wide):
  """model.remat recomputes each layer in the backward pass (nnx.remat): the routes and
  router logits recorded inside it still reach the caller, and the replayed gradients are
  the plain forward's."""
  _, graphdef, state = hf.load_checkpoint(wide)
  _, remat_graphdef, remat_state = hf.load_checkpoint(wide, remat=True)
  out = _rollout(graphdef, state)
  rows = {k: out[k] for k in ("input_ids", "attention_mask", "routes")}

  def run(g, s):
    fn = replay.replay_log_probs_fn(g, N_NEW, 1.0, 8)
    grad = jax.grad(lambda p: fn(p, rows)[0].sum())
    return jax.jit(fn)(s, rows), jax.jit(grad)(s)

  (plain, plain_grad), (remat, remat_grad) = run(graphdef, state), run(remat_graphdef, remat_state)
  for key in ("agree", "tokens", "load"):
    np.testing.assert_array_equal(np.asarray(plain[2][key]), np.asarray(remat[2][key]))
  np.testing.assert_allclose(np.asarray(plain[0]), np.asarray(remat[0]), atol=1e-6)
  for a, b in zip(jax.tree.leaves(plain_grad), jax.tree.leaves(remat_grad)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4)
