"""trainer.mode = "async" with rollout.multi_turn (hflax.launch.async_mode over
hflax.rollout.stream with hflax.rollout.agents.streaming): agent trajectories streamed
with a staleness bound. With a bound of 0 it is sync's multi-turn run; with a bound of 1
trajectories span weight updates, every token keeps the version that sampled it (the
log-probs rollout correction reads are the sampler's), and none trains past the bound;
a checkpoint keeps finished trajectories whole and resubmits the unfinished ones.

The tiny GRPO job on the arithmetic tool task, its random model's every turn read as a
calculator call (a test parser), so each trajectory is two model turns with a tool message
between; a test reward scores the final turn's text, so groups differ and the weights move.
"""
import json

import jax
import numpy as np
import pytest

from hflax.checkpoint.host_state import decode, encode
from hflax.launch.async_mode import AsyncRollouts
from hflax.launch.trainer import Trainer
from hflax.models.logprobs import sequence_log_probs
from hflax.rewards import registry
from hflax.rollout.agents import tools as tools_module
from hflax.rollout.agents.loop import model_versions
from hflax.rollout.agents.tools import ToolCall
from tiny_config import fit, mode_config, run_metrics as metrics
from trainer_hooks import Killed, kill_at

TIMED = ("agent/tool_seconds/mean",)  # how long the calculator took: a time, not the run


class EveryTurnCalls:
  def parse(self, text):
    return tools_module.ParsedTurn((ToolCall("calculator", {"expression": "6*7"}),), ())


def final_turn_score(response_text, ground_truth, extra_info=None):
  """Deterministic, and different across a group: the final turn's bytes, mod 5."""
  return sum(map(ord, extra_info["agent"]["final_turn"])) % 5 / 4


@pytest.fixture(autouse=True)
def tool_task(monkeypatch):
  monkeypatch.setitem(tools_module.PARSERS, "every_turn", EveryTurnCalls)
  monkeypatch.setitem(registry._BY_DATA_SOURCE, "arithmetic_tools", final_turn_score)


def config(tmp_path, run, mode="async", **trainer):
  c = mode_config(tmp_path, run, mode, **trainer)
  c.data.builtin.update(data_source="arithmetic_tools")
  c.data.update(max_prompt_length=128, max_response_length=64)
  c.rollout.multi_turn.update(enable=True, max_assistant_turns=2, format="every_turn",
                              max_turn_tokens=16)
  # tiny_config's two mini-batches: the second trains on the rollout's log-probs, which
  # are bit-equal in sync and async (each continuation is prefilled on its own rows).
  return c


def params(trainer):
  return [np.asarray(x) for x in jax.tree.leaves(trainer.roles.actor.params)]


def test_async_multi_turn_with_staleness_0_is_sync(tmp_path):
  sync = fit(config(tmp_path, "sync", mode="sync", total_steps=2))
  trained = {}
  stream = fit(config(tmp_path, "async", max_staleness=0, total_steps=2),
               lambda info: trained.update({info.step: np.asarray(info.batch["responses"])}))
  for x, y in zip(params(sync), params(stream), strict=True):
    np.testing.assert_array_equal(x, y)
  ms, ma = metrics(tmp_path, "sync"), metrics(tmp_path, "async")
  for step in (1, 2):
    for key, value in ms[step].items():
      if key not in TIMED:
        assert ma[step][key] == value, (step, key)
    assert ms[step]["agent/turns/mean"] == 2 and ms[step]["agent/tool_calls/mean"] == 2
    assert ms[step]["critic/score/max"] > ms[step]["critic/score/min"]  # the weights move
    extra = {k: v for k, v in ma[step].items() if k not in ms[step]}
    assert extra["async/dropped_groups_total"] == 0 and extra["async/untrained_groups"] == 0
    assert extra["async/versions_per_trajectory_max"] == 1
    assert extra["async/token_staleness_mean"] == 0
  assert len(trained) == 2 and trained[1].shape == (8, 64)


def host_params(trainer):
  return jax.tree.map(np.asarray, trainer.roles.actor.params)


