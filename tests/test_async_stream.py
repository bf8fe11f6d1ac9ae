"""trainer.mode = "async" (hflax.launch.async_mode over hflax.rollout.stream) on the tiny
GRPO config: with a staleness bound of 0 it is sync's run; with a bound of 1 or 2 no
trained token lags more than the bound, trajectories span weight updates (partial
rollouts, several versions per trajectory) and are corrected; a checkpoint keeps the
tokens of samples in flight and a resumed stream continues them; bad configs name the
field."""
import copy
import json

import jax
import numpy as np
import pytest

from hflax import platforms
from hflax.controller.stream_host import stream_slots
from hflax.launch.config import validate
from hflax.checkpoint.host_state import decode, encode
from hflax.launch.trainer import Trainer
from hflax.models import ModelConfig, create
from hflax.rollout import SamplingParams
from hflax.rollout.engine import Completion, Request, RolloutEngine
from hflax.rollout.stream import RolloutStream
from tiny_config import fit, mode_config, run_metrics as metrics

# Metrics that read the rollout's recorded log-probs: the engine's and the batch sampler's
# programs differ in shape, so these agree to float32 rounding, not bit for bit.
READS_ROLLOUT_LOG_PROBS = ("actor/ppo_kl",)


def config(tmp_path, run, mode="async", **trainer):
  return mode_config(tmp_path, run, mode, **trainer)


def test_async_with_staleness_0_is_sync(tmp_path):
  sync = fit(config(tmp_path, "sync", mode="sync"))
  trained = {}
  stream = fit(config(tmp_path, "async", max_staleness=0),
               lambda info: trained.update({info.step: np.asarray(info.batch["responses"])}))
  for x, y in zip(jax.tree.leaves(sync.roles.actor.params),
                  jax.tree.leaves(stream.roles.actor.params), strict=True):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  ms, ma = metrics(tmp_path, "sync"), metrics(tmp_path, "async")
  for step in (1, 2, 3):
    for key, value in ms[step].items():
      if key == "rollout/waves":  # the batch sampler's own
        continue
      if key in READS_ROLLOUT_LOG_PROBS:
        assert abs(ma[step][key] - value) < 1e-6, (step, key)
      else:
        assert ma[step][key] == value, (step, key)
    extra = {k: v for k, v in ma[step].items() if k not in ms[step]}
    assert extra["async/dropped_groups_total"] == 0
    assert extra["async/untrained_groups"] == 0  # nothing in flight while a step trains
    assert extra["async/versions_per_trajectory_max"] == 1
    assert extra["async/token_staleness_mean"] == 0
    assert extra["rollout/weight_sync_bytes"] > 0
  assert len(trained) == 3 and trained[1].shape == (8, 8)


# bound 1 with the CPU's default decode slots (one batch: 4 prompts x 2 samples); bound 2
# with every submitted sample in a slot (3 batches), as accelerators decode by default.
@pytest.mark.parametrize("bound,slots", [(1, 0), (2, 24)])
def test_async_never_trains_past_the_bound_and_rolls_out_partially(tmp_path, bound, slots):
  c = config(tmp_path, "async", max_staleness=bound, total_steps=5, async_decode_steps=2)
  c.rollout.max_num_seqs = slots
  c.actor.optim.lr = 3e-3  # updates large enough that a lag shows in the ratios
  c.algorithm.rollout_correction.update(rollout_is="token", rollout_rs="token",
                                        rollout_rs_threshold=1.001)
  rows = {}  # step -> per trained row: the versions of its response tokens

  def record(info):
    versions = np.asarray(info.batch["rollout_versions"])
    mask = np.asarray(info.batch["response_mask"], bool)
    oldest = np.asarray(info.batch["rollout_version"])
    rows[info.step] = [v[m].tolist() for v, m in zip(versions, mask)]
    for v, o in zip(rows[info.step], oldest):
      assert v and min(v) == o and -1 not in v
  trainer = fit(c, record)
  assert trainer.roles.actor.updates == 5
  m = metrics(tmp_path, "async")
  partial = 0
  for step, trained in rows.items():
    current = step - 1  # the version of the weights this step's update starts from
    assert len(trained) == 8
    for versions in trained:
      assert current - min(versions) <= bound, (step, versions)  # the bound, every token
      assert max(versions) <= current
      assert versions == sorted(versions)  # a trajectory's versions only grow
      partial += len(set(versions)) > 1
    assert m[step]["rollout/staleness_max"] <= bound
    assert m[step]["async/engine_slots"] == (slots or 8)
    assert m[step]["async/kv_cache_bytes"] == trainer.schedule.stream.engine.cache_bytes(
        trainer.roles.actor.cfg)
    assert m[step]["async/versions_per_trajectory_max"] == max(len(set(v)) for v in trained)
  assert partial > 0  # some trajectories were sampled by two weight versions
  assert max(m[s]["rollout/staleness_max"] for s in m) >= 1  # and trained on stale rows
  # The stale rows' old log-probs are the current weights', so the correction sees the lag.
  lagging = [s for s in m if m[s]["rollout/staleness_max"] >= 1 and s >= 3]
  assert lagging and all(m[s]["actor/rollout_corr/k3_kl"] > 1e-9 for s in lagging)
  assert any(m[s]["actor/rollout_corr/rollout_rs_masked_fraction"] > 0 for s in lagging)


