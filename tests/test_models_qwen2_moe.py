"""Qwen2-MoE parity with transformers: its shared expert and q/k/v biases on top of the
sparse layers test_models_moe.py checks for Qwen3-MoE (logits, load-balancing loss, greedy
tokens, the config and the HF checkpoint round trip)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hflax.models import ModelConfig, forward, hf, logits_fn, moe
from moe_models import (assert_export_round_trips, assert_greedy_equals_transformers,
                        hf_logits_and_aux, saved_tiny_moe, tiny_qwen2_moe)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
  # The saved model and the one compared with are both tiny_qwen2_moe(seed=0).
  return tiny_qwen2_moe(seed=0), saved_tiny_moe(tmp_path_factory, "qwen2_moe", seed=0,
                                                 build=tiny_qwen2_moe)


def test_config_counts_the_shared_expert(ckpt):
  model, path = ckpt
  cfg = hf.read_config(path)
  assert cfg.family == "qwen2_moe" and cfg.qkv_bias and not cfg.o_bias and not cfg.qk_norm
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.shared_expert_intermediate_size) == (
      8, 2, 40)
  assert not cfg.norm_topk_prob and [cfg.sparse_layer(i) for i in range(3)] == [True, False, True]
  assert cfg.num_params == sum(p.numel() for p in model.parameters())
  # Every token runs through the shared expert: only 6 of 8 routed experts are inactive.
  assert cfg.num_params - cfg.num_active_params == 2 * 6 * 3 * 64 * 48


def test_logits_aux_loss_and_greedy_tokens_match_transformers(ckpt):
  model, path = ckpt
  cfg, graphdef, state = hf.load_checkpoint(path)
  ids = np.random.RandomState(0).randint(3, 128, size=(3, 24))
  mask = np.ones_like(ids)
  mask[1, :7] = 0  # left padding
  ours = np.asarray(jax.jit(logits_fn, static_argnums=0)(graphdef, state, jnp.asarray(ids),
                                                          jnp.asarray(mask)))
  want, want_aux = hf_logits_and_aux(model, ids, mask)
  assert np.abs(ours - want)[mask.astype(bool)].max() <= 1e-4
  # Without its shared expert the model is another one: the parity above depends on it.
  shared = np.asarray(state["layers"][0]["mlp"]["shared_expert"]["down"]["kernel"][...])
  assert np.abs(shared).max() > 0
  with moe.recording() as record:
    forward(graphdef, state, jnp.asarray(ids), jnp.asarray(mask))
  aux = moe.load_balancing_loss(moe.stacked(record)[1], cfg.num_experts_per_tok,
                                jnp.asarray(mask))
  assert abs(float(aux) - want_aux) <= 1e-6
  assert_greedy_equals_transformers(model, graphdef, state, [[5, 17, 33, 9],
                                                             [44, 3, 70, 71, 99, 12, 8]])


def test_export_round_trip_gives_identical_tensors(ckpt, tmp_path):
  model, path = ckpt
  cfg, _, state = hf.load_checkpoint(path)
  config = assert_export_round_trips(model, cfg, state, tmp_path)
  assert config["architectures"] == ["Qwen2MoeForCausalLM"]
  assert config["shared_expert_intermediate_size"] == 40 and config["qkv_bias"]


def test_a_shared_expert_without_experts_is_refused_in_one_line():
  with pytest.raises(ValueError, match="shared_expert_intermediate_size=8 needs num_experts"):
    ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
                num_kv_heads=2, family="qwen2_moe", shared_expert_intermediate_size=8)