def test_trajectories_span_weight_updates_each_token_keeps_its_version(tmp_path):
  bound = 1
  c = config(tmp_path, "async", max_staleness=bound, total_steps=3, async_decode_steps=2)
  c.actor.optim.lr = 3e-3  # updates large enough that a lag shows in the ratios
  c.algorithm.rollout_correction.update(rollout_is="token", rollout_rs="token",
                                        rollout_rs_threshold=1.001)
  trainer = Trainer(c, log=lambda *_: None)
  weights = {0: host_params(trainer)}  # version -> the actor's weights of that version
  rows = {}  # step -> the trained rows' fields

  def record(info):
    rows[info.step] = {k: np.asarray(info.batch[k]) for k in (
        "input_ids", "attention_mask", "response_mask", "rollout_versions", "rollout_version",
        "rollout_log_probs")}
    weights[info.step] = host_params(trainer)  # the update made version `step`
  trainer.add_hook(record)
  trainer.fit()
  m = metrics(tmp_path, "async")
  spanning = 0
  for step, b in rows.items():
    current = step - 1  # the version this step's update started from
    R = b["response_mask"].shape[1]
    for r in range(len(b["rollout_version"])):
      model = b["response_mask"][r].astype(bool)
      versions = b["rollout_versions"][r][model]
      assert versions.size and (versions >= 0).all()
      assert np.all(np.diff(versions) >= 0)  # a trajectory's versions only grow
      assert versions.min() == b["rollout_version"][r] and versions.max() <= current
      assert current - versions.min() <= bound, (step, versions)  # the bound, every token
      spanning += len(set(versions.tolist())) > 1
    assert m[step]["async/versions_per_trajectory_max"] == max(
        len(set(v[k.astype(bool)].tolist())) for v, k in zip(b["rollout_versions"],
                                                             b["response_mask"]))
    assert m[step]["rollout/staleness_max"] <= bound
    # The log-probs the correction reads are the sampler's: a row's tokens of its oldest
    # version (a prefix of its model tokens, sampled over a context that version wrote)
    # are the teacher-forced log-probs of that version's weights.
    for version in set(b["rollout_version"].tolist()):
      picked = b["rollout_version"] == version
      logp, _ = sequence_log_probs(trainer.roles.actor.graphdef, weights[version],
                                   b["input_ids"][picked], b["attention_mask"][picked])
      logp = np.asarray(logp)[:, -R:]
      own = b["response_mask"][picked].astype(bool) & (b["rollout_versions"][picked] == version)
      np.testing.assert_allclose(b["rollout_log_probs"][picked][own], logp[own], atol=1e-5)
  assert spanning > 0  # some trajectory was sampled by two weight versions
  lagging = [s for s in m if m[s]["rollout/staleness_max"] >= 1]
  assert lagging and max(m[s]["async/token_staleness_mean"] for s in m) > 0
  # Stale rows' old log-probs are the current weights', so the correction sees the lag.
  assert any(m[s]["actor/rollout_corr/k3_kl"] > 1e-9 for s in lagging if s >= 3)
  for s in m:
    assert m[s]["agent/turns/mean"] == 2 and m[s]["agent/tool_calls/mean"] == 2


def same_trajectory(a, b):
  assert a.token_ids == b.token_ids and a.model_mask == b.model_mask
  assert a.versions == b.versions and a.prompt_len == b.prompt_len
  np.testing.assert_array_equal(np.asarray(a.log_probs, np.float32),
                                np.asarray(b.log_probs, np.float32))
  assert (a.turns, a.rewards, a.stop, a.metrics) == (b.turns, b.rewards, b.stop, b.metrics)
  assert len(a.segments) == len(b.segments)


def round_trip(schedule, bound):
  """schedule's state_dict -> a checkpoint's JSON -> load_state_dict into a fresh stream:
  finished trajectories come back whole, unfinished ones are started again."""
  state = decode(json.loads(json.dumps(encode(schedule.state_dict()))))
  fresh = AsyncRollouts(schedule.worker, schedule.collate, groups=4, n=2, max_staleness=bound,
                        decode_steps=16, max_prompt_len=128)
  fresh.load_state_dict(state)
  before, after = schedule.stream.groups, fresh.stream.groups
  assert before.keys() == after.keys()
  finished = unfinished = 0
  for index, group in before.items():
    for j, sample in enumerate(group.done):
      if sample is None:
        unfinished += 1
        assert after[index].done[j] is None
      else:
        finished += 1
        same_trajectory(sample, after[index].done[j])
  assert fresh.stream.samples.busy == unfinished  # resubmitted from their prompts
  assert fresh.stream.dropped == schedule.stream.dropped
  return finished, unfinished


def test_checkpoint_keeps_finished_trajectories_whole_and_resubmits_the_rest(tmp_path):
  bound = 2
  c = config(tmp_path, "run", max_staleness=bound, total_steps=3, async_decode_steps=16,
             save_every=1)
  # Every submitted trajectory in a slot, so groups finish ahead of the step training them.
  c.rollout.max_num_seqs = (bound + 1) * c.data.train_batch_size * c.rollout.n
  c.actor.optim.lr = 3e-3
  killed = Trainer(c, log=lambda *_: None)
  counts = {}
  killed.add_hook(lambda info: counts.update({info.step: round_trip(killed.schedule, bound)}))
  killed.add_hook(kill_at(2))
  with pytest.raises(Killed):
    killed.fit()
  saved_step = killed.ckpt.latest_step()
  assert saved_step in (1, 2)
  assert any(f for f, _ in counts.values()) and any(u for _, u in counts.values())

  # Resumed from the checkpoint: every trajectory it held finished is trained (or dropped
  # past the bound, and counted) with its tokens, versions and log-probs.
  saved = killed.ckpt.restore(saved_step)[1]["pending"]["stream"]
  finished = [(g["row_index"], d) for g in saved["groups"] for d in g["done"] if d is not None]
  assert finished
  trained = []

  def record(info):
    b = {k: np.asarray(info.batch[k]) for k in (
        "row_index", "responses", "attention_mask", "rollout_versions", "rollout_log_probs",
        "rollout_version")}
    R = b["responses"].shape[1]
    for r in range(len(b["row_index"])):
      real = b["attention_mask"][r, -R:].astype(bool)
      trained.append((int(b["row_index"][r]), b["responses"][r][real].tolist(),
                      b["rollout_versions"][r][real].tolist(),
                      b["rollout_log_probs"][r][real]))
      assert (info.step - 1) - b["rollout_version"][r] <= bound
  fit(c, record)
  kept = 0
  for row, d in finished:
    rest = slice(d["prompt_len"], None)
    kept += any(r == row and ids == d["token_ids"][rest] and v == d["versions"][rest]
                and np.array_equal(lp, np.asarray(d["log_probs"], np.float32)[rest])
                for r, ids, v, lp in trained)
  dropped = metrics(tmp_path, "run")[3]["async/dropped_groups_total"] - saved["dropped"]
  assert len(finished) - kept <= dropped * c.rollout.n and kept > 0