TINY = ModelConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=2,
                   num_heads=4, num_kv_heads=2)
PROMPTS = [[4, 9, 17], [30, 2, 2, 41, 8], [60]]


@pytest.fixture(scope="module")
def tiny_model():
  return create(TINY, seed=5)


def tiny_stream(model, temperature, version):
  """Two samples of 12 tokens a prompt (no eos), 4 slots: groups finish, decode and wait."""
  engine = RolloutEngine(*model, SamplingParams(max_new_tokens=12, temperature=temperature),
                         slots=4, max_prompt_len=8, steps_per_call=3, version=version)
  return RolloutStream(engine, n=2, max_staleness=1)


def finished_samples(stream):
  stream.fill(len(stream.groups))
  return {(g.index, j): c for g in stream.groups.values() for j, c in enumerate(g.done)}


@pytest.mark.parametrize("temperature", [1.0, 0.0])
def test_a_checkpoint_keeps_samples_in_flight_and_resume_continues_them(tiny_model,
                                                                         temperature):
  """A stream saved with samples part way (tokens of versions 0 and 1) and loaded into a
  fresh engine with the same weights: each such sample keeps its saved tokens, log-probs
  and versions, and goes on drawing token k with the key the uninterrupted stream used
  (fold_in(fold_in(key, k), row)). Its later tokens equal the uninterrupted stream's;
  their log-probs agree to float rounding only (the resumed cache is one prefill of
  prompt and tokens, the uninterrupted one a prefill then decode steps: other kernels).
  Taking the state leaves the uninterrupted stream bit for bit as it was."""
  graphdef, state = tiny_model

  def run_to_checkpoint():
    s = tiny_stream(tiny_model, temperature, version=0)
    for i, p in enumerate(PROMPTS):
      s.submit(i, p, jax.random.key(3), first_row=2 * i)
    s.step(2)
    s.set_weights(state, 1)  # same weights: later tokens carry version 1
    s.step(1)
    return s
  untouched, s = run_to_checkpoint(), run_to_checkpoint()
  saved = decode(json.loads(json.dumps(encode(s.state_dict()))))  # as a checkpoint holds it
  ages = {g.index: s.oldest(g) for g in s.groups.values()}
  straight = finished_samples(s)
  assert straight == finished_samples(untouched)  # taking the state changed nothing
  partial = {(g["index"], j): p for g in saved["groups"] for j, p in enumerate(g["partial"])
             if p is not None}
  assert len(partial) == 4 and all(g["partial"][j] is None for g in saved["groups"]
                                   for j, d in enumerate(g["done"]) if d is not None)
  assert any(0 in p["versions"] and 1 in p["versions"] for p in partial.values())

  restored = tiny_stream(tiny_model, temperature, version=1)
  restored.engine.update_weights(state, 1)
  restored.load_state_dict(saved)
  # The bound reads the saved tokens' versions before the samples are admitted again.
  assert {g.index: restored.oldest(g) for g in restored.groups.values()} == ages
  resumed = finished_samples(restored)
  assert resumed.keys() == straight.keys()
  for sample_id, p in partial.items():
    c, want, k = resumed[sample_id], straight[sample_id], len(p["token_ids"])
    assert 0 < k < 12 and len(c.token_ids) == 12
    assert c.token_ids[:k] == p["token_ids"] and c.versions[:k] == p["versions"]
    assert c.log_probs[:k] == [float(x) for x in p["log_probs"]]
    assert c.versions[k:] == [1] * (12 - k)
    assert c.token_ids == want.token_ids and c.versions == want.versions
    np.testing.assert_allclose(c.log_probs, want.log_probs, atol=1e-5)
  for sample_id in straight.keys() - partial.keys():  # finished, or not yet admitted
    assert resumed[sample_id].token_ids == straight[sample_id].token_ids


