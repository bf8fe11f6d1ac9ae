"""trainer.mode = "async" (hflax.launch.async_mode over hflax.rollout.stream) on the tiny
GRPO config: with a staleness bound of 0 it is sync's run; with a bound of 1 or 2 no
trained token lags more than the bound, trajectories span weight updates (partial
rollouts, several versions per trajectory) and are corrected; bad configs name the field."""

import jax
import numpy as np
import pytest

from hflax import platforms
from hflax.controller.stream_host import stream_slots
from hflax.launch.config import validate
from hflax.launch.trainer import Trainer
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
