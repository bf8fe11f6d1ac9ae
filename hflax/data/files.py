"""Reading and writing prompt files: .jsonl / .json (one object per line) and .parquet.

Parquet (verl's format) is read with pyarrow. load_prompts takes one path or, as verl's
data.train_files does, a list of files and directories (a directory stands for its
.parquet, .jsonl and .json files, sorted by name, not its subdirectories); the rows are
joined in that order.
"""
from __future__ import annotations

import json
import os
from typing import Iterable

from hflax.data.schema import PromptDataset, normalize_row

JSON_SUFFIXES = (".jsonl", ".json")
PARQUET_SUFFIXES = (".parquet",)


def _pyarrow():
  import pyarrow
  import pyarrow.parquet
  return pyarrow, pyarrow.parquet


def _suffix(path: str) -> str:
  suffix = os.path.splitext(path)[1].lower()
  if suffix not in JSON_SUFFIXES + PARQUET_SUFFIXES:
    raise ValueError(f"{path}: unsupported prompt file type {suffix!r}; use one of "
                     f"{', '.join(JSON_SUFFIXES + PARQUET_SUFFIXES)}")
  return suffix


def _read_json_lines(path: str, **row_options) -> list[dict]:
  with open(path, encoding="utf-8") as f:
    text = f.read()
  if text.lstrip().startswith("["):  # a .json file holding a single array of rows
    try:
      rows = json.loads(text)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: not valid JSON ({e.msg} at line {e.lineno})") from None
    return [normalize_row(row, path, i, **row_options) for i, row in enumerate(rows)]
  rows = []
  # Split on "\n" only: str.splitlines also breaks at U+2028, which JSON strings may hold raw.
  for line_number, line in enumerate(text.split("\n"), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}: row {len(rows)} (line {line_number}): not valid JSON "
                       f"({e.msg})") from None
    rows.append(normalize_row(row, path, len(rows), line_number, **row_options))
  return rows


def prompt_files(paths) -> list[str]:
  """The files `paths` (one path, or a list of files and directories) stand for, in order."""
  entries = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
  if not entries:
    raise ValueError("no prompt files given (an empty list)")
  files = []
  for entry in entries:
    entry = os.fspath(entry)
    if os.path.isdir(entry):
      found = sorted(name for name in os.listdir(entry)
                     if os.path.splitext(name)[1].lower() in JSON_SUFFIXES + PARQUET_SUFFIXES
                     and os.path.isfile(os.path.join(entry, name)))
      if not found:
        raise ValueError(f"prompt directory {entry!r} holds no "
                         f"{', '.join(JSON_SUFFIXES + PARQUET_SUFFIXES)} files")
      files += [os.path.join(entry, name) for name in found]
      continue
    _suffix(entry)
    if not os.path.isfile(entry):
      raise FileNotFoundError(f"prompt file {entry!r} does not exist")
    files.append(entry)
  return files


def _load_file(path: str, prompt_key: str, require_ground_truth: bool) -> PromptDataset:
  options = dict(prompt_key=prompt_key, require_ground_truth=require_ground_truth)
  if _suffix(path) in PARQUET_SUFFIXES:
    _, parquet = _pyarrow()
    rows = parquet.read_table(path).to_pylist()
  else:
    rows = _read_json_lines(path, **options)
  return PromptDataset(rows, source=path, **options)


def load_prompts(paths, *, prompt_key: str = "prompt",
                 require_ground_truth: bool = True) -> PromptDataset:
  """Loads and validates prompt files in verl's schema (see hflax.data.schema).

  paths: a file, a directory, or a list of them (see the module docstring). prompt_key:
  the column holding the chat messages (verl's data.prompt_key). require_ground_truth=
  False accepts rows without reward_model.ground_truth (data for a learned reward model).
  """
  datasets = [_load_file(path, prompt_key, require_ground_truth)
              for path in prompt_files(paths)]
  return datasets[0] if len(datasets) == 1 else PromptDataset.concat(datasets)


def save_prompts(rows: Iterable[dict], path: str | os.PathLike) -> None:
  """Writes rows as .jsonl/.json (one object per line) or .parquet, chosen by the suffix."""
  path = os.fspath(path)
  suffix = _suffix(path)
  rows = list(rows)
  if suffix in PARQUET_SUFFIXES:
    pyarrow, parquet = _pyarrow()
    # Parquet cannot store a struct with no fields: an empty extra_info is written as null,
    # which loads back as {}.
    rows = [{k: (None if v == {} else v) for k, v in row.items()} for row in rows]
    # Every row gets every column (None where it has none): pyarrow takes the columns from
    # the first row alone and would drop the others.
    columns = list(dict.fromkeys(k for row in rows for k in row))
    rows = [{k: row.get(k) for k in columns} for row in rows]
    parquet.write_table(pyarrow.Table.from_pylist(rows), path)
    return
  with open(path, "w", encoding="utf-8") as f:
    for row in rows:
      f.write(json.dumps(row, ensure_ascii=False) + "\n")
