"""GGUF export (hflax.models.gguf_export): written files read back through hflax's reader
to the same weights, config and logits; the shipped SmolLM2 file rewritten keeps its
tensors, metadata keys and tokenizer; transformers' GGUF loader reads the written tiny
llama and qwen2 files to hflax's logits; the launcher's trainer.export_gguf. llama.cpp
itself runs the written files in tests/llama_cpp_check.py (by hand: llama-cpp-python
compiles llama.cpp, so it is not in the test extra)."""
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from hflax.models import ModelConfig, create, gguf, hf, logits_fn
from hflax.models.gguf_export import write_gguf
from hflax.models.lora import add_adapters, merge_adapters
from hflax.models.transformer import create_abstract
from hflax.models.tokenizer import ByteTokenizer, load_tokenizer, save_tokenizer

gguf_lib = pytest.importorskip("gguf", reason="the test extra installs gguf")
transformers = pytest.importorskip("transformers")

SMOLLM2 = "smollm2-135m-instruct"
BYTE = ByteTokenizer()
# Exact in float32 (GGUF stores the epsilon as one), so the config reads back equal.
EPS = 2.0 ** -17
_COMMON = dict(vocab_size=300, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
               rms_norm_eps=EPS, max_position_embeddings=256, bos_token_id=BYTE.bos_id,
               eos_token_id=BYTE.eos_ids[0], pad_token_id=BYTE.pad_id)
CONFIGS = {
    # Llama with every bias, linear RoPE scaling and a head_dim other than hidden / heads.
    "llama": dict(family="llama", intermediate_size=48, head_dim=16, qkv_bias=True,
                  o_bias=True, mlp_bias=True, rope_theta=500000.0,
                  rope_scaling=(("factor", 2.0), ("rope_type", "linear"))),
    "qwen2": dict(family="qwen2", intermediate_size=48, qkv_bias=True, tie_word_embeddings=True,
                  rope_theta=1000000.0),
    "qwen3": dict(family="qwen3", intermediate_size=48, head_dim=16, qk_norm=True,
                  rope_theta=1000000.0),
    "qwen3_moe": dict(family="qwen3_moe", intermediate_size=48, qk_norm=True, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True),
    "qwen2_moe": dict(family="qwen2_moe", intermediate_size=48, qkv_bias=True, num_experts=4,
                      num_experts_per_tok=2, moe_intermediate_size=24,
                      shared_expert_intermediate_size=40),
}
# Llama 3.1's scaling at this size: head_dim 16 at theta 5e5 puts one frequency in each
# band edge's neighbourhood (kept, blended, divided by the factor).
LLAMA3 = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
          ("original_max_position_embeddings", 64), ("rope_type", "llama3"))
YARN = (("factor", 4.0), ("original_max_position_embeddings", 64), ("rope_type", "yarn"))
IDS = np.random.RandomState(0).randint(3, 256, size=(2, 12))
MASK = np.ones_like(IDS)
MASK[1, :4] = 0  # left padding


def random_model(family: str, seed: int = 0, **overrides):
  """A tiny model whose every weight is random (norm scales and biases too, which
  create() starts at one and zero), so that no tensor's layout can hide."""
  cfg = ModelConfig(**{**_COMMON, **CONFIGS[family], **overrides})
  graphdef, state = create(cfg, seed=seed)
  leaves, treedef = jax.tree.flatten(state)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  noisy = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
  return cfg, graphdef, jax.tree.unflatten(treedef, noisy)


def _logits(graphdef, state):
  return np.asarray(logits_fn(graphdef, state, jnp.asarray(IDS), jnp.asarray(MASK)))


def _assert_same_weights(a, b):
  jax.tree.map(np.testing.assert_array_equal, jax.device_get(a), jax.device_get(b))


