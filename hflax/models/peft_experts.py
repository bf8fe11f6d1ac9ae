"""PEFT's LoRA on transformers 5's fused expert tensors (`target_parameters`).

transformers 5 stores a mixture of experts' projections as two parameters per layer,
mlp.experts.gate_up_proj [E, 2I, D] (each expert's gate rows, then its up rows) and
mlp.experts.down_proj [E, D, I], and PEFT 0.21 adapts them with its ParamWrapper: a rank-r
LoRA there is lora_A [E r, in] (expert e's rows e r .. e r + r - 1) and lora_B [out, r E]
(expert e's columns e, E + e, ..., rank-major), expert e's delta scale B_e A_e with
scale = alpha / r: each expert its own rank-r pair, which is hflax's per-expert (A, B)
transposed. gate_up's one pair covers the gate and up rows, so A is shared by hflax's
gate and up adapters and B split between them. The other way, hflax's gate and up pairs
(their A's differ) are one rank-2r pair, A stacked and B block-diagonal, written with
PEFT's rank_pattern / alpha_pattern (2r, 2 alpha: the same scale) for gate_up_proj alone.

Two parameters of one experts module nest their wrappers: gate_up_proj's keys hold one
base_layer more than down_proj's (...mlp.experts.base_layer.lora_A.weight); a pair is
told by its shapes (gate_up: in D, out 2I; down: in I, out D, never both).

The router's weight (target_parameters gate.weight, which PEFT's all-linear adds where it
converts transformers 4's MoE names) has an ordinary pair, lora_A [r, D] and lora_B
[E, r] under mlp.gate's names: hflax's "gate" target, read as any module's.
"""
from __future__ import annotations

import json
import os

import numpy as np

from hflax.models.config import ModelConfig

# target_parameters' last component (after "experts.") -> the hflax targets it adapts.
FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def read_json(path: str) -> dict:
  file = os.path.join(path, "adapter_config.json")
  if not os.path.isfile(file):
    raise FileNotFoundError(f"no adapter_config.json in LoRA adapter directory {path!r}")
  with open(file) as f:
    return json.load(f)


def fused_targets(c: dict, file: str) -> tuple[str, ...]:
  """hflax targets of an adapter's target_parameters; anything but the fused experts'
  two tensors and the router's weight (gate.weight, where PEFT converts transformers 4's
  router name: a LoRA pair stored as an nn.Linear's, read as the "gate" target) is
  refused, naming it."""
  out = []
  for name in c.get("target_parameters") or ():
    parts = name.split(".")
    if parts[-2:] == ["gate", "weight"]:
      out.append("gate")
      continue
    if parts[-1] not in FUSED or len(parts) > 1 and parts[-2] != "experts":
      raise ValueError(f"{file}: target_parameters {name!r}: hflax reads LoRA on the fused "
                       "experts' experts.gate_up_proj and experts.down_proj and on the "
                       "router's gate.weight only")
    out += FUSED[parts[-1]]
  return tuple(out)


def gate_up_rank(c: dict, file: str) -> int:
  """gate_up_proj's rank: r, or 2r where rank_pattern / alpha_pattern name it alone with
  2r and 2 lora_alpha (hflax's own export of separate gate and up pairs); any other
  pattern is refused (hflax's adapters have one rank and one alpha)."""
  r, alpha = int(c["r"]), float(c["lora_alpha"])
  ranks, alphas = c.get("rank_pattern") or {}, c.get("alpha_pattern") or {}
  if not ranks and not alphas:
    return r
  names = set(ranks) | set(alphas)
  if (len(names) == 1 and next(iter(names)).split(".")[-1] == "gate_up_proj"
      and c.get("target_parameters") and set(ranks.values()) == {2 * r}
      and {float(a) for a in alphas.values()} == {2 * alpha}):
    return 2 * r
  raise ValueError(f"{file}: rank_pattern={ranks!r}, alpha_pattern={alphas!r} is not supported "
                   f"(hflax's adapters have one rank and alpha; only gate_up_proj at 2r={2 * r} "
                   f"with alpha {2 * alpha:g}, gate and up side by side, reads)")


def _pairs(f, stored: set, module: str) -> dict[str, dict[str, str]]:
  """lora_A / lora_B keys of `module`'s wrappers, by nesting (".", ".base_layer.", ...)."""
  pairs: dict[str, dict[str, str]] = {}
  for key in stored:
    if key.startswith(module + ".") and key.endswith(("lora_A.weight", "lora_B.weight")):
      nest = key[len(module):-len("lora_A.weight")]
      if nest.replace(".base_layer", "") == ".":
        pairs.setdefault(nest, {})[key[-len("lora_A.weight"):-len(".weight")]] = key
  return pairs