def test_a_checkpoint_without_partial_tokens_resumes_from_the_prompts(tiny_model):
  """An older checkpoint (no "partial" entries) or samples past the bound at resume."""
  graphdef, state = tiny_model
  s = tiny_stream(tiny_model, 1.0, version=0)
  for i, p in enumerate(PROMPTS):
    s.submit(i, p, jax.random.key(3), first_row=2 * i)
  s.step(2)
  saved = s.state_dict()
  old = copy.deepcopy(saved)
  for g in old["groups"]:
    del g["partial"]
  restored = tiny_stream(tiny_model, 1.0, version=1)
  restored.engine.update_weights(state, 1)
  restored.load_state_dict(old)
  samples = finished_samples(restored)
  assert all(c.versions == [1] * 12 for c in samples.values())  # all drawn afresh
  # With partial tokens, at version 2 and a bound of 1 the groups holding version-0 tokens
  # are past it: dropped at the next weight update, as in the uninterrupted stream.
  late = tiny_stream(tiny_model, 1.0, version=1)
  late.engine.update_weights(state, 1)
  late.load_state_dict(saved)
  holding_0 = sum(any(p is not None and 0 in p["versions"] for p in g["partial"])
                  for g in saved["groups"])
  assert holding_0 and late.set_weights(state, 2) == holding_0


def test_bad_partial_requests_are_refused_in_one_line(tiny_model):
  engine = tiny_stream(tiny_model, 1.0, version=0).engine
  def partial(tokens, versions=None):
    return Completion("a", [4], tokens, [0.0] * len(tokens), versions or [0] * len(tokens),
                      "partial")
  for request, message in [
      (Request([4], partial=partial([5] * 12)), "partial has 12 tokens, nothing left of "
                                                "max_new_tokens=12$"),
      (Request([4], stop_ids=(7,), partial=partial([5, 7])), "hold a stop or eos id"),
      (Request([4], partial=partial([5, 6], [0])), "partial has 2 tokens, 2 log-probs and 1 "
                                                   "versions$")]:
    with pytest.raises(ValueError, match=message):
      engine.submit(request)
  waiting = engine.submit(Request([4], partial=partial([5, 6], [0, 1])))
  assert engine.peek(waiting).versions == engine.sampled_versions(waiting) == [0, 1]
  assert engine.abort(waiting).token_ids == [5, 6]


@pytest.mark.parametrize("step_time_follows_rows", [True, False])
def test_decode_slots_by_default_asked_and_fitted(monkeypatch, step_time_follows_rows):
  monkeypatch.setattr(platforms, "step_time_follows_rows", lambda: step_time_follows_rows)
  default = 8 if step_time_follows_rows else 24  # one batch of 8 samples, or all 3 batches
  assert stream_slots(8, 2) == default
  assert stream_slots(8, 2, fits=6) == 6  # the placement's KV budget caps the default
  assert stream_slots(8, 2, asked=16) == 16  # rollout.max_num_seqs sets them
  assert stream_slots(8, 2, asked=40) == 24  # but never more than the samples submitted
  assert stream_slots(8, 2, asked=16, fits=12) == 12
  assert stream_slots(8, 0) == 8  # bound 0: one batch either way


def test_an_engine_whose_cache_cannot_fit_is_refused_in_one_line(tmp_path, monkeypatch):
  asked = []
  monkeypatch.setattr(platforms, "free_memory", lambda devices: asked.append(devices) or 4096)
  with pytest.raises(ValueError, match=r"^trainer.mode=async: the rollout engine's 8 slots x "
                     r"\d+ columns need .* GiB of KV cache, more than the 0.0 GiB free on its "
                     r"devices; lower rollout.max_num_seqs \(\d+ MiB a slot\) or the "
                     r"response length$"):
    Trainer(config(tmp_path, "async", max_staleness=1), log=lambda *_: None)
  assert [d.platform for d in asked[0]] == ["cpu"] * 2  # the generation mesh's devices


@pytest.mark.parametrize("field,value,message", [
    ("trainer.max_staleness", -1, "config.trainer.max_staleness: must be an integer >= 0"),
    ("trainer.async_decode_steps", -2, "config.trainer.async_decode_steps: must be an integer"),
    ("algorithm.name", "dapo", "config.trainer.mode: async trains one batch of groups")])
def test_bad_async_configs_name_the_field(tmp_path, field, value, message):
  c = config(tmp_path, "bad")
  section, name = field.split(".")
  c[section][name] = value
  with pytest.raises(ValueError, match=message):
    validate(c)
