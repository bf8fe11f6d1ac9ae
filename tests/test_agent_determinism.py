"""Sync multi-turn rollouts are reproducible bit for bit whatever the tools' latency.

A tool step's result goes back to the engine when it completes, so which continuations
are admitted at one engine step follows the tools' timing. The engine prefills each
request at its own padded width in calls of a fixed row count (hflax.rollout.slots,
SlotTable._calls), so a row's log-probs do not depend on the rows admitted with it: two
runs of one batch whose calculator sleeps a random 0-50 ms a call (seeded apart) sample
the same tokens and log-probs, and the update over them (two mini-batches, two epochs)
ends at the same weights and metrics. Before that change they differed by an ulp in most
such pairs (the engine's continuation programs rounded by their row count)."""
import random
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hflax.models import ModelConfig, create
from hflax.models.tokenizer import ByteTokenizer
from hflax.rollout import Request, RolloutEngine, SamplingParams
from hflax.rollout.agents import rollout as rollout_module
from hflax.rollout.agents import tools as tools_module
from hflax.rollout.agents.tool_config import Calculator
from hflax.rollout.agents.tools import ToolCall

TOKENIZER = ByteTokenizer()
CFG = ModelConfig(vocab_size=264, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2)
QUESTIONS = ["What is 12*34?", "a", "Tell me about cats.", "What is 17 times 3?"]
TIMED = ("seconds", "timing")  # metric names that measure time, not the run


class EveryTurnCalls:
  """Every model turn reads as one calculator call: a random model's trajectories then
  have tool messages between all their turns."""

  def parse(self, text):
    return tools_module.ParsedTurn((ToolCall("calculator", {"expression": "6*7"}),), ())


class SlowCalculator(Calculator):
  """The calculator, after a random 0..max_ms sleep drawn from `rng` (shared by a run)."""

  def __init__(self, rng: random.Random, max_ms: float):
    super().__init__()
    self.rng, self.max_ms, self.lock = rng, max_ms, threading.Lock()

  def execute(self, arguments):
    with self.lock:
      delay = self.rng.uniform(0, self.max_ms / 1e3)
    time.sleep(delay)
    return super().execute(arguments)


@pytest.fixture
def slow_tools(monkeypatch):
  """slow_tools(seed): the arithmetic tools sleep a random 0-50 ms, drawn from `seed`."""
  monkeypatch.setitem(tools_module.PARSERS, "every_turn", EveryTurnCalls)

  def seeded(seed: int, max_ms: float = 50.0):
    rng = random.Random(seed)
    monkeypatch.setitem(rollout_module.BUILTIN_TOOLS, "arithmetic_tools",
                        lambda: [SlowCalculator(rng, max_ms)])
  return seeded


def raw_prompts():
  return [[{"role": "user", "content": q}] for q in QUESTIONS]


def bits(x) -> np.ndarray:
  """float32 values as their bit patterns: equal arrays are equal bit for bit."""
  return np.asarray(x, np.float32).view(np.int32)


def test_sync_multi_turn_rollout_is_bit_identical_whatever_the_tool_latency(slow_tools):
  """Three runs of 4 prompts x 2 samples, 3 turns each, tools 0-50 ms apart per call."""
  from hflax.rollout.agents.rollout import MultiTurn, multi_turn_rollout
  model = create(CFG, seed=5)
  params = SamplingParams(max_new_tokens=60, temperature=1.0, n=2, eos_ids=TOKENIZER.eos_ids,
                          pad_id=TOKENIZER.pad_id)
  runs = []
  for seed in range(3):
    slow_tools(seed)
    fields, infos, metrics = multi_turn_rollout(
        *model, version=0, mesh=None, sampling=params,
        settings=MultiTurn(max_turns=3, turn_tokens=12, format="every_turn"),
        tokenizer=TOKENIZER, raw_prompts=raw_prompts(), data_sources=["arithmetic_tools"] * 4,
        extra_info=[{"index": i} for i in range(4)], rng=jax.random.key(0), response_width=80)
    assert metrics["agent/tool_calls/mean"] == 3  # every turn calls (the last one at max_turns)
    runs.append((fields, infos, metrics))
  first, first_infos, first_metrics = runs[0]
  for fields, infos, metrics in runs[1:]:
    assert fields.keys() == first.keys()
    for name, value in fields.items():
      value, want = np.asarray(value), np.asarray(first[name])
      if value.dtype == np.float32:
        value, want = bits(value), bits(want)
      np.testing.assert_array_equal(value, want, err_msg=name)
    assert infos == first_infos
    assert {k: v for k, v in metrics.items() if not any(t in k for t in TIMED)} == \
        {k: v for k, v in first_metrics.items() if not any(t in k for t in TIMED)}


