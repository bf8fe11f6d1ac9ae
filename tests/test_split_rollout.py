"""A split placement (role "rollout" on a pool of its own, verl's one-step-off layout): the
actor trains on one device and generates on another, its weights copied there after each
update. On the tiny GRPO config it runs the colocated run's numbers, sync and
one_step_off alike; bad placements fail in one line before any device work."""
import json

import jax
import numpy as np
import pytest

from hflax.launch.backends import make_backend
from hflax.launch.trainer import Trainer
from hflax.sharding.placement import build_placement, split_rollout
from tiny_config import get_config as tiny_config

TIMED = ("timing_s/", "perf/throughput", "perf/time")
# What the placements differ in by design: the split copies every byte to the rollout
# device, the colocated actor generates where it trains.
LAYOUT = ("reshard/", "rollout/weight_sync_bytes")


def config(tmp_path, run, placement, mode="sync"):
  c = tiny_config()
  c.trainer.update(total_steps=3, run_dir=str(tmp_path / run), mode=mode, keep=None)
  c.placement.update(kind="custom", **placement)
  return c


SPLIT = {"pools": {"train": 1, "rollout": 1},
         "roles": {"actor": {"pool": "train"}, "ref": {"pool": "train"},
                   "rollout": {"pool": "rollout"}}}
COLOCATED = {"pools": {"all": 1}, "roles": {"actor": {"pool": "all"}, "ref": {"pool": "all"}}}


def run(c):
  trainer = Trainer(c, log=lambda *_: None)
  versions = {}
  trainer.add_hook(lambda info: versions.update(
      {info.step: set(np.asarray(info.batch["rollout_version"]).tolist())}))
  trainer.fit()
  with open(c.trainer.run_dir + "/metrics.jsonl") as f:
    rows = [json.loads(line) for line in f]
  return trainer, versions, {r["step"]: r for r in rows}


