"""Numbers in the config tree: every float finite, and each numeric field in its range.

`check_numbers(cfg, fail)` runs first in `hflax.launch.config.validate`, before any device
work. Two parts:

- a walk over the whole tree: every float (also inside lists, tuples and dicts, e.g.
  placement pools) must be finite. NaN, inf and a literal too large for a float (`1e400`,
  which Python and the CLI read as inf) are refused naming the field: none of them is a
  setting, and each would train into NaN weights and still exit 0.
- RANGES, a table of field path -> Range for the fields whose valid values validate does
  not check otherwise (the fields it does check, such as gamma, lam, top_p, temperatures,
  clip ratios and batch sizes, are left to it). A path the tree lacks is skipped, so the
  table also serves trees without a section (no `cluster`) and fields added later.

Messages are one line: `config.actor.optim.lr: must be a finite number > 0, got nan`.
"""
from __future__ import annotations

import dataclasses
import math
import numbers

_MISSING = object()


@dataclasses.dataclass(frozen=True)
class Range:
  """low/high: bounds (None: unbounded); low_open/high_open: whether the bound itself is
  excluded. integer: the value must be an int. each: the field is a list (or a single
  value) whose every element is checked. note: appended to the message, e.g. what 0 means."""
  low: float | None = None
  high: float | None = None
  low_open: bool = False
  high_open: bool = False
  integer: bool = False
  each: bool = False
  note: str = ""

  def holds(self, value) -> bool:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
      return False
    if self.integer and not isinstance(value, numbers.Integral):
      return False
    if not isinstance(value, numbers.Integral) and not math.isfinite(value):
      return False
    if self.low is not None and (value <= self.low if self.low_open else value < self.low):
      return False
    return self.high is None or (value < self.high if self.high_open else value <= self.high)

  def describe(self) -> str:
    kind = "an integer" if self.integer else "a finite number"
    if self.low is not None and self.high is not None:
      where = (f"in {'(' if self.low_open else '['}{_num(self.low)}, {_num(self.high)}"
               f"{')' if self.high_open else ']'}")
    elif self.low is not None:
      where = f"{'>' if self.low_open else '>='} {_num(self.low)}"
    elif self.high is not None:
      where = f"{'<' if self.high_open else '<='} {_num(self.high)}"
    else:
      where = ""
    text = f"{kind} {where}".strip()
    return f"{text} {self.note}" if self.note else text


def _num(x) -> str:
  if isinstance(x, int) and x >= 2**32 and x & (x - 1) == 0:
    return f"2**{x.bit_length() - 1}"
  return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


def positive(note: str = "") -> Range:
  return Range(low=0, low_open=True, note=note)


def non_negative(note: str = "", integer: bool = False, each: bool = False) -> Range:
  return Range(low=0, integer=integer, each=each, note=note)


def at_least_one(note: str = "", each: bool = False) -> Range:
  return Range(low=1, integer=True, each=each, note=note)


_SEED = Range(low=0, high=2**63, high_open=True, integer=True)
_MOMENT = Range(low=0, high=1, high_open=True, note="(Adam's decay rate; 1 never forgets)")

RANGES: dict[str, Range] = {
    "data.seed": _SEED,
    "trainer.seed": _SEED,
    "data.builtin.digits": at_least_one("(operand digit count, or a (min, max) range)",
                                        each=True),
    "model.builtin.hidden_size": at_least_one(),
    "model.builtin.intermediate_size": at_least_one(),
    "model.builtin.num_layers": at_least_one(),
    "model.builtin.num_heads": at_least_one(),
    "model.builtin.num_kv_heads": at_least_one(),
    "model.builtin.rope_theta": positive(),
    "model.moe_capacity_factor": non_negative("(0: every pick sent, none dropped)"),
    "algorithm.kl_ctrl.kl_coef": non_negative(),
    "algorithm.kl_ctrl.target_kl": positive("(the adaptive controller divides by it)"),
    "algorithm.kl_ctrl.horizon": positive("(samples over which adaptive KL adjusts)"),
    "algorithm.max_num_gen_batches": at_least_one("(DAPO's generation rounds per step)"),
    "algorithm.overlong_buffer_len": non_negative("(0: no overlong shaping)", integer=True),
    "algorithm.overlong_penalty_factor": non_negative(),
    "algorithm.lambda_lr": non_negative("(safe_rlhf's Lagrange multiplier step size)"),
    "actor.entropy_coeff": non_negative(),
    "actor.kl_loss_coef": non_negative(),
    "actor.moe_aux_loss_coef": non_negative(),
    "actor.tau_pos": positive(),  # SAPO's gate temperatures: the gate divides by them
    "actor.tau_neg": positive(),
    "trainer.sft_warmup.lr": positive(),
    "trainer.profile_steps": non_negative("(steps to trace)", integer=True, each=True),
    "distill.coef": non_negative("(weight of the reverse-KL advantage)"),
    "distill.task_reward_coef": non_negative("(weight of the task advantage; 0: distil alone)"),
}
for _role in ("actor", "critic"):
  RANGES.update({
      f"{_role}.optim.lr": positive(),
      f"{_role}.optim.weight_decay": non_negative(),
      f"{_role}.optim.b1": _MOMENT,
      f"{_role}.optim.b2": _MOMENT,
      f"{_role}.optim.grad_clip": non_negative("(0: no clipping)"),
      f"{_role}.optim.warmup_steps": non_negative(integer=True),
      f"{_role}.optim.total_steps": non_negative("(the schedule's length)", integer=True),
      f"{_role}.optim.min_lr_ratio": Range(low=0, high=1),
      f"{_role}.ppo_max_token_len_per_gpu": at_least_one("(tokens per device per micro-batch)"),
  })
RANGES["actor.log_prob_max_token_len_per_gpu"] = at_least_one(
    "(tokens per device of a log-prob pass)")


def _lookup(cfg, path: str):
  node = cfg
  for key in path.split("."):
    try:
      node = node[key]
    except (KeyError, IndexError, TypeError, AttributeError):
      return _MISSING
  return node


def _items(node):
  """(key, child) of a ConfigDict, dict, list or tuple; nothing for a leaf."""
  if hasattr(node, "items") and callable(node.items):
    return [(str(k), v) for k, v in node.items()]
  if isinstance(node, (list, tuple)):
    return [(f"[{i}]", v) for i, v in enumerate(node)]
  return []


def _non_finite(node, path: str):
  """(path, value) of the first float in the tree that is not finite, or None."""
  if isinstance(node, numbers.Real) and not isinstance(node, (bool, numbers.Integral)):
    return None if math.isfinite(node) else (path, node)
  for key, child in _items(node):
    found = _non_finite(child, f"{path}{key}" if key.startswith("[") or not path
                        else f"{path}.{key}")
    if found:
      return found
  return None


def check_numbers(cfg, fail) -> None:
  """Calls fail(field, why) for the first non-finite float anywhere in `cfg`, then for the
  first field of RANGES (that `cfg` has) outside its range."""
  found = _non_finite(cfg, "")
  if found:
    field, value = found
    rule = RANGES.get(field)
    fail(field, f"must be {rule.describe() if rule else 'a finite number'}, got {value!r}")
  for field, rule in RANGES.items():
    value = _lookup(cfg, field)
    if value is _MISSING or value is None:
      continue
    values = list(value) if rule.each and isinstance(value, (list, tuple)) else [value]
    for v in values:
      if not rule.holds(v):
        shown = f"{v!r} in {tuple(value)!r}" if v is not value else repr(v)
        fail(field, f"must be {rule.describe()}, got {shown}")