@pytest.mark.parametrize("family", list(CONFIGS))
def test_round_trip_through_hflax_reader(family, tmp_path):
  cfg, graphdef, state = random_model(family)
  path = str(tmp_path / f"{family}.gguf")
  write_gguf(path, cfg, state, BYTE)
  back_cfg, back_graphdef, back = hf.load_checkpoint(path)
  assert back_cfg == cfg
  _assert_same_weights(back, state)
  np.testing.assert_array_equal(_logits(back_graphdef, back), _logits(graphdef, state))
  names = {t.name for t in gguf_lib.GGUFReader(path).tensors}
  # llama.cpp's names: the experts stacked, the output absent where embeddings are tied.
  assert ("blk.1.ffn_gate_exps.weight" in names) == bool(cfg.num_experts)
  assert ("blk.0.ffn_gate_inp_shexp.weight" in names) == (family == "qwen2_moe")
  assert ("output.weight" in names) != cfg.tie_word_embeddings
  assert not [p for p in os.listdir(tmp_path) if "incomplete" in p]


def test_llama_q_k_rows_are_llama_cpps_interleaving(tmp_path):
  """The file's attn_q / attn_k rows are llama.cpp's: within each head, row 2j is HF's row
  j (first rotary half) and row 2j + 1 HF's row half + j (second half)."""
  cfg, _, state = random_model("llama")
  path = str(tmp_path / "llama.gguf")
  write_gguf(path, cfg, state, BYTE)
  tensors = {t.name: t for t in gguf_lib.GGUFReader(path).tensors}
  for proj, heads in (("q", cfg.num_heads), ("k", cfg.num_kv_heads)):
    hf_rows = np.asarray(state["layers"][0]["attn"][proj]["kernel"][...]).T  # [out, in]
    stored = np.asarray(tensors[f"blk.0.attn_{proj}.weight"].data)
    half = cfg.head_dim // 2
    for h in range(heads):
      for j in range(half):
        base = h * cfg.head_dim
        np.testing.assert_array_equal(stored[base + 2 * j], hf_rows[base + j])
        np.testing.assert_array_equal(stored[base + 2 * j + 1], hf_rows[base + half + j])
    bias = np.asarray(tensors[f"blk.0.attn_{proj}.bias"].data)
    want = np.asarray(state["layers"][0]["attn"][proj]["bias"][...]).reshape(heads, 2, half)
    np.testing.assert_array_equal(bias.reshape(heads, half, 2), want.swapaxes(1, 2))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_keeps_norms_biases_and_router_in_f32(dtype, tmp_path):
  cfg, _, state = random_model("qwen3_moe")
  path = str(tmp_path / "m.gguf")
  write_gguf(path, cfg, state, BYTE, dtype=dtype)
  reader = gguf_lib.GGUFReader(path)
  kinds = {t.name: t.tensor_type.name for t in reader.tensors}
  want = {"float16": "F16", "bfloat16": "BF16"}[dtype]
  assert kinds["blk.0.attn_q.weight"] == kinds["blk.0.ffn_up_exps.weight"] == want
  assert kinds["token_embd.weight"] == kinds["output.weight"] == want
  assert kinds["blk.0.attn_norm.weight"] == kinds["blk.0.attn_q_norm.weight"] == "F32"
  assert kinds["blk.0.ffn_gate_inp.weight"] == kinds["output_norm.weight"] == "F32"
  file_type = reader.fields["general.file_type"].contents()
  assert file_type == {"float16": 1, "bfloat16": 32}[dtype]  # llama.cpp's MOSTLY_F16 / _BF16
  _, _, back = hf.load_checkpoint(path)
  rounded = np.float16 if dtype == "float16" else jnp.bfloat16
  q = np.asarray(state["layers"][0]["attn"]["q"]["kernel"][...])
  np.testing.assert_array_equal(np.asarray(back["layers"][0]["attn"]["q"]["kernel"][...]),
                                q.astype(rounded).astype(np.float32))
  np.testing.assert_array_equal(np.asarray(back["layers"][1]["mlp"]["router"][...]),
                                np.asarray(state["layers"][1]["mlp"]["router"][...]))


