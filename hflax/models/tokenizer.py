"""Tokenizers: a file-free byte tokenizer for tests, and local Hugging Face tokenizer dirs."""
from __future__ import annotations

import abc
import datetime
import json
import os
import re
from typing import Any, Sequence

import jinja2
import numpy as np
import tokenizers
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment

BYTE_SPECIAL_TOKENS = ("<pad>", "<bos>", "<eos>", "<|im_start|>", "<|im_end|>")
BYTE_VOCAB_SIZE = 256 + len(BYTE_SPECIAL_TOKENS)
# The named special tokens transformers passes to chat templates.
NAMED_SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                        "cls_token", "mask_token")


class Tokenizer(abc.ABC):
  """What the rest of hflax needs from a tokenizer."""
  vocab_size: int
  pad_id: int
  bos_id: int | None
  eos_ids: tuple[int, ...]  # every id that ends generation

  @abc.abstractmethod
  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    ...

  @abc.abstractmethod
  def decode(self, ids: Sequence[int] | np.ndarray, skip_special_tokens: bool = True) -> str:
    ...

  @abc.abstractmethod
  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                          **template_vars) -> str:
    """template_vars: the template's own switches (e.g. Qwen3's enable_thinking=False)."""

  def encode_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                  **template_vars) -> list[int]:
    # Templates write their own bos/control tokens, so encoding must not add them a second time.
    return self.encode(self.apply_chat_template(messages, add_generation_prompt,
                                                **template_vars), add_special_tokens=False)

  def decode_rows(self, ids_BxT, mask_BxT, skip_special_tokens: bool = True) -> list[str]:
    """The text of each row's masked-in tokens (a batch of prompts or responses)."""
    ids, mask = np.asarray(ids_BxT), np.asarray(mask_BxT, bool)
    if ids.ndim != 2 or ids.shape != mask.shape:
      raise ValueError(f"ids {ids.shape} and mask {mask.shape} must be the same [B, T] shape")
    return [self.decode(row[keep], skip_special_tokens) for row, keep in zip(ids, mask)]

  def _valid_ids(self, ids) -> list[int]:
    # Models often pad their vocab beyond the tokenizer's; sampled ids there have no text.
    flat = np.asarray(ids, dtype=np.int64).reshape(-1)
    return [int(i) for i in flat if 0 <= i < self.vocab_size]


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes 0..255, then <pad> <bos> <eos> <|im_start|> <|im_end|>; chat is ChatML."""
  vocab_size = BYTE_VOCAB_SIZE
  pad_id, bos_id = 256, 257
  eos_ids = (258, 260)
  _special_re = re.compile("(" + "|".join(map(re.escape, BYTE_SPECIAL_TOKENS)) + ")")

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    ids = [self.bos_id] if add_special_tokens else []
    # re.split with a capture group alternates plain text (even) and special tokens (odd).
    for i, piece in enumerate(self._special_re.split(text)):
      if i % 2:
        ids.append(256 + BYTE_SPECIAL_TOKENS.index(piece))
      else:
        ids.extend(piece.encode("utf-8"))
    return ids

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    out, run = [], bytearray()
    for i in self._valid_ids(ids):
      if i < 256:
        run.append(i)
        continue
      # Decode byte runs whole so multi-byte characters are not split at special tokens.
      out.append(run.decode("utf-8", errors="replace"))
      run = bytearray()
      if not skip_special_tokens:
        out.append(BYTE_SPECIAL_TOKENS[i - 256])
    out.append(run.decode("utf-8", errors="replace"))
    return "".join(out)

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                          **template_vars) -> str:
    del template_vars  # fixed ChatML: it has no switches
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class _GenerationTag(Extension):
  # Some templates mark assistant turns with {% generation %} for HF's assistant masks;
  # we only need them to parse, so the body renders unchanged.
  tags = {"generation"}

  def parse(self, parser):
    lineno = next(parser.stream).lineno
    body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
    return nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

  def _render(self, caller):
    return caller()


def _raise_exception(message):
  raise jinja2.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
  # Jinja's own tojson HTML-escapes; templates expect plain json.dumps output.
  return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                    sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
  """Compiles a chat template in the environment transformers renders them in."""
  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[_GenerationTag, "jinja2.ext.loopcontrols"])
  env.filters["tojson"] = _tojson
  env.globals["raise_exception"] = _raise_exception
  env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
  return env.from_string(source)


def _read_json(directory: str, name: str) -> dict:
  path = os.path.join(directory, name)
  if not os.path.isfile(path):
    return {}
  with open(path, encoding="utf-8") as f:
    return json.load(f)


def _token_text(value: Any) -> str | None:
  # Configs store special tokens either as strings or as serialized AddedToken dicts.
  if isinstance(value, dict):
    value = value.get("content")
  return value if isinstance(value, str) else None


class HFTokenizer(Tokenizer):
  """A local Hugging Face tokenizer directory (tokenizer.json + tokenizer_config.json ...)."""

  def __init__(self, directory: str | os.PathLike):
    self.directory = self.source = directory = os.fspath(directory)
    path = os.path.join(directory, "tokenizer.json")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"no tokenizer.json in tokenizer directory {directory!r}")
    config = _read_json(directory, "tokenizer_config.json")
    if "added_tokens_decoder" not in config:
      # Older checkpoints keep special tokens in special_tokens_map.json, which then wins.
      config.update(_read_json(directory, "special_tokens_map.json"))
    generation_eos = _read_json(directory, "generation_config.json").get("eos_token_id")
    generation_eos = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    self._setup(tokenizers.Tokenizer.from_file(path), config, generation_eos,
                self._find_chat_template(config))

  @classmethod
  def from_gguf(cls, path: str) -> "HFTokenizer":
    """The tokenizer and chat template a .gguf file's metadata describes."""
    from hflax.models import gguf
    tok, config, stop_ids = gguf.tokenizer_parts(path)
    self = cls.__new__(cls)
    self.directory, self.source = None, path
    self._setup(tok, config, stop_ids, config.get("chat_template"))
    return self

  def _setup(self, tok, config: dict, generation_eos: list, chat_template: str | None):
    self._tok = tok
    self._config = config
    extra = config.get("extra_special_tokens")
    names = NAMED_SPECIAL_TOKENS + (tuple(extra) if isinstance(extra, dict) else ())
    merged = {**config, **(extra if isinstance(extra, dict) else {})}
    self.special_tokens = {k: t for k in names if (t := _token_text(merged.get(k))) is not None}
    # transformers registers configured special tokens that tokenizer.json does not list as added
    # tokens, so they must be too for ids (and text splitting) to match.
    added = {t.content for t in self._tok.get_added_tokens_decoder().values()}
    missing = [t for t in self.special_tokens.values() if t not in added]
    self._tok.add_special_tokens([tokenizers.AddedToken(t, special=True, normalized=False)
                                  for t in dict.fromkeys(missing)])
    self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
    self.bos_id = self._id("bos_token")
    eos = [self._id("eos_token"), *generation_eos]
    self.eos_ids = tuple(dict.fromkeys(i for i in eos if i is not None))
    pad = self._id("pad_token")
    # Padding is always masked out, so any valid id serves when the model defines none.
    self.pad_id = pad if pad is not None else (self.eos_ids[0] if self.eos_ids else 0)
    # add_*_token only matters without a post-processor: when tokenizer.json has one, it decides
    # (transformers 5 even ignores the config flags whenever tokenizer.json exists).
    self._add_bos = bool(config.get("add_bos_token")) and self._tok.post_processor is None
    self._add_eos = bool(config.get("add_eos_token")) and self._tok.post_processor is None
    self.chat_template = chat_template
    self._template = None

  def save(self, directory: str) -> None:
    """Writes tokenizer.json, tokenizer_config.json and the chat template (for a tokenizer
    that has no directory to copy, e.g. one read from a GGUF file)."""
    self._tok.save(os.path.join(directory, "tokenizer.json"))
    config = {k: v for k, v in self._config.items() if k != "chat_template"}
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
      json.dump(config, f, indent=2)
    with open(os.path.join(directory, "generation_config.json"), "w", encoding="utf-8") as f:
      json.dump({"eos_token_id": list(self.eos_ids)}, f, indent=2)
    if self.chat_template is not None:
      with open(os.path.join(directory, "chat_template.jinja"), "w", encoding="utf-8") as f:
        f.write(self.chat_template)

  def _id(self, name: str) -> int | None:
    token = self.special_tokens.get(name)
    return None if token is None else self._tok.token_to_id(token)

  def _find_chat_template(self, config: dict) -> str | None:
    # Standalone files take priority over the tokenizer_config.json entry, as in transformers.
    jinja_path = os.path.join(self.directory, "chat_template.jinja")
    if os.path.isfile(jinja_path):
      with open(jinja_path, encoding="utf-8") as f:
        return f.read()
    template = _read_json(self.directory, "chat_template.json").get("chat_template")
    template = template or config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
      template = {t["name"]: t["template"] for t in template}.get("default")
    return template

  def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
    ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
    if add_special_tokens:
      if self._add_bos and self.bos_id is not None:
        ids = [self.bos_id] + ids
      if self._add_eos and self.eos_ids:
        ids = ids + [self.eos_ids[0]]
    return ids

  def decode(self, ids, skip_special_tokens: bool = True) -> str:
    return self._tok.decode(self._valid_ids(ids), skip_special_tokens=skip_special_tokens)

  def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                          **template_vars) -> str:
    if self.chat_template is None:
      raise ValueError(f"tokenizer {self.source!r} has no chat template (looked for "
                       "chat_template.jinja, chat_template.json and tokenizer_config.json)")
    if self._template is None:
      self._template = compile_chat_template(self.chat_template)
    # Like transformers, drop None fields: templates test for key presence (e.g. tool_calls).
    messages = [{k: v for k, v in m.items() if v is not None} for m in messages]
    variables = {"tools": None, "documents": None, **self.special_tokens, **template_vars}
    return self._template.render(variables, messages=messages,
                                 add_generation_prompt=add_generation_prompt)