def update_after_multi_turn_rollout(monkeypatch, slow_tools, seed: int):
  """An fp32 actor's multi-turn rollout (4 prompts x 2, tools slept from `seed`), its
  log-prob pass and one update of 2 mini-batches x 2 epochs: (the rollout's batch fields,
  the update's metrics, the final weights)."""
  from hflax.controller.actor import ActorRolloutWorker
  from hflax.controller.batch import Batch
  from hflax.controller.training import OptimConfig, UpdateConfig
  from hflax.rollout.agents.rollout import MultiTurn
  from hflax.sharding.placement import build_placement, colocated
  from ppo_step import actor_loss
  slow_tools(seed)
  placed = build_placement(colocated(["actor"], 1))
  home = jax.sharding.SingleDeviceSharding(placed["actor"].pool.devices[0])
  sampling = SamplingParams(max_new_tokens=60, temperature=1.0, n=2, eos_ids=TOKENIZER.eos_ids,
                            pad_id=TOKENIZER.pad_id)
  worker = ActorRolloutWorker(
      placed["actor"], *create(CFG.replace(param_dtype="float32"), seed=5), sampling=sampling,
      loss_fn=actor_loss, optim=OptimConfig(lr=1e-2, grad_clip=1.0),
      update=UpdateConfig(mini_batch_size=4, micro_batch_size=2, epochs=2), home=home,
      multi_turn=MultiTurn(max_turns=3, turn_tokens=12, format="every_turn"), tokenizer="byte")
  encoded = [TOKENIZER.encode(q) for q in QUESTIONS]
  width = max(map(len, encoded))
  tokens = np.asarray([[TOKENIZER.pad_id] * (width - len(e)) + e for e in encoded], np.int32)
  mask = np.asarray([[0] * (width - len(e)) + [1] * len(e) for e in encoded], bool)
  batch = Batch({"prompts": jnp.asarray(tokens), "prompt_mask": jnp.asarray(mask)},
                {"raw_prompt": raw_prompts(), "data_source": ["arithmetic_tools"] * 4,
                 "extra_info": [{"index": i} for i in range(4)]})
  batch = worker.generate_sequences(batch)
  fields = {k: np.asarray(batch[k]) for k in ("responses", "response_mask", "rollout_log_probs")}
  batch = batch.union(worker.old_log_probs(batch))
  loss_mask = np.asarray(batch["response_mask"], bool)
  # Advantages that differ per token, so that every log-prob enters the update.
  advantages = np.random.RandomState(0).randn(*loss_mask.shape).astype(np.float32) * loss_mask
  out = worker.update_actor(batch.union(Batch({"advantages": jnp.asarray(advantages)})))
  metrics = {k: float(v) for k, v in out.meta["metrics"].items()
             if not any(t in k for t in TIMED)}
  weights = [np.asarray(x) for x in jax.tree.leaves(worker.params)]
  return fields, metrics, weights


def test_the_update_after_a_multi_turn_rollout_is_bit_identical_whatever_the_tool_latency(
    monkeypatch, slow_tools):
  fields_a, metrics_a, weights_a = update_after_multi_turn_rollout(monkeypatch, slow_tools, 1)
  fields_b, metrics_b, weights_b = update_after_multi_turn_rollout(monkeypatch, slow_tools, 2)
  np.testing.assert_array_equal(fields_a["responses"], fields_b["responses"])
  np.testing.assert_array_equal(bits(fields_a["rollout_log_probs"]),
                                bits(fields_b["rollout_log_probs"]))
  assert fields_a["response_mask"].sum() > 40  # three model turns of several rows each
  assert metrics_a == metrics_b
  assert len(weights_a) == len(weights_b)
  for a, b in zip(weights_a, weights_b):
    np.testing.assert_array_equal(bits(a), bits(b))
  assert any(m != 0 for m in metrics_a.values())  # the update ran


@pytest.mark.parametrize("rows_per_prefill", [1, 4])
def test_a_requests_tokens_do_not_depend_on_the_requests_admitted_with_it(rows_per_prefill):
  """The engine alone: 8 prompts of 60-80 tokens, kept, then continued by 4-6 new tokens,
  admitted all at once, one at a time, or in uneven shuffled groups: each request's tokens
  and log-probs are the same bit for bit, its first turn's and its continuation's, with one
  row per compiled call or four. (Before, the prompts and continuations were prefilled in
  one call as wide and tall as the group, and some rows' log-probs moved by an ulp.)"""
  model = create(CFG, seed=5)
  params = SamplingParams(max_new_tokens=12, temperature=1.0, eos_ids=(),
                          pad_id=TOKENIZER.pad_id)
  text = "You are a helpful assistant with a calculator. " * 2
  prompts = [TOKENIZER.encode(text[:80 - 3 * i] + f"Q{i}?") for i in range(8)]
  additions = [list(range(40, 46 - i % 3)) for i in range(8)]

  def run(groups: list[list[int]]) -> dict:
    engine = RolloutEngine(*model, params, slots=8, steps_per_call=4, max_prompt_len=128,
                           max_turn_len=16, max_context_len=192, key=jax.random.key(3),
                           rows_per_prefill=rows_per_prefill)
    out = {}
    for group in groups:
      out.update((c.id, c) for c in engine.run(
          [Request(prompts[i], id=("a", i), keep=True, row=i) for i in group]))
    for group in groups:
      out.update((c.id, c) for c in engine.run(
          [Request(additions[i], id=("b", i), continues=("a", i), row=10 + i) for i in group]))
    return {k: (c.token_ids, bits(c.log_probs)) for k, c in out.items()}

  together = run([list(range(8))])
  assert len(together) == 16 and all(len(t) == 12 for t, _ in together.values())
  for groups in ([[i] for i in range(8)], [[7, 0, 3], [5, 1, 2, 6, 4]]):
    apart = run(groups)
    for k, (tokens, log_probs) in together.items():
      assert apart[k][0] == tokens, (groups, k)
      np.testing.assert_array_equal(apart[k][1], log_probs, err_msg=f"{groups} {k}")
