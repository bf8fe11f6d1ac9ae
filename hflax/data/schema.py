"""Prompt rows in verl's schema, validated once on load so later stages can trust them.

A row:
  data_source   str    which reward rule judges it (see hflax.rewards); "unknown" if absent
  prompt        list of chat messages {"role": str, "content": str}, role one of ROLES; a
                plain string is accepted and becomes one user message, unless it is the
                JSON text of a list of messages (as some tools write parquet), which is
                read as that list
  ability       str    free-form tag ("math"); "" if absent
  reward_model  {"style": "rule", "ground_truth": ...}; ground_truth is required, unless
                the caller says it is optional (require_ground_truth=False: rows judged by
                a learned reward model need none; theirs is then None, and a missing
                reward_model becomes {"style": "model", "ground_truth": None})
  extra_info    dict   anything per row (split, index, ...); {} if absent
Other columns are kept as they are.

The chat messages may sit in another column, named by prompt_key (verl's data.prompt_key);
the validated row holds them under "prompt" either way.
"""
from __future__ import annotations

import json
from typing import Any, Iterable, Iterator


def _where(source: str, index: int, line: int | None) -> str:
  return f"{source}: row {index}" + (f" (line {line})" if line is not None else "")


ROLES = ("system", "user", "assistant", "tool")


def _messages_in_text(text: str):
  """Chat messages stored as JSON text (a parquet column written with json.dumps), or None
  when the text is a plain prompt."""
  stripped = text.strip()
  if not (stripped.startswith("[") and stripped.endswith("]") and '"role"' in stripped):
    return None
  try:
    value = json.loads(stripped)
  except ValueError:
    return None
  return value if isinstance(value, list) and all(isinstance(m, dict) for m in value) else None


def _normalize_prompt(prompt: Any, where: str, field: str = "prompt") -> list[dict]:
  if isinstance(prompt, str):
    if not prompt.strip():
      raise ValueError(f"{where}: field '{field}' is an empty string")
    messages = _messages_in_text(prompt)
    if messages is None:
      return [{"role": "user", "content": prompt}]
    prompt = messages  # checked below like any list of messages
  if hasattr(prompt, "tolist") and not isinstance(prompt, (list, tuple)):
    prompt = prompt.tolist()  # numpy object arrays, as pandas hands back list columns
  if not isinstance(prompt, (list, tuple)):
    raise ValueError(f"{where}: field '{field}' must be a list of chat messages or a string, "
                     f"got {type(prompt).__name__}")
  if not prompt:
    raise ValueError(f"{where}: field '{field}' is an empty list of messages")
  messages = []
  for j, message in enumerate(prompt):
    if not isinstance(message, dict):
      raise ValueError(f"{where}: field '{field}[{j}]' must be a message dict with role and "
                       f"content, got {type(message).__name__}")
    for key in ("role", "content"):
      if not isinstance(message.get(key), str):
        problem = "is missing" if message.get(key) is None else "must be a string"
        raise ValueError(f"{where}: field '{field}[{j}].{key}' {problem}")
    if message["role"] not in ROLES:
      raise ValueError(f"{where}: field '{field}[{j}].role' is {message['role']!r}, not one "
                       f"of {ROLES}")
    messages.append(dict(message))
  return messages


def normalize_row(row: Any, source: str = "<memory>", index: int = 0,
                  line: int | None = None, *, prompt_key: str = "prompt",
                  require_ground_truth: bool = True) -> dict:
  """A validated copy of `row` with defaults filled in; ValueError names source/row/field.

  prompt_key: the column holding the chat messages; require_ground_truth=False accepts
  rows without reward_model.ground_truth (see the module docstring)."""
  where = _where(source, index, line)
  if not isinstance(row, dict):
    raise ValueError(f"{where}: expected an object with the row's fields, got "
                     f"{type(row).__name__}")
  if row.get(prompt_key) is None:
    raise ValueError(f"{where}: missing field '{prompt_key}'")
  prompt = _normalize_prompt(row[prompt_key], where, prompt_key)
  reward_model = row.get("reward_model")
  if reward_model is None:
    if require_ground_truth:
      raise ValueError(f"{where}: missing field 'reward_model.ground_truth'")
    reward_model = {"style": "model", "ground_truth": None}
  if not isinstance(reward_model, dict):
    raise ValueError(f"{where}: field 'reward_model' must be an object with 'ground_truth', "
                     f"got {type(reward_model).__name__}")
  if reward_model.get("ground_truth") is None:
    if require_ground_truth:
      raise ValueError(f"{where}: missing field 'reward_model.ground_truth'")
    reward_model = {**reward_model, "ground_truth": None}
  data_source = row.get("data_source") or "unknown"
  if not isinstance(data_source, str):
    raise ValueError(f"{where}: field 'data_source' must be a string")
  extra_info = row.get("extra_info") or {}
  if not isinstance(extra_info, dict):
    raise ValueError(f"{where}: field 'extra_info' must be an object, "
                     f"got {type(extra_info).__name__}")
  return {**row, "data_source": data_source, "prompt": prompt,
          "ability": row.get("ability") or "",
          "reward_model": {**reward_model, "style": reward_model.get("style") or "rule"},
          "extra_info": dict(extra_info)}


class PromptDataset:
  """An in-memory list of validated rows; `source` (a path) appears in error messages.

  prompt_key and require_ground_truth: see normalize_row. A dataset joined from several
  files (concat) remembers each row's file and its index there: locate(i) and where(i)
  name a row the way an error message should.
  """

  def __init__(self, rows: Iterable[dict], source: str = "<memory>", *,
               prompt_key: str = "prompt", require_ground_truth: bool = True):
    self.source = source
    self.prompt_key, self.require_ground_truth = prompt_key, require_ground_truth
    self.rows = [normalize_row(row, source, i, prompt_key=prompt_key,
                               require_ground_truth=require_ground_truth)
                 for i, row in enumerate(rows)]
    self._origins = None  # (file, index in it) per row, for joined datasets

  @classmethod
  def concat(cls, datasets: Iterable["PromptDataset"]) -> "PromptDataset":
    """One dataset of the rows of `datasets`, in order (their rows are already valid)."""
    datasets = list(datasets)
    if not datasets:
      raise ValueError("no datasets to join")
    joined = cls([], " + ".join(d.source for d in datasets),
                 prompt_key=datasets[0].prompt_key,
                 require_ground_truth=all(d.require_ground_truth for d in datasets))
    joined.rows = [row for d in datasets for row in d.rows]
    joined._origins = [d.locate(i) for d in datasets for i in range(len(d))]
    return joined

  def locate(self, index: int) -> tuple[str, int]:
    """(the file row `index` came from, its index in that file)."""
    return (self.source, index) if self._origins is None else self._origins[index]

  def where(self, index: int) -> str:
    """'path: row i' for row `index`, as error messages name rows."""
    path, local = self.locate(index)
    return f"{path}: row {local}"

  def __len__(self) -> int:
    return len(self.rows)

  def __getitem__(self, index: int) -> dict:
    return self.rows[index]

  def __iter__(self) -> Iterator[dict]:
    return iter(self.rows)

  def __repr__(self) -> str:
    return f"PromptDataset({len(self)} rows from {self.source})"

  def data_sources(self) -> list[str]:
    return sorted({row["data_source"] for row in self.rows})