def test_async_segments_with_staleness_0_are_syncs(tmp_path, monkeypatch):
  """rewrite_history under a template that drops earlier turns' text (every trajectory
  two segments): the async rows are sync's segment rows, padded and tied the same way."""
  from hflax.models import tokenizer as tokenizer_module
  from test_agent_segments import DropsReasoning
  real = tokenizer_module.load_tokenizer
  monkeypatch.setattr(tokenizer_module, "load_tokenizer",
                      lambda spec, *a, **kw: DropsReasoning() if spec == "byte" else real(
                          spec, *a, **kw))
  runs = {}
  for mode in ("sync", "async"):
    c = config(tmp_path, mode, mode=mode, max_staleness=0, total_steps=2)
    c.rollout.multi_turn.rewrite_history = True
    runs[mode] = params(fit(c))
  for x, y in zip(runs["sync"], runs["async"], strict=True):
    np.testing.assert_array_equal(x, y)
  ms, ma = metrics(tmp_path, "sync"), metrics(tmp_path, "async")
  for step in (1, 2):
    assert ms[step]["agent/segments/mean"] > 1 and ms[step]["agent/segment_rows"] > 8
    for key, value in ms[step].items():
      if key not in TIMED:
        assert ma[step][key] == value, (step, key)


def test_a_group_past_the_bound_is_dropped_with_its_tool_steps_and_slots():
  """The stream over agent trajectories on a small engine: a group whose first turns were
  sampled by version 0 is dropped when version 1 arrives with a bound of 0, while its tool
  steps are still pending: its requests end, its kept slots are freed, and a group
  submitted after it runs to the end with version 1 alone."""
  from hflax.models import ModelConfig, create
  from hflax.models.tokenizer import ByteTokenizer
  from hflax.rollout import RolloutEngine, SamplingParams
  from hflax.rollout.agents.loop import AgentLoop
  from hflax.rollout.agents.rollout import MultiTurn
  from hflax.rollout.agents.streaming import Trajectories
  from hflax.rollout.stream import RolloutStream
  tok = ByteTokenizer()
  graphdef, state = create(ModelConfig(vocab_size=264, hidden_size=32, intermediate_size=64,
                                       num_layers=1, num_heads=4, num_kv_heads=2), seed=3)
  sampling = SamplingParams(max_new_tokens=8, temperature=1.0, eos_ids=tok.eos_ids,
                            pad_id=tok.pad_id)
  engine = RolloutEngine(graphdef, state, sampling, slots=4, steps_per_call=8,
                         max_prompt_len=768, max_turn_len=64, max_context_len=900)
  loop = AgentLoop(engine, tok, max_turns=2, lockstep=True)
  stream = RolloutStream(engine, 2, 0, Trajectories(loop, MultiTurn(format="every_turn")))
  context = {"raw_prompt": [{"role": "user", "content": "What is 12*34?"}],
             "data_source": "arithmetic_tools", "max_tokens": 900}
  stale = stream.submit(0, [1], jax.random.key(0), first_row=0, context=context)
  stream.step(1)  # each trajectory's first turn (8 tokens), its calculator step pending
  assert stream.oldest(stale) == 0 and loop.busy == 2 and not engine.busy
  assert len(engine.kept) == 2 and len(loop._pending) == 2
  assert stream.set_weights(state, version=1) == 1  # past the bound: dropped
  assert not stream.groups and loop.busy == 0 and not loop._pending and engine.kept == ()
  fresh = stream.submit(1, [1], jax.random.key(1), first_row=0, context=context)
  stream.fill(1)
  (taken,) = stream.take(1)
  assert taken is fresh and stream.dropped == 1 and engine.kept == ()
  for t in taken.done:
    assert set(model_versions(t)) == {1} and len(t.turns) == 2
    assert t.metrics["tool_calls"] == 2 and t.stop == "max_turns"
