"""The load-balancing loss in the actor's loss (actor.moe_aux_loss_coef) on the tiny
Qwen3-MoE: the term is coef x transformers' load_balancing_loss_func on the same router
logits and tokens, its router gradient is the aux loss's (checked by finite differences),
and a launched run logs it."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

from hflax.algorithms.objectives import actor_loss
from hflax.controller.actor_objective import padded_loss
from hflax.controller.update_engine import FRESH
from hflax.models import forward, hf, moe
from moe_models import saved_tiny_moe, tiny_moe

COEF = 0.05
WIDTH = 6


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  return saved_tiny_moe(tmp_path_factory, "qwen3_moe_aux", seed=2)


def _fields():
  """4 rows of 16 columns (the last WIDTH the response), left-padded; row 3 only pads the
  micro-batch (no response token to train), so the balance leaves it out."""
  rs = np.random.RandomState(0)
  ids = rs.randint(3, 128, size=(4, 16)).astype(np.int32)
  mask = np.ones((4, 16), np.int32)
  mask[1, :5] = 0
  mask[2, :2] = 0
  response = np.ones((4, WIDTH), np.float32)
  response[2, 4:] = 0
  response[3] = 0
  return {"input_ids": jnp.asarray(ids), "attention_mask": jnp.asarray(mask),
          "response_mask": jnp.asarray(response),
          "old_log_probs": jnp.asarray(rs.normal(-4.0, 0.3, (4, WIDTH)), jnp.float32),
          "advantages": jnp.asarray(rs.normal(size=(4, WIDTH)), jnp.float32),
          FRESH: jnp.zeros((4,), jnp.float32)}


def _losses(graphdef, top_k):
  with_aux = padded_loss(graphdef, actor_loss({"moe_aux_loss_coef": COEF}), width=WIDTH,
                         temperature=1.0, top_k=top_k)
  without = padded_loss(graphdef, actor_loss({}), width=WIDTH, temperature=1.0, top_k=top_k)
  return with_aux, without


def _trained_tokens(fields):
  mask = np.asarray(fields["attention_mask"]).copy()
  mask[np.asarray(fields["response_mask"]).sum(1) == 0] = 0
  return mask


def _router_path(path):
  names = [str(getattr(p, "key", getattr(p, "idx", p))) for p in path]
  return names[:4] == ["layers", "0", "mlp", "router"]


def test_loss_adds_coef_times_transformers_aux_loss(ckpt):
  cfg, graphdef, state = hf.load_checkpoint(ckpt)
  fields = _fields()
  with_aux, without = _losses(graphdef, cfg.num_experts_per_tok)
  total, metrics = jax.jit(with_aux)(state, fields)
  base, base_metrics = jax.jit(without)(state, fields)
  # The torch reference on the router logits of the same forward, over the trained rows'
  # real tokens (transformers' attention mask).
  with moe.recording() as record:
    forward(graphdef, state, fields["input_ids"], fields["attention_mask"])
  _, logits = moe.stacked(record)
  gate = tuple(torch.tensor(np.asarray(layer).reshape(-1, cfg.num_experts)) for layer in logits)
  want = float(load_balancing_loss_func(gate, cfg.num_experts, cfg.num_experts_per_tok,
                                        torch.tensor(_trained_tokens(fields))))
  assert 0.0 < want < cfg.num_experts  # k (2) for an even load
  np.testing.assert_allclose(float(metrics["moe_aux_loss"]), want, rtol=1e-6)
  np.testing.assert_allclose(float(total), float(base) + COEF * want, rtol=1e-6, atol=1e-7)
  # Without the coefficient the aux loss is still measured, not added.
  np.testing.assert_allclose(float(base_metrics["moe_aux_loss"]), want, rtol=1e-6)
  np.testing.assert_allclose(float(base), float(base_metrics["pg_loss"]), rtol=1e-6)
  # The busiest expert's share against an even share, by hand from the same logits.
  tokens = _trained_tokens(fields).astype(bool)
  top = np.asarray(jax.lax.top_k(logits, cfg.num_experts_per_tok)[1])  # [L, B, T, k]
  worst = max(np.bincount(top[layer][tokens].ravel(), minlength=cfg.num_experts).max()
              / (tokens.sum() * cfg.num_experts_per_tok / cfg.num_experts)
              for layer in range(len(top)))
  np.testing.assert_allclose(float(metrics["moe_expert_load_max"]), worst, rtol=1e-6)


def test_router_gradient_is_the_aux_losss_and_matches_finite_differences(ckpt):
  cfg, graphdef, state = hf.load_checkpoint(ckpt)
  fields = _fields()
  with_aux, without = _losses(graphdef, cfg.num_experts_per_tok)
  tokens = jnp.asarray(_trained_tokens(fields))

  def aux_of(params):  # the reference: the aux loss alone, through the same forward
    with moe.recording() as record:
      forward(graphdef, params, fields["input_ids"], fields["attention_mask"])
    return moe.load_balancing_loss(moe.stacked(record)[1], cfg.num_experts_per_tok, tokens)

  def router(tree):
    return next(x for p, x in jax.tree_util.tree_leaves_with_path(tree) if _router_path(p))

  grad = lambda fn: jax.jit(jax.grad(lambda p: fn(p, fields)[0]))(state)  # noqa: E731
  g_with, g_without = router(grad(with_aux)), router(grad(without))
  g_aux = router(jax.jit(jax.grad(aux_of))(state))
  assert float(jnp.abs(g_aux).max()) > 1e-3  # the router gets a balancing gradient
  np.testing.assert_allclose(np.asarray(g_with - g_without), COEF * np.asarray(g_aux),
                             atol=1e-6)
  # Central differences of the aux loss along a direction of layer 0's router: the
  # gradient's plus a random one (the difference of two float32 losses near 2 is exact to
  # about 2e-7, so the step's slope must be large against 2e-7 / eps).
  v = g_aux / jnp.linalg.norm(g_aux) + 0.5 * jax.random.normal(
      jax.random.key(3), g_aux.shape, g_aux.dtype) / np.sqrt(g_aux.size)
  v, eps = v / jnp.linalg.norm(v), 2e-3

  def moved(sign):
    return jax.tree_util.tree_map_with_path(
        lambda p, x: x + sign * eps * v if _router_path(p) else x, state)

  def routes(params):
    with moe.recording() as record:
      forward(graphdef, params, fields["input_ids"], fields["attention_mask"])
    return np.sort(np.asarray(moe.stacked(record)[0]), axis=-1)

  # The top-k choices (piecewise constant) do not change within the step, so the
  # difference quotient measures the smooth part the gradient describes.
  np.testing.assert_array_equal(routes(moved(1.0)), routes(moved(-1.0)))
  aux = jax.jit(aux_of)
  fd = (float(aux(moved(1.0))) - float(aux(moved(-1.0)))) / (2 * eps)
  slope = float(jnp.vdot(g_aux, v))
  print("directional derivative", slope, "central difference", fd)
  assert abs(slope) > 1e-2
  np.testing.assert_allclose(slope, fd, rtol=1e-3)


def test_packed_rows_count_the_same_tokens_as_padded_ones(ckpt):
  """The packed update's balance (segment ids) equals the padded one's (attention mask of
  the trained rows) on the same sequences, and so does the loss with the term."""
  from hflax.controller.actor_objective import packed_loss
  from hflax.controller.packing import micro_batch_plans
  from hflax.controller.update_engine import packed_fields
  cfg, graphdef, state = hf.load_checkpoint(ckpt)
  fields = _fields()
  tokens = _trained_tokens(fields)
  (plan,) = micro_batch_plans(tokens, multiple=1)  # every sequence in one packed plan
  arrays = {k: jnp.asarray(v) for k, v in plan.arrays(False).items()}
  slots = {k: jnp.take(v, arrays["seq_rows"], axis=0) for k, v in fields.items()}
  slots["response_mask"] = slots["response_mask"] * arrays["member"][:, None]
  packed = {**slots, **packed_fields(fields["input_ids"], jnp.asarray(tokens)[plan.seq_rows],
                                     arrays, WIDTH)}
  loss = actor_loss({"moe_aux_loss_coef": COEF})
  got_total, got = jax.jit(packed_loss(graphdef, loss, temperature=1.0,
                                       top_k=cfg.num_experts_per_tok))(state, packed)
  want_total, want = jax.jit(padded_loss(graphdef, loss, width=WIDTH, temperature=1.0,
                                         top_k=cfg.num_experts_per_tok))(state, fields)
  for k in ("moe_aux_loss", "moe_expert_load_max", "pg_loss"):
    np.testing.assert_allclose(float(got[k]), float(want[k]), rtol=1e-5, err_msg=k)
  np.testing.assert_allclose(float(got_total), float(want_total), rtol=1e-5)


def test_coefficient_is_validated_in_one_line(tmp_path):
  from hflax.launch.config import validate
  from hflax.launch.trainer import Trainer
  from tiny_config import get_config
  c = get_config()
  c.actor.moe_aux_loss_coef = -0.01
  with pytest.raises(ValueError, match=r"^config\.actor\.moe_aux_loss_coef: "):
    validate(c)
  c = get_config()  # the built-in model is dense
  c.actor.moe_aux_loss_coef = 0.01
  c.trainer.run_dir = str(tmp_path / "run")
  with pytest.raises(ValueError, match=r"^config\.actor\.moe_aux_loss_coef: .*no sparse layers"):
    Trainer(c, log=lambda *_: None)


def test_launched_moe_run_logs_the_aux_loss(tmp_path):
  """The tiny GRPO job on the tiny MoE with packed micro-batches, sorted dispatch (in the
  rollout and the update) and the aux term on: its step logs the aux loss and the experts'
  load."""
  from hflax.launch.trainer import Trainer
  from hflax.models.tokenizer import ByteTokenizer
  from tiny_config import get_config
  path = tmp_path / "moe"
  tiny_moe(vocab_size=ByteTokenizer().vocab_size, bos_token_id=None, eos_token_id=None,
           pad_token_id=None).save_pretrained(path)
  c = get_config()
  c.model.update(path=str(path), tokenizer="byte", use_remove_padding=True,
                 moe_dispatch="sorted")
  c.actor.update(moe_aux_loss_coef=0.01, use_kl_loss=False)
  c.data.max_response_length = 8
  c.trainer.update(total_steps=1, save_every=1, run_dir=str(tmp_path / "run"), export_hf=False,
                   compile_cache_dir="")
  trainer = Trainer(c, log=lambda *_: None)
  assert trainer.roles.actor.cfg.moe_dispatch == "sorted"
  trainer.fit()
  with open(tmp_path / "run" / "metrics.jsonl") as f:
    row = next(r for r in map(json.loads, f) if r.get("step") == 1)
  assert 0.0 < row["actor/moe_aux_loss"] < 8.0
  assert 1.0 < row["actor/moe_expert_load_max"] < 8.0
