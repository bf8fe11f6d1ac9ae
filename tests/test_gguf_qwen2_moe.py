"""A Qwen2-MoE GGUF written the way llama.cpp's convert_hf_to_gguf.py writes `qwen2moe`
loads with transformers' logits and greedy tokens: its shared expert and that expert's
gate, its q/k/v biases, its top-k weights left unnormalised (llama.cpp's qwen2moe graph
and transformers' Qwen2-MoE both skip the renormalisation Qwen3-MoE does)."""
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file

from hflax.models import hf, logits_fn, moe
from moe_models import assert_greedy_equals_transformers, hf_logits_and_aux, tiny_qwen2_moe

gguf_lib = pytest.importorskip("gguf", reason="the test extra installs gguf")


def write_qwen2moe_gguf(hf_dir, path, squeeze_gate=False, drop=()):
  """llama.cpp's converter for Qwen2MoeForCausalLM (Qwen2MoeModel), reading the
  checkpoint's config.json and files (one tensor an expert, as transformers saves them):
  TextModel's metadata plus the expert count, the routed and the shared experts' widths;
  tensor names from the gguf package's own name map for qwen2moe (what the converter's
  map_tensor_name uses); each layer's experts stacked [E, out, in] into
  blk.N.ffn_{gate,up,down}_exps; q/k/v weights and biases in HF's layout (only llama's
  q/k are permuted); the shared expert's gate [1, hidden] as it stands, or as a vector
  (squeeze_gate: what converters wrote while they squeezed every tensor); float32. The
  metadata keys in `drop` are left out."""
  with open(hf_dir / "config.json") as f:
    hp = json.load(f)
  theta = hp.get("rope_theta", (hp.get("rope_parameters") or {}).get("rope_theta"))
  metadata = {"block_count": hp["num_hidden_layers"],
              "context_length": hp["max_position_embeddings"],
              "embedding_length": hp["hidden_size"],
              "feed_forward_length": hp["intermediate_size"],
              "head_count": hp["num_attention_heads"],
              "head_count_kv": hp["num_key_value_heads"], "rope_freq_base": theta,
              "layer_norm_rms_eps": hp["rms_norm_eps"],
              "expert_used_count": hp["num_experts_per_tok"],
              "expert_count": hp.get("num_experts", hp.get("num_local_experts")),
              "expert_feed_forward_length": hp["moe_intermediate_size"],
              "expert_shared_feed_forward_length": hp["shared_expert_intermediate_size"],
              "file_type": gguf_lib.LlamaFileType.ALL_F32}
  if hp.get("head_dim") is not None:
    metadata.update(key_length=hp["head_dim"], value_length=hp["head_dim"])
  w = gguf_lib.GGUFWriter(str(path), "qwen2moe")
  for key, value in metadata.items():
    if key not in drop:
      getattr(w, f"add_{key}")(value)
  names = gguf_lib.get_tensor_name_map(gguf_lib.MODEL_ARCH.QWEN2MOE, hp["num_hidden_layers"])
  sd = load_file(str(hf_dir / "model.safetensors"))
  tensors = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
  for i in range(hp["num_hidden_layers"]):
    for proj in ("down", "gate", "up"):
      tensors[f"model.layers.{i}.mlp.experts.{proj}_proj.weight"] = np.stack(
          [sd[f"model.layers.{i}.mlp.experts.{e}.{proj}_proj.weight"]
           for e in range(metadata["expert_count"])])
  for name, tensor in tensors.items():
    gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
    assert gguf_name is not None, name
    if squeeze_gate and gguf_name.endswith("ffn_gate_inp_shexp.weight"):
      tensor = tensor.squeeze()
    w.add_tensor(gguf_name, tensor)
  w.write_header_to_file()
  w.write_kv_data_to_file()
  w.write_tensors_to_file()
  w.close()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """A tiny Qwen2-MoE whose every layer is sparse (llama.cpp's qwen2moe has no dense
  layers), saved by transformers and converted to GGUF."""
  model = tiny_qwen2_moe(seed=3, mlp_only_layers=[])
  root = tmp_path_factory.mktemp("qwen2moe")
  model.save_pretrained(root / "hf")
  write_qwen2moe_gguf(root / "hf", root / "tiny-qwen2moe-f32.gguf")
  return model, root