def test_lora_exports_the_merged_weights(tmp_path):
  cfg, graphdef, state = random_model("qwen2")
  lora_cfg = cfg.replace(lora_rank=4, lora_alpha=8.0, lora_targets=("q_proj", "v_proj"))
  _, adapted = add_adapters(lora_cfg, state, seed=3)
  # B starts at zero: a non-zero one, so that the merge changes the kernels it touches.
  adapted = jax.tree_util.tree_map_with_path(
      lambda path, x: x + 0.05 if "lora_b" in jax.tree_util.keystr(path) else x, adapted)
  path = str(tmp_path / "lora.gguf")
  write_gguf(path, lora_cfg, adapted, BYTE)
  back_cfg, _, back = hf.load_checkpoint(path)
  assert back_cfg == cfg
  merged = merge_adapters(lora_cfg, adapted)
  _assert_same_weights(back, merged)
  attn, base = back["layers"][0]["attn"], state["layers"][0]["attn"]
  for proj in "qv":  # adapted: changed; k not
    assert not np.array_equal(np.asarray(attn[proj]["kernel"][...]),
                              np.asarray(base[proj]["kernel"][...]))
  np.testing.assert_array_equal(np.asarray(attn["k"]["kernel"][...]),
                                np.asarray(base["k"]["kernel"][...]))


def test_byte_tokenizer_reads_back_as_itself(tmp_path):
  cfg, _, state = random_model("llama")
  path = str(tmp_path / "t.gguf")
  write_gguf(path, cfg, state, BYTE)
  tok = load_tokenizer(path)
  for text in ("héllo wörld", "<|im_start|>user\nhi<|im_end|>", "日本語 😀", ""):
    assert tok.encode(text) == BYTE.encode(text), text
    assert tok.decode(BYTE.encode(text), skip_special_tokens=False) == text
  chat = [{"role": "user", "content": "2+2?"}]
  assert tok.apply_chat_template(chat) == BYTE.apply_chat_template(chat)
  assert (tok.bos_id, tok.eos_ids, tok.pad_id) == (BYTE.bos_id, BYTE.eos_ids, BYTE.pad_id)
  merges = gguf_lib.GGUFReader(path).fields["tokenizer.ggml.merges"]
  assert merges.contents() == []  # present (llama.cpp requires the key), empty


def test_what_llama_cpp_would_run_differently_is_refused_in_one_line(tmp_path):
  cfg, _, state = random_model("qwen3_moe")
  cases = [
      (cfg, dict(dtype="q4_0"), "dtype 'q4_0' is not one of"),
      (cfg.replace(norm_topk_prob=False), {}, "llama.cpp runs norm_topk_prob=True"),
      (cfg.replace(decoder_sparse_step=2), {}, "llama.cpp runs every layer sparse"),
      (cfg.replace(vocab_size=200), {}, "the byte tokenizer has 261 tokens, more than"),
  ]
  qwen2_cfg, _, qwen2_state = random_model("qwen2")
  cases += [(qwen2_cfg.replace(rope_scaling=LLAMA3), {},
             "qwen2: llama3 RoPE scaling has no GGUF form for it"),
            (qwen2_cfg.replace(rope_scaling=YARN + (("mscale", 0.7),)), {},
             "not ['mscale']"),
            (qwen2_cfg.replace(rope_scaling=YARN + (("truncate", False),)), {},
             "truncate=False")]
  for bad_cfg, kw, message in cases:
    st = qwen2_state if bad_cfg.family == "qwen2" else state
    if bad_cfg.vocab_size != cfg.vocab_size:
      st = create(bad_cfg)[1]
    with pytest.raises(ValueError) as e:
      write_gguf(str(tmp_path / "bad.gguf"), bad_cfg, st, BYTE, **kw)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)
  assert os.listdir(tmp_path) == []  # nothing written, not even a partial file