def read_fused(f, stored: set, weight: str, leaf: str, cfg: ModelConfig, c: dict,
               file: str) -> tuple[np.ndarray, set]:
  """One expert stack's A [E, in, r] or B [E, r, out] (leaf: e.g. "gate_lora_a") of the
  layer whose HF expert weight name is `weight`, and the keys it read."""
  proj, which = leaf[:-len("_lora_a")], leaf[-len("lora_a"):]
  module = "base_model.model." + weight.split(".experts.")[0] + ".experts"
  experts, rank, inner = cfg.num_experts, cfg.lora_rank, cfg.moe_intermediate_size
  fused = "gate_up" if proj in ("gate", "up") else "down"
  din, dout = (cfg.hidden_size, 2 * inner) if fused == "gate_up" else (inner, cfg.hidden_size)
  r = gate_up_rank(c, file) if fused == "gate_up" else rank
  for pair in _pairs(f, stored, module).values():
    if set(pair) == {"lora_A", "lora_B"}:
      a_shape, b_shape = (tuple(f.get_slice(pair[k]).get_shape()) for k in ("lora_A", "lora_B"))
      if (a_shape[1], b_shape[0]) == (din, dout):
        break
  else:
    raise ValueError(f"{file}: no LoRA pair for {module}.{fused}_proj (lora_A [r E, {din}], "
                     f"lora_B [{dout}, r E]) among the target_parameters' tensors")
  if a_shape != (r * experts, din) or b_shape != (dout, r * experts):
    raise ValueError(f"{file}: {pair['lora_A']} / lora_B have shapes {a_shape} / {b_shape}, "
                     f"the model needs {(r * experts, din)} / {(dout, r * experts)} "
                     f"(r={r}, {experts} experts)")
  a = f.get_tensor(pair["lora_A"]).reshape(experts, r, din).transpose(0, 2, 1)  # [E, in, r]
  b = f.get_tensor(pair["lora_B"]).reshape(dout, r, experts).transpose(2, 1, 0)  # [E, r, out]
  if fused == "down":
    return (a if which == "lora_a" else b), set(pair.values())
  rows = slice(None, inner) if proj == "gate" else slice(inner, None)
  if r == rank:  # one pair for both: A shared, B's rows split
    return (a if which == "lora_a" else b[..., rows]), set(pair.values())
  # Rank 2r: gate's pair in ranks :r, up's in r:, B block-diagonal.
  if b[:, rank:, :inner].any() or b[:, :rank, inner:].any():
    raise ValueError(f"{file}: {pair['lora_B']}: its rank-{r} pair mixes gate and up rows "
                     f"(not block-diagonal); hflax's gate and up adapters have rank {rank} each")
  ranks = slice(None, rank) if proj == "gate" else slice(rank, None)
  return (a[..., ranks] if which == "lora_a" else b[:, ranks, rows]), set(pair.values())


def check_fusable(cfg: ModelConfig) -> None:
  """ValueError, in one line, for adapters PEFT's fused format cannot hold as they are."""
  if ("gate_proj" in cfg.lora_targets) != ("up_proj" in cfg.lora_targets) and cfg.num_experts:
    raise ValueError(f"fused_experts: lora_targets {cfg.lora_targets} adapt one of gate_proj "
                     "and up_proj; transformers 5 fuses them into one gate_up_proj, which PEFT "
                     "adapts whole (it refuses one without the other too)")


def fused_tensors(weight_of: dict, stacks: dict, cfg: ModelConfig) -> tuple[dict, dict]:
  """PEFT's tensors for the expert stacks' adapters (stacks: (layer, proj) -> (A, B) in
  hflax's layout; weight_of: layer -> an HF expert weight name of that layer) and the
  adapter_config fields they need (target_parameters, rank_pattern, alpha_pattern)."""
  r, experts = cfg.lora_rank, cfg.num_experts
  tensors, fields = {}, {"target_parameters": [], "rank_pattern": {}, "alpha_pattern": {}}
  both = {"gate", "up"} <= {p for _, p in stacks}
  for layer in sorted({layer for layer, _ in stacks}):
    module = "base_model.model." + weight_of[layer].split(".experts.")[0] + ".experts"
    has = {p for (i, p) in stacks if i == layer}
    pairs = {}
    if has & {"gate", "up"}:
      gate, up = stacks.get((layer, "gate")), stacks.get((layer, "up"))
      like = gate or up
      zero_b = np.zeros_like(like[1])
      if both:  # [E, D, 2r] and block-diagonal [E, 2r, 2I]
        a = np.concatenate([gate[0], up[0]], axis=-1)
        b = np.block([[gate[1], np.zeros_like(gate[1])], [np.zeros_like(up[1]), up[1]]])
      else:
        a = like[0]
        b = np.concatenate([gate[1], zero_b] if gate else [zero_b, up[1]], axis=-1)
      pairs["gate_up_proj"] = (a, b)
    if "down" in has:
      pairs["down_proj"] = stacks[(layer, "down")]
    for name, (a, b) in pairs.items():
      # The second parameter's wrapper wraps the first's: gate_up's keys nest once more.
      nest = ".base_layer" if name == "gate_up_proj" and len(pairs) == 2 else ""
      rank, dout = a.shape[-1], b.shape[-1]
      tensors[f"{module}{nest}.lora_A.weight"] = np.ascontiguousarray(
          a.transpose(0, 2, 1).reshape(experts * rank, -1))
      tensors[f"{module}{nest}.lora_B.weight"] = np.ascontiguousarray(
          b.transpose(2, 1, 0).reshape(dout, rank * experts))
  names = {p for _, p in stacks}
  fields["target_parameters"] = sorted(
      {"mlp.experts.gate_up_proj" for p in names if p in ("gate", "up")}
      | {"mlp.experts.down_proj" for p in names if p == "down"})
  if both:
    fields["rank_pattern"] = {"experts.gate_up_proj": 2 * r}
    fields["alpha_pattern"] = {"experts.gate_up_proj": 2 * cfg.lora_alpha}
  return tensors, fields