def _reader_names(path):
  return {t.name for t in gguf_lib.GGUFReader(str(path)).tensors}


def _logits(graphdef, state, ids, mask):
  return np.asarray(logits_fn(graphdef, state, jnp.asarray(ids), jnp.asarray(mask)))


def test_qwen2moe_gguf_loads_with_transformers_logits_and_tokens(files):
  model, root = files
  path = root / "tiny-qwen2moe-f32.gguf"
  # llama.cpp's names, as its loader looks them up.
  assert {"blk.0.ffn_gate_inp_shexp.weight", "blk.0.ffn_up_shexp.weight", "blk.2.attn_q.bias",
          "blk.1.ffn_down_exps.weight", "output.weight"} <= _reader_names(path)
  cfg, graphdef, state = hf.load_checkpoint(str(path))
  assert cfg.family == "qwen2_moe" and cfg.qkv_bias and not cfg.qk_norm and not cfg.o_bias
  assert not cfg.norm_topk_prob and cfg.num_sparse_layers == 3
  assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size,
          cfg.shared_expert_intermediate_size) == (8, 2, 48, 40)
  ids = np.random.RandomState(0).randint(3, 128, size=(2, 20))
  mask = np.ones_like(ids)
  mask[1, :6] = 0  # left padding
  ours = _logits(graphdef, state, ids, mask)
  want, _ = hf_logits_and_aux(model, ids, mask)
  real = mask.astype(bool)
  assert np.abs(ours - want)[real].max() <= 1e-4
  assert_greedy_equals_transformers(model, graphdef, state, [[5, 17, 33, 9],
                                                             [44, 3, 70, 71, 99, 12, 8]])
  # The parity above rests on the shared expert's gate and on the unnormalised weights:
  # zeroing the gates (each shared expert scaled by 1/2) or renormalising moves the logits.
  for change in (_zero_shared_gates, _renormalise):
    wrong = _logits(*change(graphdef, state), ids, mask)
    assert np.abs(wrong - want)[real].max() > 1e-3, change.__name__  # 10x the tolerance
  # The same weights as the safetensors route.
  _, _, from_hf = hf.load_checkpoint(str(root / "hf"))
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(state), jax.device_get(from_hf))


def _zero_shared_gates(graphdef, state):
  model = nnx.merge(graphdef, state, copy=True)  # the loaded state stays as it is
  for m in moe.sparse_modules(model):
    kernel = m.shared_expert_gate.kernel
    kernel[...] = jnp.zeros_like(kernel[...])
  return nnx.split(model)


def _renormalise(graphdef, state):
  model = nnx.merge(graphdef, state, copy=True)  # the loaded state stays as it is
  for m in moe.sparse_modules(model):
    m.norm_topk_prob = True
  return nnx.split(model)


def test_a_squeezed_shared_gate_reads_as_the_same_matrix(files, tmp_path):
  """Converters that squeezed every tensor wrote the [1, hidden] gate as a vector."""
  _, root = files
  path = tmp_path / "squeezed.gguf"
  write_qwen2moe_gguf(root / "hf", path, squeeze_gate=True)
  shapes = {t.name: t.shape.tolist() for t in gguf_lib.GGUFReader(str(path)).tensors}
  assert shapes["blk.0.ffn_gate_inp_shexp.weight"] == [64]
  _, _, state = hf.load_checkpoint(str(path))
  _, _, want = hf.load_checkpoint(str(root / "tiny-qwen2moe-f32.gguf"))
  for layer in range(3):
    got = state["layers"][layer]["mlp"]["shared_expert_gate"]["kernel"][...]
    expected = want["layers"][layer]["mlp"]["shared_expert_gate"]["kernel"][...]
    assert got.shape == (64, 1)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(expected))


def test_missing_expert_count_is_one_line_naming_the_key(files, tmp_path):
  _, root = files
  path = tmp_path / "no-experts.gguf"
  write_qwen2moe_gguf(root / "hf", path, drop=("expert_count",))
  with pytest.raises(ValueError, match=r"qwen2moe\.expert_count") as e:
    hf.read_config(str(path))
  assert "\n" not in str(e.value)