def test_without_the_gguf_package_export_names_the_install(tmp_path, monkeypatch):
  import sys
  cfg, _, state = random_model("qwen2")
  monkeypatch.setitem(sys.modules, "gguf", None)  # what an install without it imports
  with pytest.raises(ValueError, match=r"^writing \.gguf files needs the gguf package: "
                                       r"pip install gguf \(or .*hflax\[gguf\]'\)$"):
    write_gguf(str(tmp_path / "m.gguf"), cfg, state, BYTE)
  assert os.listdir(tmp_path) == []


# -- RoPE scaling: llama3 (rope_freqs) and YaRN (rope.scaling.* keys) ------------------------
@pytest.mark.parametrize("family,scaling", [
    ("llama", LLAMA3), ("qwen2", YARN),
    ("qwen3", tuple(sorted(YARN + (("attention_factor", 1.25), ("beta_fast", 16.0),
                                   ("beta_slow", 2.0)))))])
def test_rope_scaling_round_trips(family, scaling, tmp_path):
  """The written file reads back to the same config and bit-identical logits, which the
  scaling changes; llama3's divisors are the converter's formula (1, the blend
  1 / ((1 - s) / factor + s) with s = (original / wavelength - low) / (high - low), the
  factor), computed here by hand; YaRN's keys are the converter's."""
  cfg, graphdef, state = random_model(family, rope_scaling=scaling)
  path = str(tmp_path / "m.gguf")
  write_gguf(path, cfg, state, BYTE)
  back_cfg, back_graphdef, back = hf.load_checkpoint(path)
  assert back_cfg == cfg
  got = _logits(back_graphdef, back)
  np.testing.assert_array_equal(got, _logits(graphdef, state))
  unscaled = _logits(create_abstract(cfg.replace(rope_scaling=None))[0], state)
  assert np.abs(got - unscaled)[MASK.astype(bool)].max() > 1e-3
  reader = gguf_lib.GGUFReader(path)
  fields = {k: f.contents() for k, f in reader.fields.items() if ".rope." in k}
  freqs = [t for t in reader.tensors if t.name == "rope_freqs.weight"]
  if family == "llama":
    assert freqs[0].tensor_type.name == "F32" and "llama.rope.scaling.type" not in fields
    wavelength = 2 * np.pi * 500000.0 ** (np.arange(0, 16, 2) / 16)
    smooth = (64 / wavelength - 1) / (4 - 1)
    want = np.where(wavelength < 64 / 4, 1, np.where(wavelength > 64, 8,
                                                     1 / ((1 - smooth) / 8 + smooth)))
    assert 1 < want[1] < 8 and want[0] == 1 and want[-1] == 8  # every band once at least
    np.testing.assert_allclose(np.asarray(freqs[0].data), want, rtol=1e-6)
  else:
    arch = family
    assert not freqs and fields[f"{arch}.rope.scaling.type"] == "yarn"
    assert fields[f"{arch}.rope.scaling.factor"] == 4.0
    assert fields[f"{arch}.rope.scaling.original_context_length"] == 64
    extra = {f"{arch}.rope.scaling.yarn_{k}" for k in ("attn_factor", "beta_fast", "beta_slow")}
    assert (extra <= set(fields)) == (family == "qwen3") and (extra & set(fields)) <= extra


def test_llama3_divisors_from_llama_cpps_converter_read_with_its_defaults(tmp_path,
                                                                       monkeypatch):
  """A file as llama.cpp's converter writes it (rope_freqs without hflax's keys) reads back
  with the converter's defaults (low 1, high 4, original context 8192) and the largest
  divisor as the factor; divisors those do not give are refused in one line."""
  llama31 = (("factor", 8.0), ("high_freq_factor", 4.0), ("low_freq_factor", 1.0),
             ("original_max_position_embeddings", 8192), ("rope_type", "llama3"))
  cfg, graphdef, state = random_model("llama", rope_scaling=llama31)
  monkeypatch.setattr(gguf, "LLAMA3_KEYS", {})  # the writer records no parameters
  write_gguf(str(tmp_path / "m.gguf"), cfg, state, BYTE)
  other = cfg.replace(rope_scaling=(("low_freq_factor", 2.0),) + llama31[:2] + llama31[3:])
  write_gguf(str(tmp_path / "other.gguf"), other, state, BYTE)
  monkeypatch.undo()
  assert "hflax.rope.llama3.factor" not in gguf_lib.GGUFReader(str(tmp_path / "m.gguf")).fields
  back_cfg, back_graphdef, back = hf.load_checkpoint(str(tmp_path / "m.gguf"))
  assert back_cfg == cfg
  np.testing.assert_array_equal(_logits(back_graphdef, back), _logits(graphdef, state))
  with pytest.raises(ValueError, match=r"rope_freqs.weight \(8 divisors\) is no llama3 "
                                       r"scaling hflax can name") as e:
    hf.read_config(str(tmp_path / "other.gguf"))
  assert "\n" not in str(e.value)


