"""Trained models as GGUF files, for llama.cpp and ollama.

`write_gguf` writes what llama.cpp's convert_hf_to_gguf.py writes for the same model: its
architecture's metadata keys, its tensor names (blk.N.attn_q.weight, the experts stacked in
blk.N.ffn_{gate,up,down}_exps), llama's q/k rows interleaved by the converter's `permute`
(the exact inverse of what hflax.models.gguf's reader undoes), norms, biases and the MoE
router kept in F32 as the converter keeps them, the rest in F32, F16 or BF16; RoPE scaling
as its rope.scaling.* keys (linear, YaRN) or its rope_freqs divisors (llama3). The
tokenizer's metadata is copied from the GGUF file it was read from, or built from an HF
tokenizer (byte-level BPE, llama.cpp's "gpt2") or from hflax's byte tokenizer. No
quantisation: llama.cpp's llama-quantize does that from the F32/F16 file.
"""
from __future__ import annotations

import json
import os
import re

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from hflax.models import gguf as gguf_read
from hflax.models import hf
from hflax.models.config import ModelConfig
from hflax.models.lora import base_config, merge_adapters
from hflax.models.tokenizer import BYTE_SPECIAL_TOKENS, ByteTokenizer, Tokenizer

DTYPES = ("float32", "float16", "bfloat16")
_ARCHS = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "qwen3_moe": "qwen3moe",
          "qwen2_moe": "qwen2moe"}
_GGUF_OF_HF_LAYER = {v: k for k, v in gguf_read._LAYER_NAMES.items()}
_GGUF_OF_HF_TOP = {v: k for k, v in gguf_read._TOP_NAMES.items()}
# Metadata a source GGUF's general.* keys hold that describe that file, not the model.
_OWN_GENERAL = ("general.architecture", "general.file_type", "general.quantization_version",
                "general.alignment")
# llama.cpp's token types.
_NORMAL, _CONTROL, _USER_DEFINED, _UNUSED = 1, 3, 4, 5
# The chat template ByteTokenizer.apply_chat_template renders (ChatML).
_BYTE_CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
                       "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}"
                       "<|im_start|>assistant\n{% endif %}")


def _require_gguf():
  try:
    import gguf
  except ImportError:
    raise gguf_read.MissingPackage("writing .gguf files needs the gguf package: pip install "
                                   "gguf (or the hflax extra: pip install 'hflax[gguf]')") from None
  return gguf


def check_exportable(cfg: ModelConfig, dtype: str = "float32", head: str = "lm") -> None:
  """ValueError, in one line, for a model llama.cpp's graph for its architecture would run
  differently (checked before anything is written)."""
  if dtype not in DTYPES:
    raise ValueError(f"GGUF export dtype {dtype!r} is not one of {DTYPES} (no quantisation)")
  if head != "lm":
    raise ValueError(f"GGUF export writes causal LMs; a {head!r} head has no llama.cpp graph")
  _check_rope(cfg)
  if cfg.family in ("llama", "qwen3", "qwen3_moe") and cfg.qkv_bias != cfg.o_bias:
    raise ValueError(f"{cfg.family}: qkv_bias={cfg.qkv_bias} with o_bias={cfg.o_bias} has no "
                     "GGUF form (llama.cpp's graph takes both or neither)")
  if cfg.family != "llama" and cfg.mlp_bias or cfg.family in ("qwen2", "qwen2_moe") and cfg.o_bias:
    raise ValueError(f"{cfg.family}: its llama.cpp graph has no mlp or o_proj biases")
  if cfg.family in ("qwen3_moe", "qwen2_moe"):
    if cfg.num_sparse_layers != cfg.num_layers:
      raise ValueError(f"{cfg.family}: llama.cpp runs every layer sparse; decoder_sparse_step="
                       f"{cfg.decoder_sparse_step} with mlp_only_layers={cfg.mlp_only_layers} "
                       "keeps dense layers")
    renorm = cfg.family == "qwen3_moe"  # llama.cpp's qwen3moe renormalises, qwen2moe not
    if cfg.norm_topk_prob != renorm:
      raise ValueError(f"{cfg.family}: llama.cpp runs norm_topk_prob={renorm}, the model has "
                       f"{cfg.norm_topk_prob}")
    if (cfg.family == "qwen2_moe") != bool(cfg.shared_expert_intermediate_size):
      raise ValueError(f"{cfg.family}: llama.cpp's qwen2moe always has a shared expert and "
                       "qwen3moe never; shared_expert_intermediate_size="
                       f"{cfg.shared_expert_intermediate_size}")


