"""A Qwen3-MoE GGUF written the way llama.cpp's convert_hf_to_gguf.py writes `qwen3moe`
loads with transformers' logits."""
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file

from hflax.models import hf, logits_fn
from moe_models import hf_logits_and_aux, tiny_moe

gguf_lib = pytest.importorskip("gguf", reason="the test extra installs gguf")

_LAYER = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
          "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
          "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate": "ffn_gate_inp"}


def write_qwen3moe_gguf(model, hf_dir, path):
  """llama.cpp's converter for Qwen3MoeForCausalLM, reading the checkpoint's files (one
  tensor an expert, as transformers saves them): TextModel's metadata plus the expert
  count, experts used and expert width; each layer's experts stacked [E, out, in] into
  blk.N.ffn_{gate,up,down}_exps; q/k kept in HF's rotary layout (qwen models are not
  permuted); float32 tensors."""
  c = model.config
  w = gguf_lib.GGUFWriter(str(path), "qwen3moe")
  w.add_block_count(c.num_hidden_layers)
  w.add_context_length(c.max_position_embeddings)
  w.add_embedding_length(c.hidden_size)
  w.add_feed_forward_length(c.intermediate_size)
  w.add_head_count(c.num_attention_heads)
  w.add_head_count_kv(c.num_key_value_heads)
  w.add_key_length(c.head_dim)
  w.add_value_length(c.head_dim)
  w.add_rope_freq_base(c.rope_parameters["rope_theta"])
  w.add_layer_norm_rms_eps(c.rms_norm_eps)
  w.add_expert_count(c.num_experts)
  w.add_expert_used_count(c.num_experts_per_tok)
  w.add_expert_feed_forward_length(c.moe_intermediate_size)
  w.add_file_type(gguf_lib.LlamaFileType.ALL_F32)
  sd = load_file(str(hf_dir / "model.safetensors"))
  w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
  for i in range(c.num_hidden_layers):
    pre = f"model.layers.{i}."
    for hf_name, name in _LAYER.items():
      w.add_tensor(f"blk.{i}.{name}.weight", sd[pre + hf_name + ".weight"])
    for proj in ("gate", "up", "down"):
      stack = np.stack([sd[f"{pre}mlp.experts.{e}.{proj}_proj.weight"]
                        for e in range(c.num_experts)])
      w.add_tensor(f"blk.{i}.ffn_{proj}_exps.weight", stack)
  w.add_tensor("output_norm.weight", sd["model.norm.weight"])
  w.add_tensor("output.weight", sd["lm_head.weight"])
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


def test_qwen3moe_gguf_loads_with_transformers_logits(tmp_path):
  model = tiny_moe(seed=2, mlp_only_layers=[])  # llama.cpp runs every layer sparse
  model.save_pretrained(tmp_path / "hf")
  path = tmp_path / "tiny-qwen3moe-f32.gguf"
  write_qwen3moe_gguf(model, tmp_path / "hf", path)
  cfg, graphdef, state = hf.load_checkpoint(str(path))
  assert cfg.family == "qwen3_moe" and cfg.qk_norm and cfg.norm_topk_prob
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size) == (8, 2, 48)
  assert cfg.num_sparse_layers == 3
  assert state["layers"][1]["mlp"]["gate"][...].shape == (8, 64, 48)
  ids = np.random.RandomState(0).randint(3, 128, size=(2, 20))
  mask = np.ones_like(ids)
  mask[1, :6] = 0
  ours = np.asarray(logits_fn(graphdef, state, jnp.asarray(ids), jnp.asarray(mask)))
  want, _ = hf_logits_and_aux(model, ids, mask)
  assert np.abs(ours - want)[mask.astype(bool)].max() <= 1e-4
  # The same weights as the safetensors route.
  _, _, from_hf = hf.load_checkpoint(str(tmp_path / "hf"))
  for layer in range(3):
    for name in ("router", "gate", "up", "down"):
      np.testing.assert_array_equal(np.asarray(state["layers"][layer]["mlp"][name][...]),
                                    np.asarray(from_hf["layers"][layer]["mlp"][name][...]))
