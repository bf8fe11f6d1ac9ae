"""llama.cpp itself runs the files hflax.models.gguf_export writes, to hflax's logits: every
architecture's tiny random model, and the shipped SmolLM2 rewritten (with llama.cpp's
tokenisation equal to hflax's).

Not part of the suite (its name is not test_*.py): llama-cpp-python compiles llama.cpp
(about 17 minutes on a 2-core CPU), so the test extra leaves it out. Run it by hand:

  pip install llama-cpp-python
  python -m pytest -q tests/llama_cpp_check.py
"""
import jax.numpy as jnp
import llama_cpp
import numpy as np
import pytest

from hflax.models import logits_fn
from hflax.models.gguf_export import write_gguf
from test_gguf_export import BYTE, CONFIGS, IDS, _logits, random_model, smollm2  # noqa: F401


def _llama_cpp_logits(path, ids):
  # F32 keys and values (llama.cpp's cache is F16 by default), so the F32 weights are all.
  f32 = 0  # GGML_TYPE_F32
  llm = llama_cpp.Llama(model_path=str(path), logits_all=True, n_ctx=256, n_batch=256,
                        n_threads=1, verbose=False, type_k=f32, type_v=f32)
  llm.eval([int(i) for i in ids])
  return llm, np.asarray(llm.scores[:len(ids)])


@pytest.mark.parametrize("family", list(CONFIGS))
def test_written_file_runs_in_llama_cpp_with_hflax_logits(family, tmp_path):
  cfg, graphdef, state = random_model(family, seed=2)
  write_gguf(str(tmp_path / "m.gguf"), cfg, state, BYTE)
  _, got = _llama_cpp_logits(tmp_path / "m.gguf", IDS[0])
  want = _logits(graphdef, state)[0]
  assert np.abs(got - want).max() <= 1e-4


def test_smollm2_rewritten_runs_in_llama_cpp(smollm2):
  _, path, cfg, graphdef, state, tok = smollm2
  ids = tok.encode_chat([{"role": "user", "content": "What is 23+45?"}])
  llm, got = _llama_cpp_logits(path, ids)
  want = np.asarray(logits_fn(graphdef, state, jnp.asarray([ids]),
                              jnp.ones((1, len(ids)), jnp.int32)))[0]
  # 30 layers of float32 rounding in two programs, on logits up to ~40 (as test_gguf.py's
  # parity with transformers).
  assert np.abs(got - want).max() <= 2.5e-4
  for text in ("What is 23+45? Answer with just the number.", "héllo wörld 1234567890",
               "<|im_start|>user\nhi<|im_end|>"):
    assert llm.tokenize(text.encode(), add_bos=False, special=True) == tok.encode(text)