# YaRN's parameters a GGUF file carries (rope.scaling.*); llama.cpp always truncates the
# correction range, as HF's default truncate=True does.
_YARN_KEYS = {"rope_type", "factor", "original_max_position_embeddings", "attention_factor",
              "beta_fast", "beta_slow", "truncate"}


def _check_rope(cfg: ModelConfig) -> None:
  rope = cfg.rope_scaling_dict
  kind = rope.get("rope_type", "default")
  if kind == "llama3" and cfg.family != "llama":
    raise ValueError(f"{cfg.family}: llama3 RoPE scaling has no GGUF form for it (llama.cpp's "
                     "converter writes rope_freqs for llama alone, and only llama's graph reads "
                     "them)")
  if kind == "yarn":
    extra = sorted(set(rope) - _YARN_KEYS)
    if extra or rope.get("truncate", True) is not True or rope.get("factor") is None:
      raise ValueError(f"YaRN rope_scaling {rope}: GGUF carries factor, original context, "
                       "attention_factor and beta_fast/slow with truncate=True, not "
                       f"{extra or 'truncate=False or no factor'}")


def gguf_name(hf_name: str) -> str:
  """The GGUF tensor name of an HF one (hflax.models.gguf.hf_name's inverse)."""
  if hf_name in _GGUF_OF_HF_TOP:
    return _GGUF_OF_HF_TOP[hf_name]
  m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)", hf_name)
  if m is None or m[2] not in _GGUF_OF_HF_LAYER:
    raise ValueError(f"tensor {hf_name!r} has no GGUF name")
  return f"blk.{m[1]}.{_GGUF_OF_HF_LAYER[m[2]]}.{m[3]}"