# Files of a Hugging Face tokenizer directory that save_tokenizer carries over.
HF_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                      "generation_config.json", "chat_template.jinja", "chat_template.json")
BYTE_MARKER = "hflax_tokenizer.json"  # {"kind": "byte"}: a checkpoint trained with bytes


def save_tokenizer(tokenizer: Tokenizer, directory: str) -> None:
  """Puts the tokenizer beside a checkpoint, so that the directory alone loads again."""
  if isinstance(tokenizer, ByteTokenizer):
    with open(os.path.join(directory, BYTE_MARKER), "w") as f:
      json.dump({"kind": "byte"}, f)
    return
  if tokenizer.directory is None:
    tokenizer.save(directory)
    return
  import shutil
  for name in HF_TOKENIZER_FILES:
    source = os.path.join(tokenizer.directory, name)
    if os.path.isfile(source):
      shutil.copyfile(source, os.path.join(directory, name))


def load_tokenizer(spec: str) -> Tokenizer:
  """"byte" -> ByteTokenizer; a Hugging Face tokenizer directory -> HFTokenizer (or the
  byte tokenizer, where save_tokenizer marked the directory so); a .gguf file or a shipped
  model's name -> the tokenizer in its metadata."""
  if spec == "byte":
    return ByteTokenizer()
  from hflax.models import gguf
  gguf_file = gguf.resolve(spec)
  if gguf_file is not None:
    return HFTokenizer.from_gguf(gguf_file)
  path = os.path.expanduser(spec)
  if not os.path.isdir(path):
    raise FileNotFoundError(f"tokenizer {spec!r} is neither 'byte', a .gguf file nor an existing "
                            "directory")
  if _read_json(path, BYTE_MARKER).get("kind") == "byte":
    return ByteTokenizer()
  return HFTokenizer(path)
