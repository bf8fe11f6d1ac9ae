"""Exact match of a tagged answer, for Search-R1-style question answering.

verl routes the `searchR1_*` data sources (nq, triviaqa, popqa, hotpotqa,
2wikimultihopqa, musique, bamboogle) to this rule. Its semantics, reimplemented:

- the answer is the text inside the response's last <answer>...</answer> pair (spanning
  lines allowed), stripped; no pair scores 0;
- it matches when, after SQuAD's normalisation (lower case, punctuation removed, the
  articles a/an/the removed, runs of whitespace made one space), it equals any of the
  ground truth's answers. The ground truth is {"target": [answers...]} as the Search-R1
  preprocessing writes it (a single string or a plain list is accepted too);
- a match scores 1.0, or 0.25 when the response holds more than 10 opening or 10
  closing answer tags (spamming tags is not rewarded in full); no match scores 0.
"""
from __future__ import annotations

import re
import string

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(?:a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
_TAG_LIMIT = 10


def squad_normalize(text: str) -> str:
  text = str(text).lower().translate(_PUNCTUATION)
  return " ".join(_ARTICLES.sub(" ", text).split())


def qa_targets(ground_truth) -> list[str]:
  """The accepted answers of a ground truth ({"target": ...}, a string or a list)."""
  targets = ground_truth.get("target") if isinstance(ground_truth, dict) else ground_truth
  if isinstance(targets, str):
    targets = [targets]
  try:
    targets = [str(t) for t in targets]
  except TypeError:
    targets = []
  if not targets:
    raise ValueError("a question-answering ground truth must be {'target': [answers]}, "
                     f"a string or a list of strings, got {ground_truth!r}")
  return targets


def tagged_answer(response_text: str) -> str | None:
  found = _ANSWER.findall(response_text)
  return found[-1].strip() if found else None


def qa_exact_match(response_text: str, ground_truth, extra_info: dict | None = None) -> float:
  answer = tagged_answer(response_text)
  if answer is None:
    return 0.0
  answer = squad_normalize(answer)
  if not any(answer == squad_normalize(t) for t in qa_targets(ground_truth)):
    return 0.0
  spammed = max(response_text.count("<answer>"), response_text.count("</answer>")) > _TAG_LIMIT
  return 0.25 if spammed else 1.0