def llama_permute(rows: np.ndarray, heads: int) -> np.ndarray:
  """llama.cpp's converter's LlamaModel.permute: each head's two rotary halves (HF's
  rotate_half layout) interleaved into pairs, along axis 0 of a q/k weight or bias."""
  return (rows.reshape(heads, 2, rows.shape[0] // heads // 2, *rows.shape[1:])
          .swapaxes(1, 2).reshape(rows.shape))


def _tensor_type(gguf, name: str, ndim: int, dtype: str):
  """The converter's rule: 1-D tensors, norms, biases and the router stay F32."""
  if (dtype == "float32" or ndim <= 1 or name.endswith("_norm.weight")
      or name.endswith(".ffn_gate_inp.weight") or not name.endswith(".weight")):
    return gguf.GGMLQuantizationType.F32
  return {"float16": gguf.GGMLQuantizationType.F16,
          "bfloat16": gguf.GGMLQuantizationType.BF16}[dtype]


def _plan(gguf, cfg: ModelConfig, state, dtype: str):
  """(GGUF name, HF-layout shape, tensor type, leaf, HF name, transposed) per tensor: the
  embedding, the layers in order, the final norm and the output."""
  names = hf.hf_name_map(cfg)
  is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
  flat = jax.tree_util.tree_flatten_with_path(state, is_leaf=is_var)[0]
  plan = []
  for kpath, var in flat:
    hf_name, transposed = names[hf._path_key(kpath)]
    name = gguf_name(hf_name)  # an expert stack (its name holds hf.EXPERT): one tensor
    shape = tuple(var.get_value().shape)
    shape = hf._swap_last(shape) if transposed else shape
    plan.append((name, shape, _tensor_type(gguf, name, len(shape), dtype), var, hf_name,
                 transposed))
  order = lambda p: ((0, 0) if p[0] == "token_embd.weight" else  # noqa: E731
                     (1, int(p[0].split(".")[1])) if p[0].startswith("blk.") else
                     (2, p[0] != "output_norm.weight"))
  return sorted(plan, key=order)


def _tensor_data(gguf, cfg: ModelConfig, entry) -> np.ndarray:
  name, shape, qtype, var, hf_name, transposed = entry
  array = np.asarray(jax.device_get(var[...]))
  array = np.swapaxes(array, -1, -2) if transposed else array
  if cfg.family == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
    array = llama_permute(array, cfg.num_heads if ".q_proj." in hf_name else cfg.num_kv_heads)
  if qtype == gguf.GGMLQuantizationType.BF16:
    return np.ascontiguousarray(array.astype(ml_dtypes.bfloat16)).view(np.uint16)
  wanted = np.float16 if qtype == gguf.GGMLQuantizationType.F16 else np.float32
  return np.ascontiguousarray(array.astype(wanted))


def _writer_class(gguf):
  """gguf.GGUFWriter, able to write an empty array (a tokenizer without merges: llama.cpp
  needs the key present, and GGUF allows zero items; the package refuses to write them)."""

  class Writer(gguf.GGUFWriter):
    def _pack_val(self, val, vtype, add_vtype, sub_type=None):
      if vtype == gguf.GGUFValueType.ARRAY and len(val) == 0 and sub_type is not None:
        head = self._pack("I", vtype) if add_vtype else b""
        return head + self._pack("I", sub_type) + self._pack("Q", 0)
      return super()._pack_val(val, vtype, add_vtype, sub_type=sub_type)

  return Writer


def write_gguf(path: str, cfg: ModelConfig, state, tokenizer: Tokenizer, *,
               dtype: str = "float32", name: str = "") -> None:
  """Writes the causal LM `state` (config `cfg`; LoRA adapters are merged first) and its
  tokenizer as one .gguf file at `path`: into a temporary sibling, then renamed, so `path`
  is the old file or the whole new one. dtype: the matrices' type (F32, F16 or BF16).
  name: general.name (default: the source GGUF's, if the tokenizer came from one)."""
  gguf = _require_gguf()
  check_exportable(cfg, dtype)
  if cfg.lora_rank:
    state, cfg = merge_adapters(cfg, state), base_config(cfg)
  plan = _plan(gguf, cfg, state, dtype)
  extra = _extra_tensors(cfg)
  partial = f"{path}.incomplete-{os.getpid()}"
  writer = _writer_class(gguf)(partial, _ARCHS[cfg.family])
  try:
    _add_model_metadata(gguf, writer, cfg, dtype)  # nothing reaches the file before the header
    _add_tokenizer(gguf, writer, tokenizer, cfg.vocab_size)
    if name:
      writer.kv_data[0].pop("general.name", None)  # the source's, replaced without a warning
      writer.add_name(name)
    for tensor_name, array in extra:  # first, as the converter writes them
      writer.add_tensor_info(tensor_name, array.shape, array.dtype, array.nbytes,
                             raw_dtype=gguf.GGMLQuantizationType.F32)
    for tensor_name, shape, qtype, *_ in plan:
      nbytes = int(np.prod(shape)) * (4 if qtype == gguf.GGMLQuantizationType.F32 else 2)
      writer.add_tensor_info(tensor_name, shape, np.dtype(np.float32), nbytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, array in extra:
      writer.write_tensor_data(array)
    for entry in plan:  # one tensor gathered to the host at a time
      writer.write_tensor_data(_tensor_data(gguf, cfg, entry))
    writer.close()
    os.replace(partial, path)
    gguf_read._open.cache_clear()  # it may hold a file this one replaced, by path
  except BaseException:
    writer.close()
    if os.path.exists(partial):
      os.remove(partial)
    raise


def _extra_tensors(cfg: ModelConfig) -> list[tuple[str, np.ndarray]]:
  """Tensors that are no weight: llama3 scaling's per-frequency divisors (rope_freqs)."""
  rope = _llama3_parameters(cfg)
  if rope.get("rope_type") != "llama3":
    return []
  return [(gguf_read.ROPE_FREQS, gguf_read.llama3_divisors(cfg.head_dim, cfg.rope_theta, rope))]


def _llama3_parameters(cfg: ModelConfig) -> dict:
  """The rope scaling with the original context hflax's rope.py falls back on, spelled out."""
  return {"original_max_position_embeddings": cfg.max_position_embeddings,
          **cfg.rope_scaling_dict}


def _add_rope_scaling(gguf, w, cfg: ModelConfig) -> None:
  """Linear and YaRN scaling as the converter's keys; llama3's parameters under hflax's own
  keys (its rope_freqs tensor is what llama.cpp runs; they let hflax read the config back)."""
  rope = cfg.rope_scaling_dict
  kind = rope.get("rope_type")
  if kind == "linear":
    w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
    w.add_rope_scaling_factor(float(rope["factor"]))
  elif kind == "yarn":
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(float(rope["factor"]))
    w.add_rope_scaling_orig_ctx_len(int(rope.get("original_max_position_embeddings",
                                                 cfg.max_position_embeddings)))
    for name, add in (("attention_factor", w.add_rope_scaling_yarn_attn_factor),
                      ("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                      ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
      if rope.get(name) is not None:
        add(float(rope[name]))
  elif kind == "llama3":
    for name, key in gguf_read.LLAMA3_KEYS.items():
      value = _llama3_parameters(cfg)[name]
      if name == "original_max_position_embeddings":
        w.add_uint32(key, int(value))
      else:
        w.add_float32(key, float(value))


def _add_model_metadata(gguf, w, cfg: ModelConfig, dtype: str) -> None:
  """The keys convert_hf_to_gguf.py writes for the architecture (TextModel's, llama's
  vocabulary size and rotary width, the experts' counts and widths)."""
  w.add_type("model")
  w.add_block_count(cfg.num_layers)
  w.add_context_length(cfg.max_position_embeddings)
  w.add_embedding_length(cfg.hidden_size)
  w.add_feed_forward_length(cfg.intermediate_size)
  w.add_head_count(cfg.num_heads)
  w.add_head_count_kv(cfg.num_kv_heads)
  w.add_rope_freq_base(cfg.rope_theta)
  w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
  # Qwen3's config.json always names head_dim; the others' only where it is not d / heads.
  if cfg.family in ("qwen3", "qwen3_moe") or cfg.head_dim != cfg.hidden_size // cfg.num_heads:
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
  if cfg.num_experts:
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
  if cfg.shared_expert_intermediate_size:
    w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
  if cfg.family == "llama":
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.head_dim)
  _add_rope_scaling(gguf, w, cfg)
  w.add_file_type({"float32": gguf.LlamaFileType.ALL_F32, "float16": gguf.LlamaFileType.MOSTLY_F16,
                   "bfloat16": gguf.LlamaFileType.MOSTLY_BF16}[dtype])
  w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def _add_tokenizer(gguf, w, tokenizer: Tokenizer, vocab_size: int) -> None:
  source = getattr(tokenizer, "source", None)
  source = gguf_read.resolve(source) if isinstance(source, str) else None
  if source is not None:
    _copy_gguf_tokenizer(gguf, w, source, vocab_size)
  elif isinstance(tokenizer, ByteTokenizer):
    _add_byte_tokenizer(gguf, w, vocab_size)
  else:
    _add_hf_tokenizer(gguf, w, tokenizer, vocab_size)


def _copy_gguf_tokenizer(gguf, w, source: str, vocab_size: int) -> None:
  """Every tokenizer.* key of the file the tokenizer was read from, with its value types,
  and its general.* keys that describe the model (name, license, ...)."""
  reader = gguf_read._open(source)
  tokens = reader.fields.get("tokenizer.ggml.tokens")
  if tokens is not None and len(tokens.data) != vocab_size:
    raise ValueError(f"{source}: its tokenizer has {len(tokens.data)} tokens, the model "
                     f"{vocab_size} embeddings; llama.cpp needs them equal")
  for key, field in reader.fields.items():
    if key in w.kv_data[0]:  # general.type: written as the converter writes it
      continue
    if key.startswith("tokenizer.") or key.startswith("general.") and key not in _OWN_GENERAL:
      kind = field.types[0]
      sub = field.types[1] if kind == gguf.GGUFValueType.ARRAY else None
      w.add_key_value(key, field.contents(), kind, sub_type=sub)


def _add_vocabulary(gguf, w, tokens: list[str], types: list[int], vocab_size: int, what: str):
  """The token list padded to the model's vocabulary as the converter pads it."""
  if len(tokens) > vocab_size:
    raise ValueError(f"{what} has {len(tokens)} tokens, more than the model's vocab_size="
                     f"{vocab_size}")
  tokens = tokens + [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
  types = types + [_UNUSED] * (vocab_size - len(types))
  w.add_tokenizer_model("gpt2")
  w.add_token_list(tokens)
  w.add_key_value(gguf.Keys.Tokenizer.TOKEN_TYPE, types, gguf.GGUFValueType.ARRAY,
                  sub_type=gguf.GGUFValueType.INT32)


def _add_byte_tokenizer(gguf, w, vocab_size: int) -> None:
  """hflax's byte tokenizer as a byte-level BPE without merges: each UTF-8 byte is its own
  token (spelled as GPT-2 spells bytes), then the five control tokens; the same ids."""
  spelling = gguf_read._bytes_to_unicode()
  tokens = [spelling[b] for b in range(256)] + list(BYTE_SPECIAL_TOKENS)
  types = [_NORMAL] * 256 + [_CONTROL] * len(BYTE_SPECIAL_TOKENS)
  _add_vocabulary(gguf, w, tokens, types, vocab_size, "the byte tokenizer")
  w.add_tokenizer_pre("gpt-2")  # no merges: how text is split first does not change the ids
  w.add_key_value(gguf.Keys.Tokenizer.MERGES, [], gguf.GGUFValueType.ARRAY,
                  sub_type=gguf.GGUFValueType.STRING)
  tok = ByteTokenizer()
  w.add_pad_token_id(tok.pad_id)
  w.add_bos_token_id(tok.bos_id)
  w.add_eos_token_id(tok.eos_ids[0])
  w.add_eot_token_id(tok.eos_ids[1])  # <|im_end|> ends a turn
  w.add_add_bos_token(False)
  w.add_chat_template(_BYTE_CHAT_TEMPLATE)


def _pre_tokenizer_name(spec: dict | None) -> str | None:
  """llama.cpp's tokenizer.ggml.pre for the pre-tokenizers hflax's reader rebuilds: GPT-2's
  byte-level regex, Llama 3's split and Qwen2's split."""
  if (spec and spec.get("type") == "ByteLevel" and spec.get("use_regex", True)
      and not spec.get("add_prefix_space", False)):
    return "gpt-2"
  parts = (spec or {}).get("pretokenizers") or []
  if (len(parts) == 2 and parts[0].get("type") == "Split"
      and parts[1].get("type") == "ByteLevel" and not parts[1].get("use_regex", True)):
    regex = (parts[0].get("pattern") or {}).get("Regex")
    return {gguf_read._LLAMA3_SPLIT: "llama-bpe", gguf_read._QWEN2_SPLIT: "qwen2"}.get(regex)
  return None


def check_tokenizer(tokenizer: Tokenizer) -> None:
  """ValueError, in one line, for a tokenizer write_gguf cannot write (before a run)."""
  source = getattr(tokenizer, "source", None)
  if not isinstance(tokenizer, ByteTokenizer) and not (
      isinstance(source, str) and gguf_read.resolve(source)):
    _hf_spec(tokenizer)


def _hf_spec(tokenizer) -> tuple[dict, str]:
  """(tokenizer.json as a dict, llama.cpp's pre-tokenizer name) of a byte-level BPE."""
  tok = getattr(tokenizer, "_tok", None)
  spec = json.loads(tok.to_str()) if tok is not None else {}
  where = getattr(tokenizer, "source", type(tokenizer).__name__)
  if ((spec.get("model") or {}).get("type") != "BPE"
      or (spec.get("decoder") or {}).get("type") != "ByteLevel"):
    raise ValueError(f"tokenizer {where!r}: only byte-level BPE tokenizers (llama.cpp's "
                     "'gpt2') export to GGUF")
  pre = _pre_tokenizer_name(spec.get("pre_tokenizer"))
  if pre is None:
    raise ValueError(f"tokenizer {where!r}: its pre-tokenizer is none that hflax can name for "
                     "llama.cpp (GPT-2's byte-level regex, Llama 3's or Qwen2's split)")
  return spec, pre


def _add_hf_tokenizer(gguf, w, tokenizer, vocab_size: int) -> None:
  """A byte-level BPE tokenizer (tokenizer.json) as convert_hf_to_gguf.py's _set_vocab_gpt2
  writes it: added tokens CONTROL where special, else USER_DEFINED; merges "a b"."""
  spec, pre = _hf_spec(tokenizer)
  model, tok, where = spec["model"], tokenizer._tok, tokenizer.source
  by_id = {i: t for t, i in tok.get_vocab(with_added_tokens=True).items()}
  added = tok.get_added_tokens_decoder()
  tokens, types = [], []
  for i in range(max(by_id) + 1):
    if i not in by_id:
      tokens.append(f"[PAD{i}]")
      types.append(_UNUSED)
    else:
      tokens.append(by_id[i])
      types.append(_NORMAL if i not in added else _CONTROL if added[i].special else _USER_DEFINED)
  _add_vocabulary(gguf, w, tokens, types, vocab_size, f"tokenizer {where!r}")
  w.add_tokenizer_pre(pre)
  merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
  w.add_key_value(gguf.Keys.Tokenizer.MERGES, merges, gguf.GGUFValueType.ARRAY,
                  sub_type=gguf.GGUFValueType.STRING)
  ids = {k: tokenizer._id(k + "_token") for k in ("bos", "eos", "unk", "pad")}
  for kind, index in ids.items():
    if index is not None:
      getattr(w, f"add_{kind}_token_id")(index)
  # Ids that end generation past the configured eos (generation_config.json's), as
  # llama.cpp's end-of-turn and end-of-message tokens.
  rest = [i for i in tokenizer.eos_ids if i != ids["eos"]]
  for kind, index in zip(("eot", "eom"), rest):
    getattr(w, f"add_{kind}_token_id")(index)
  probe = tokenizer.encode("a", add_special_tokens=True)
  w.add_add_bos_token(ids["bos"] is not None and probe[0] == ids["bos"])
  w.add_add_eos_token(bool(tokenizer.eos_ids) and probe[-1] == tokenizer.eos_ids[0])
  if tokenizer.chat_template is not None:
    w.add_chat_template(tokenizer.chat_template)