@pytest.mark.parametrize("scaling", [LLAMA3, YARN, tuple(sorted(
    YARN + (("attention_factor", 1.25), ("beta_fast", 16.0), ("beta_slow", 2.0))))])
def test_rope_frequencies_are_transformers(scaling):
  """hflax's inverse frequencies and attention factor for the scaled configs above are
  transformers' (its ROPE_INIT_FUNCTIONS on the config hflax exports)."""
  from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

  from hflax.models.rope import inverse_frequencies
  family = "llama" if dict(scaling)["rope_type"] == "llama3" else "qwen3"
  cfg = ModelConfig(**{**_COMMON, **CONFIGS[family], "rope_scaling": scaling})
  hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
  want, want_factor = ROPE_INIT_FUNCTIONS[dict(scaling)["rope_type"]](hf_cfg, "cpu")
  got, factor = inverse_frequencies(cfg)
  np.testing.assert_allclose(got.astype(np.float32), want.numpy(), rtol=1e-6)
  assert factor == pytest.approx(want_factor, rel=1e-6)


# -- the shipped SmolLM2 file ---------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
  source = gguf.resolve(SMOLLM2)
  if not os.path.isfile(source):
    pytest.fail(f"{SMOLLM2}: install its package ({gguf.SHIPPED[SMOLLM2][2]})")
  cfg, graphdef, state = hf.load_checkpoint(SMOLLM2)
  tok = load_tokenizer(SMOLLM2)
  path = str(tmp_path_factory.mktemp("smollm2") / "smollm2-f32.gguf")
  write_gguf(path, cfg, state, tok)
  return source, path, cfg, graphdef, state, tok


def test_smollm2_rewritten_keeps_tensors_metadata_and_tokenizer(smollm2):
  source, path, *_ = smollm2
  # The written file through the gguf package's own reader; the original through hflax's
  # (already open; field for field the same, tests/test_gguf.py).
  original, written = gguf._open(source), gguf_lib.GGUFReader(path)
  assert ({t.name: list(t.shape) for t in written.tensors}
          == {t.name: list(t.shape) for t in original.tensors})
  assert {t.tensor_type.name for t in written.tensors} == {"F32"}  # the source: Q4_1 and Q8_0
  assert set(written.fields) == set(original.fields)
  differ = {k for k in original.fields if not k.startswith("GGUF.")
            and original.fields[k].contents() != written.fields[k].contents()}
  # Only the file type: the weights are F32 here (0), Q4_1 mostly (3) in the source.
  assert differ == {"general.file_type"}, differ
  assert written.fields["general.file_type"].contents() == 0
  for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type"):
    assert written.fields[key].types == original.fields[key].types, key
  assert len(written.fields["tokenizer.ggml.merges"].contents()) == 48900


