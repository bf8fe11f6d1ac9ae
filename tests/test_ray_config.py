"""The Ray backend's config and guards, checked without starting Ray (runs anywhere)."""
import pytest

from hflax.controller.ray_backend.config import pool_layouts
from hflax.controller.ray_backend.session import loopback_only_reason
from hflax.launch.config import base_config, validate
from hflax.launch.roles import needed_roles, placement_spec


def ray_config(**cluster):
  c = base_config()
  c.cluster.update(backend="ray", **cluster)
  c.trainer.devices = 8
  return c


@pytest.mark.parametrize("field,value,message", [
    ("backend", "slurm", "config.cluster.backend: 'slurm' is not one of"),
    ("processes_per_pool", -1, "config.cluster.processes_per_pool: must be an integer >= 0"),
    ("platform", "tpu", "config.cluster.platform: 'tpu' is not one of"),
    ("strategy", "SPREAD", "config.cluster.strategy: a placement-group strategy needs"),
    ("max_restarts", -1, "config.cluster.max_restarts: must be an integer >= 0"),
])
def test_cluster_fields_are_validated(field, value, message):
  c = ray_config()
  c.cluster[field] = value
  with pytest.raises(ValueError, match=message):
    validate(c)


def test_ray_needs_a_device_count_and_no_auto_placement():
  c = ray_config()
  c.trainer.devices = 0
  with pytest.raises(ValueError, match="config.trainer.devices: placement.kind='colocated'"):
    validate(c)
  c = ray_config()
  c.placement.kind = "auto"
  with pytest.raises(ValueError, match="config.placement.kind: 'auto' measures"):
    validate(c)


def test_async_on_ray_is_accepted_on_every_placement():
  """The stream runs beside the actor's generation: in the actor's own pool's processes,
  or in the rollout pool's on a split placement (each process of a pool runs it; with
  agent trajectories process 0 runs the tools for all)."""
  c = ray_config()
  c.trainer.mode = "async"
  validate(c)  # colocated: in the actor's pool
  c.placement.update(kind="custom", pools={"train": 4, "rollout": 4},
                     roles={"actor": {"pool": "train"}, "critic": {"pool": "train"},
                            "rollout": {"pool": "train"}})
  validate(c)  # the rollout role on the actor's pool: colocated too
  c.placement.roles.rollout.pool = "rollout"
  validate(c)  # the split: one process a pool
  c.cluster.devices_per_process = 2
  validate(c)  # single responses: every process of the generating pool runs the stream
  c.rollout.multi_turn.enable = True
  validate(c)  # agent trajectories
  c.placement.roles.rollout.pool = "train"
  validate(c)


def _layouts(c):
  roles = needed_roles(c)
  return pool_layouts(c.cluster, placement_spec(c, roles, 8), roles)


def test_pools_map_onto_processes():
  c = ray_config(processes_per_pool=2)  # PPO colocated on 8 devices: actor + critic
  (pool,) = _layouts(c)
  assert (pool.size, pool.processes, pool.devices_per_process) == (8, 2, 4)
  assert pool.roles == ("actor", "critic")
  c = ray_config(devices_per_process=2)
  assert _layouts(c)[0].processes == 4
  c = ray_config()
  c.placement.update(kind="custom", pools={"policy": 4, "value": 4},
                     roles={"actor": {"pool": "policy"}, "critic": {"pool": "value"}})
  assert [(p.name, p.processes, p.roles) for p in _layouts(c)] == [
      ("policy", 1, ("actor",)), ("value", 1, ("critic",))]
  with pytest.raises(ValueError, match="config.cluster.processes_per_pool: 3 does not divide "
                                       "pool 'all' of 8 devices"):
    _layouts(ray_config(processes_per_pool=3))
  with pytest.raises(ValueError, match=r"config.cluster: processes_per_pool=2 x "
                                       r"devices_per_process=2 is 4, but pool 'all' has 8"):
    _layouts(ray_config(processes_per_pool=2, devices_per_process=2))


def test_worker_reuse_is_on_by_default_and_a_bool():
  from hflax.controller.ray_backend.config import ClusterSettings
  c = ray_config()
  assert ClusterSettings.from_section(c.cluster).reuse_workers is True
  with pytest.raises(ValueError, match=r"^config.cluster.reuse_workers: must be True or False, "
                                       r"got 'no'$"):
    ClusterSettings.from_section({**c.cluster.to_dict(), "reuse_workers": "no"})


def test_a_local_cluster_starts_only_on_loopback(monkeypatch):
  monkeypatch.delenv("HFLAX_NETLESS", raising=False)
  assert "HFLAX_NETLESS is not set" in loopback_only_reason()
  pytest.importorskip("ray")
  import ray
  from hflax.controller.ray_backend.session import RaySession
  if ray.is_initialized():
    pytest.skip("a Ray session is already open in this process")
  c = ray_config(require_loopback=True)  # the tests' setting; users get Ray's defaults
  with pytest.raises(ValueError, match="config.cluster.require_loopback: not starting a local "
                                       "Ray cluster outside a loopback-only network namespace"):
    RaySession(c.cluster)
  assert not ray.is_initialized()


def test_a_generation_cap_below_one_prompts_samples_is_refused_on_the_driver(tmp_path):
  pytest.importorskip("ray")
  import ray
  from hflax.launch.trainer import Trainer
  c = ray_config()
  c.trainer.run_dir = str(tmp_path / "run")
  c.rollout.n = 2
  c.placement.update(kind="custom", pools={"all": 8},
                     roles={"actor": {"pool": "all", "max_num_seqs": 1}, "critic": {"pool": "all"}})
  with pytest.raises(ValueError, match=r"config.placement.roles.actor.max_num_seqs: 1 is less "
                                       r"than the 2 samples"):
    Trainer(c, log=lambda *_: None)
  assert not ray.is_initialized()
