"""Token ids of messages appended to a conversation, as the chat template renders them,
without tokenizing the conversation again.

A trajectory's tokens are the first prompt's ids, then alternately the model's sampled
ids and the ids of the messages that follow them. Tokenizing the history again after each
turn can give the model's own text other ids than it sampled (retokenization drift), so
the trainer would score tokens the policy never produced. Here the ids after a model
turn come from the template's text for the new messages alone: the template rendered
over a fixed stand-in conversation with and without them, the difference tokenized.
"""
from __future__ import annotations

from hflax.models.tokenizer import Tokenizer

# A stand-in history ending with an assistant turn: what the template writes for appended
# messages does not depend on the earlier messages' content in the templates hflax reads.
_BASE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"},
         {"role": "assistant", "content": "A"}]


class MessageDelta:
  """ids(messages): the ids that follow a model turn (ended by its stop token) when
  `messages` are appended and the next assistant turn begins."""

  def __init__(self, tokenizer: Tokenizer, **template_vars):
    self.tokenizer, self.template_vars = tokenizer, template_vars
    base = tokenizer.apply_chat_template(_BASE, add_generation_prompt=False, **template_vars)
    # The text the template writes after the assistant's end token ("\n" in ChatML):
    # the model stops at the end token, so the delta starts with this tail.
    ends = [tokenizer.decode([i], skip_special_tokens=False) for i in tokenizer.eos_ids]
    cut = max((base.rfind(e) + len(e) for e in ends if e and base.rfind(e) >= 0), default=-1)
    if cut < 0:
      raise ValueError("chat template: the assistant turn ends with none of the tokenizer's "
                       f"end tokens {tokenizer.eos_ids}; pass the turn's stop token as eos")
    self._base, self._tail = base, base[cut:]

  def text(self, messages: list[dict]) -> str:
    full = self.tokenizer.apply_chat_template(_BASE + list(messages), add_generation_prompt=True,
                                              **self.template_vars)
    if not full.startswith(self._base):
      raise ValueError("chat template rewrites earlier turns when messages are appended (not "
                       "append-only): its turns must be trained as segments")
    return self._tail + full[len(self._base):]

  def ids(self, messages: list[dict]) -> list[int]:
    return self.tokenizer.encode(self.text(messages), add_special_tokens=False)