def test_smollm2_rewritten_reads_to_the_same_weights_and_logits(smollm2):
  _, path, cfg, graphdef, state, tok = smollm2
  back_cfg, back_graphdef, back = hf.load_checkpoint(path)
  assert back_cfg == cfg
  _assert_same_weights(back, state)
  prompts = [tok.encode_chat([{"role": "user", "content": text}])
             for text in ("What is 23+45?", "Name three colours.", "Hi")]
  width = max(map(len, prompts))
  ids = np.asarray([[tok.pad_id] * (width - len(p)) + p for p in prompts])
  mask = np.asarray([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
  run = lambda g, s: np.asarray(logits_fn(g, s, jnp.asarray(ids), jnp.asarray(mask)))  # noqa: E731
  np.testing.assert_array_equal(run(back_graphdef, back), run(graphdef, state))
  again = load_tokenizer(path)
  for text in ("What is 23+45? Answer with just the number.", "héllo wörld 1234567890",
               "<|im_start|>user\nhi<|im_end|>"):
    assert again.encode(text) == tok.encode(text)


def test_hf_tokenizer_is_written_as_llama_cpps_converter_writes_it(smollm2, tmp_path):
  """The HF route: SmolLM2's tokenizer saved as an HF directory (tokenizer.json), then
  written from there: the same tokens, token types and merges as the original file; the
  pre-tokenizer is named from tokenizer.json (GPT-2's byte-level regex: "gpt-2"), where the
  original names its model ("smollm")."""
  source, *_ , tok = smollm2
  save_tokenizer(tok, str(tmp_path))
  hf_tok = load_tokenizer(str(tmp_path))
  assert hf_tok.directory == str(tmp_path)
  cfg = ModelConfig(vocab_size=49152, hidden_size=16, intermediate_size=16, num_layers=1,
                    num_heads=2, num_kv_heads=1, tie_word_embeddings=True)
  path = str(tmp_path / "hf-tok.gguf")
  write_gguf(path, cfg, create(cfg)[1], hf_tok)
  original, written = gguf._open(source), gguf._reader_class()(path)
  for key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges",
              "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
              "tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id",
              "tokenizer.ggml.add_bos_token", "tokenizer.chat_template", "tokenizer.ggml.model"):
    assert written.fields[key].contents() == original.fields[key].contents(), key
  assert written.fields["tokenizer.ggml.pre"].contents() == "gpt-2"
  again = load_tokenizer(path)
  for text in ("What is 23+45?", "naïve café", "<|im_start|>user\nhi<|im_end|>"):
    assert again.encode(text) == tok.encode(text)
  # The same vocabulary behind Qwen2's split: named "qwen2", and read back to the HF
  # tokenizer's ids, which differ from GPT-2's split on runs of newlines.
  spec = json.loads((tmp_path / "tokenizer.json").read_text())
  spec["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
      {"type": "Split", "pattern": {"Regex": gguf._QWEN2_SPLIT}, "behavior": "Isolated",
       "invert": False},
      {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
       "use_regex": False}]}
  (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
  qwen_tok = load_tokenizer(str(tmp_path))
  write_gguf(path, cfg, create(cfg)[1], qwen_tok)
  assert gguf._reader_class()(path).fields["tokenizer.ggml.pre"].contents() == "qwen2"
  text = "ok!!\n\nnext x\n\n\ny"
  assert qwen_tok.encode(text) != tok.encode(text)
  assert load_tokenizer(path).encode(text) == qwen_tok.encode(text)


# -- transformers' GGUF loader ------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_written_file_loads_in_transformers_with_hflax_logits(family, tmp_path):
  """transformers un-permutes llama's q/k itself (its own reading of llama.cpp's layout).
  Its GGUF config mapping has no attention biases, RoPE scaling or head_dim: the llama here
  has none of them."""
  plain = dict(rope_scaling=None, head_dim=None, o_bias=False, mlp_bias=False, qkv_bias=False)
  cfg, graphdef, state = random_model(family, seed=5, **(plain if family == "llama" else {}))
  write_gguf(str(tmp_path / "m.gguf"), cfg, state, BYTE)
  ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf",
                                                           dtype=torch.float32).eval()
  with torch.no_grad():
    want = ref(torch.tensor(IDS), attention_mask=torch.tensor(MASK)).logits.numpy()
  got = _logits(graphdef, state)
  real = MASK.astype(bool)
  assert np.abs(got - want)[real].max() <= 1e-4