def assert_same(a, b):
  (ta, va, ma), (tb, vb, mb) = a, b
  assert va == vb
  for x, y in zip(jax.tree.leaves(ta.roles.actor.params), jax.tree.leaves(tb.roles.actor.params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  for step in ma:
    keep = lambda m: {k: v for k, v in m.items() if not k.startswith(TIMED + LAYOUT)}
    assert keep(ma[step]) == keep(mb[step]), step


def test_split_runs_where_it_is_placed():
  devices = jax.devices()[:2]
  placed = build_placement(SPLIT, devices)
  actor = placed["actor"]
  assert actor.mesh.devices.flat[0] == devices[0]
  assert list(actor.generate_on.devices.flat) == [devices[1]]
  colocated = build_placement(COLOCATED, devices)
  assert colocated["actor"].generate_on is None
  # A rollout role on the actor's own pool is the colocated layout.
  same = {"pools": {"all": 2}, "roles": {"actor": {"pool": "all"}, "rollout": {"pool": "all"}}}
  assert build_placement(same, devices)["actor"].generate_on is None
  assert split_rollout(["actor", "ref"], 1, 1) == SPLIT | {"roles": {
      "actor": {"pool": "train", "mesh": {"fsdp": 1}, "generate_tensor": 1},
      "ref": {"pool": "train", "mesh": {"fsdp": 1}}, "rollout": {"pool": "rollout"}}}


def test_split_sync_is_colocated_sync(tmp_path):
  split = run(config(tmp_path, "split", SPLIT))
  colocated = run(config(tmp_path, "colocated", COLOCATED))
  assert_same(split, colocated)
  trainer, _, m = split
  actor = trainer.roles.actor
  # One device each (the config's pools take devices in name order: rollout, then train).
  gen_devices = set(actor.engine.mesh.devices.flat)
  train_devices = {d for x in jax.tree.leaves(actor.params) for d in x.sharding.device_set}
  assert len(gen_devices) == len(train_devices) == 1 and not gen_devices & train_devices
  weights = sum(x.nbytes for x in jax.tree.leaves(actor.params))
  for step in m:  # the whole model (float32, as it trains) copied once a step
    assert m[step]["rollout/weight_sync_bytes"] == weights
    assert m[step]["timing_s/weight_sync"] > 0
  assert "rollout/weight_sync_bytes" not in colocated[2][1]


def test_split_one_step_off_lags_one_version_as_colocated(tmp_path):
  split = run(config(tmp_path, "split", SPLIT, mode="one_step_off"))
  colocated = run(config(tmp_path, "colocated", COLOCATED, mode="one_step_off"))
  assert split[1] == {1: {0}, 2: {0}, 3: {1}}  # rollout_version = current - 1 after step 1
  for step in (2, 3):
    assert split[2][step]["rollout/staleness_1"] == 1.0
  assert_same(split, colocated)


@pytest.mark.parametrize("placement, message", [
    ({"pools": {"train": 1}, "roles": {"actor": {"pool": "train"}, "ref": {"pool": "train"},
                                       "rollout": {"pool": "rollout"}}},
     "config.placement.roles.rollout.pool: 'rollout' is not one of ['train']"),
    ({"pools": {"train": 1, "rollout": 2}, "roles": SPLIT["roles"]},
     "config.placement.pools asks for 3 devices"),
    ({"pools": {"train": 1, "rollout": 1},
      "roles": {"actor": {"pool": "train", "generate_tensor": 2}, "ref": {"pool": "train"},
                "rollout": {"pool": "rollout"}}},
     "config.placement.roles.actor.generate_tensor: 2 does not divide pool 'rollout' of 1"),
    ({"pools": {"train": 1, "rollout": 1},
      "roles": {"actor": {"pool": "train"}, "ref": {"pool": "train"},
                "rollout": {"pool": "rollout", "mesh": {"fsdp": 1}}}},
     "config.placement.roles.rollout: only 'pool' is set here"),
])
def test_bad_split_placements_fail_in_one_line(tmp_path, placement, message):
  c = config(tmp_path, "bad", placement)
  with pytest.raises(ValueError) as e:
    make_backend(c, log=lambda *_: None)
  assert str(e.value).startswith(message) and "\n" not in str(e.value)


def test_rollout_without_actor_is_refused():
  spec = {"pools": {"a": 1, "b": 1}, "roles": {"ref": {"pool": "a"}, "rollout": {"pool": "b"}}}
  with pytest.raises(ValueError, match=r"^placement.roles.rollout: the rollout is the actor's"):
    build_placement(spec, jax.devices()[:2])


def test_split_async_streams_on_the_rollout_device_within_the_bound(tmp_path):
  c = config(tmp_path, "async", SPLIT, mode="async")
  c.trainer.update(max_staleness=1, async_decode_steps=2, total_steps=4)
  trainer, versions, m = run(c)
  engine = trainer.schedule.stream.engine
  train_devices = {d for x in jax.tree.leaves(trainer.roles.actor.params)
                   for d in x.sharding.device_set}
  assert set(engine.mesh.devices.flat).isdisjoint(train_devices)
  for step, seen in versions.items():  # no trained row lags more than the bound
    assert min(seen) >= step - 2, (step, seen)
  weights = sum(x.nbytes for x in jax.tree.leaves(trainer.roles.actor.params))
  for step in m:  # each step's sync hands the engine the whole model on its own device
    assert m[step]["rollout/weight_sync_bytes"] == weights


def test_split_on_ray_gives_the_rollout_pool_processes_of_its_own(tmp_path):
  """The Ray backend's layout of the split (it runs in tests/test_ray_split.py)."""
  pytest.importorskip("ray")
  c = config(tmp_path, "ray", SPLIT)
  c.cluster.backend = "ray"
  backend, _ = make_backend(c, log=lambda *_: None)
  assert [(p.name, p.size, p.roles) for p in backend.layouts] == [
      ("rollout", 1, ("rollout",)), ("train", 1, ("actor", "ref"))]
