"""Qwen3-MoE parity with transformers: logits, greedy generation, the load-balancing loss,
the config and HF checkpoint round trip."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from hflax.models import ModelConfig, forward, hf, logits_fn, moe
from moe_models import (assert_export_round_trips, assert_greedy_equals_transformers,
                        hf_logits_and_aux, saved_tiny_moe, tiny_moe)

logits_jit = jax.jit(logits_fn, static_argnums=0)


def _batch(seed=0):
  ids = np.random.RandomState(seed).randint(3, 128, size=(3, 24))
  mask = np.ones_like(ids)
  mask[1, :7] = 0  # left padding
  mask[2, :1] = 0
  return ids, mask


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  # The saved model and the one compared with are both tiny_moe(seed=0).
  return tiny_moe(seed=0), saved_tiny_moe(tmp_path_factory, "qwen3_moe", seed=0)


def test_config_reads_the_experts(ckpt):
  _, path = ckpt
  cfg = hf.read_config(path)
  assert cfg.family == "qwen3_moe" and cfg.qk_norm
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 48)
  assert cfg.norm_topk_prob and cfg.mlp_only_layers == (1,) and cfg.router_aux_loss_coef == 0.01
  assert [cfg.sparse_layer(i) for i in range(3)] == [True, False, True]
  model = tiny_moe()
  assert cfg.num_params == sum(p.numel() for p in model.parameters())
  # Active: 2 of 8 experts in each of the 2 sparse layers.
  expert = 3 * 64 * 48
  assert cfg.num_params - cfg.num_active_params == 2 * 6 * expert


def test_logits_and_aux_loss_match_transformers(ckpt):
  model, path = ckpt
  cfg, graphdef, state = hf.load_checkpoint(path)
  ids, mask = _batch()
  ours = np.asarray(logits_jit(graphdef, state, jnp.asarray(ids), jnp.asarray(mask)))
  want, want_aux = hf_logits_and_aux(model, ids, mask)
  assert np.abs(ours - want)[mask.astype(bool)].max() <= 1e-4
  with moe.recording() as record:
    forward(graphdef, state, jnp.asarray(ids), jnp.asarray(mask))
  routes, router_logits = moe.stacked(record)
  assert routes.shape == (2, 3, 24, 2) and router_logits.shape == (2, 3, 24, 8)
  aux = moe.load_balancing_loss(router_logits, cfg.num_experts_per_tok, jnp.asarray(mask))
  assert abs(float(aux) - want_aux) <= 1e-6
  assert abs(want_aux - 1.0) > 0.01  # not the balanced value by accident
  # The routes are transformers' top-2 experts of each token.
  with torch.no_grad():
    out = model(torch.tensor(ids), attention_mask=torch.tensor(mask), output_router_logits=True)
  for layer, hf_logits in enumerate(out.router_logits):
    top = torch.topk(hf_logits.float().softmax(-1), 2, dim=-1).indices.numpy().reshape(3, 24, 2)
    got = np.asarray(routes[layer])
    np.testing.assert_array_equal(np.sort(got, -1)[mask.astype(bool)],
                                  np.sort(top, -1)[mask.astype(bool)])


def test_aux_loss_without_mask_matches_transformers(ckpt):
  model, path = ckpt
  cfg, graphdef, state = hf.load_checkpoint(path)
  ids = np.random.RandomState(3).randint(3, 128, size=(2, 16))
  with torch.no_grad():
    want = float(model(torch.tensor(ids), output_router_logits=True).aux_loss)
  with moe.recording() as record:
    forward(graphdef, state, jnp.asarray(ids), jnp.ones(ids.shape, bool))
  aux = moe.load_balancing_loss(moe.stacked(record)[1], cfg.num_experts_per_tok)
  assert abs(float(aux) - want) <= 1e-6


def test_greedy_generation_equals_transformers_generate(ckpt):
  model, path = ckpt
  _, graphdef, state = hf.load_checkpoint(path)
  assert_greedy_equals_transformers(model, graphdef, state, [[5, 17, 33, 9],
                                                             [44, 3, 70, 71, 99, 12, 8]])


def test_export_round_trip_gives_identical_tensors(ckpt, tmp_path):
  model, path = ckpt
  cfg, graphdef, state = hf.load_checkpoint(path)
  config = assert_export_round_trips(model, cfg, state, tmp_path)
  assert config["architectures"] == ["Qwen3MoeForCausalLM"] and config["num_experts"] == 8


def test_bad_moe_config_is_refused_in_one_line():
  base = dict(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
              num_kv_heads=2, family="qwen3_moe", num_experts=4, moe_intermediate_size=4)
  with pytest.raises(ValueError, match="num_experts_per_tok"):
    ModelConfig(**base, num_experts_per_tok=5)
  hf_config = tiny_moe().config.to_dict()
  del hf_config["num_experts_per_tok"]
  with pytest.raises(ValueError, match="missing required field 'num_experts_per_tok'"):
    ModelConfig.from_hf(hf_config)