@pytest.mark.parametrize("family,scaling", [("llama", LLAMA3), ("qwen2", YARN)])
def test_transformers_gguf_loader_runs_scaled_files_unscaled(family, scaling, tmp_path):
  """transformers 5's GGUF loader reads no RoPE scaling for llama or qwen2 (only for
  gpt-oss): it loads the file with rope_type default, ignoring rope_freqs and the yarn
  keys, so its logits are those of the model without scaling, not hflax's."""
  plain = dict(head_dim=None, o_bias=False, mlp_bias=False, qkv_bias=False)
  cfg, graphdef, state = random_model(family, seed=5, rope_scaling=scaling,
                                      **(plain if family == "llama" else {}))
  write_gguf(str(tmp_path / "m.gguf"), cfg, state, BYTE)
  ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf",
                                                           dtype=torch.float32).eval()
  assert ref.config.rope_parameters["rope_type"] == "default"
  with torch.no_grad():
    want = ref(torch.tensor(IDS), attention_mask=torch.tensor(MASK)).logits.numpy()
  real = MASK.astype(bool)
  unscaled = _logits(create_abstract(cfg.replace(rope_scaling=None))[0], state)
  assert np.abs(unscaled - want)[real].max() <= 1e-4
  assert np.abs(_logits(graphdef, state) - want)[real].max() > 1e-2


# -- the launcher -----------------------------------------------------------------------------
def test_launcher_export_gguf_writes_the_final_actor_lora_merged(tmp_path):
  """A LoRA run: the file holds the final actor with its adapters merged, the very weights
  of the HF export beside it."""
  from hflax.launch.roles import actor_config
  from tiny_config import fit, get_config
  c = get_config()
  c.model.lora_rank = 4
  c.trainer.update(total_steps=1, run_dir=str(tmp_path / "run"), export_gguf=True)
  trainer = fit(c)
  run = tmp_path / "run"
  assert (run / "gguf_actor" / "EXPORT_COMPLETE").is_file()
  back_cfg, _, back = hf.load_checkpoint(str(run / "gguf_actor" / "model.gguf"))
  assert back_cfg.lora_rank == 0 and back_cfg.num_layers == trainer.model_cfg.num_layers
  merged = merge_adapters(actor_config(c, trainer.model_cfg), trainer.roles.actor.params)
  _assert_same_weights(back, merged)
  _, _, exported = hf.load_checkpoint(str(run / "hf_actor"))
  _assert_same_weights(back, exported)
  assert load_tokenizer(str(run / "gguf_actor" / "model.gguf")).encode("12+34=") == \
      BYTE.encode("12+34=")


def test_launcher_refuses_what_it_could_not_export_before_the_run(tmp_path, capsys,
                                                                   monkeypatch):
  import importlib.util

  import tokenizers

  from hflax.launch.__main__ import cli
  from hflax.launch.config import validate
  from tiny_config import get_config
  # A word-level tokenizer: no llama.cpp vocabulary type hflax writes.
  words = tokenizers.Tokenizer(tokenizers.models.WordLevel({"[UNK]": 0, "1": 1, "+": 2},
                                                           unk_token="[UNK]"))
  words.save(str(tmp_path / "tokenizer.json"))
  tiny = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny_config.py")
  code = cli(["--config", tiny, f"--config.trainer.run_dir={tmp_path}/run",
              f"--config.model.tokenizer={tmp_path}", "--config.trainer.export_gguf=True"])
  err = capsys.readouterr().err.strip()
  assert code == 2 and "config.trainer.export_gguf: tokenizer" in err, err
  assert "only byte-level BPE" in err and "\n" not in err
  assert not (tmp_path / "run" / "checkpoints").exists()
  c = get_config()
  c.trainer.export_gguf = True
  real = importlib.util.find_spec
  monkeypatch.setattr(importlib.util, "find_spec",
                      lambda name, *a: None if name == "gguf" else real(name, *a))
  with pytest.raises(ValueError, match=r"config.trainer.export_gguf: .*pip install"):
    validate(c)
