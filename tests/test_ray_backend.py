"""The Ray backend against the local one: the same PPO steps (tests/ppo_step.py) on role
workers that live in Ray actor processes forming jax.distributed jobs, compared with the
same workers on this process's 8 simulated devices.

Ray must stay on loopback: these tests run only inside a loopback-only network namespace
(`../shared/bin/netless python -m pytest tests/test_ray*.py`) and skip elsewhere.
"""
import os
import sys

import jax
import numpy as np
import pytest

from ray_cluster import loopback_session, on_loopback_only  # noqa: E402

pytestmark = [on_loopback_only(), pytest.mark.xdist_group("ray_backend")]

import ppo_step  # noqa: E402
from hflax.controller.batch import Batch  # noqa: E402
from ppo_step import build_workers, ppo_step as run_step, prompts_batch  # noqa: E402
from hflax.sharding.placement import colocated  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROLES = ["actor", "ref", "critic", "reward"]
STEPS = 2
SPLIT = {"pools": {"policy": 4, "scoring": 4},  # as in test_controller
         "roles": {"actor": {"pool": "policy", "mesh": {"fsdp": 2, "tensor": 2},
                             "generate_tensor": 2},
                   "ref": {"pool": "policy", "mesh": {"data": 2, "fsdp": 2}},
                   "critic": {"pool": "scoring", "mesh": {"fsdp": 4}},
                   "reward": {"pool": "scoring", "mesh": {"data": 4}}}}
# Members compute like this process does (conftest sets the same precision here).
JAX_CONFIG = {"jax_default_matmul_precision": "highest"}


def build_pool(devices, spec, pool, roles):
  """Runs in a member: the roles of `pool`, built exactly as ppo_step.build_workers builds
  them (every role is placed on this pool so the builder can run; only `roles` are kept)."""
  own = {"pools": {pool: spec["pools"][pool]},
         "roles": {r: {**spec["roles"][r], "pool": pool} if r in roles else
                   {"pool": pool, "mesh": {"fsdp": spec["pools"][pool]}} for r in ROLES}}
  workers = build_workers(own, devices)
  return {r: workers[r] for r in roles}


@pytest.fixture(scope="module")
def ray_session():
  import ray.cloudpickle
  # The members import hflax from this checkout; the test helpers travel by value.
  ray.cloudpickle.register_pickle_by_value(ppo_step)
  ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
  session = loopback_session()
  yield session
  session.close()


def _run_ray(spec, processes: dict, then=None):
  """STEPS PPO steps with each pool of `spec` on processes[pool] Ray processes."""
  from hflax.controller.ray_backend.group import WorkerGroup, build_groups, start_groups
  groups = []
  try:
    for pool, size in spec["pools"].items():
      roles = tuple(r for r in ROLES if spec["roles"][r]["pool"] == pool)
      groups.append(WorkerGroup(pool, processes[pool], size // processes[pool], roles=roles,
                                env={"PYTHONPATH": ROOT}, jax_config=JAX_CONFIG))
    start_groups(groups)
    assert {g.name: len({info["pid"] for info in g.infos}) for g in groups} == processes
    handles = build_groups(groups, {g.name: (build_pool, (spec, g.name, g.roles)) for g in groups})
    out = [run_step(handles, prompts_batch(seed=i)) for i in range(STEPS)]
    params = {r: handles[r].params for r in ("actor", "critic")}
    if then is not None:
      then(handles)
    return out, params
  finally:
    for g in groups:
      g.kill()


def _run_local(spec):
  workers = build_workers(spec)
  out = [run_step(workers, prompts_batch(seed=i)) for i in range(STEPS)]
  return out, {r: workers[r].params for r in ("actor", "critic")}


def _assert_same(ray_run, local_run):
  (ray_steps, ray_params), (local_steps, local_params) = ray_run, local_run
  for (batch, metrics), (ref_batch, ref_metrics) in zip(ray_steps, local_steps):
    for key in ("responses", "values", "ref_log_prob"):  # roles' results come back as numpy
      assert isinstance(batch[key], np.ndarray), key
    np.testing.assert_array_equal(batch["responses"], np.asarray(ref_batch["responses"]))
    for key in ("old_log_probs", "ref_log_prob", "values", "token_level_scores", "advantages"):
      np.testing.assert_allclose(batch[key], np.asarray(ref_batch[key]), atol=2e-5, err_msg=key)
    assert set(metrics) == set(ref_metrics)
    for key, value in ref_metrics.items():
      # Which generation copy the engine wrote differs by design where a pool spans
      # processes (never the decoding copy there: each process would decide on its own
      # memory); the tokens above are the same.
      if not key.startswith("timing_s") and key != "reshard/decoding_layout":
        np.testing.assert_allclose(float(metrics[key]), float(value), rtol=1e-4, atol=1e-6,
                                   err_msg=key)
  for role in ("actor", "critic"):
    leaves, ref_leaves = jax.tree.leaves(ray_params[role]), jax.tree.leaves(local_params[role])
    assert len(leaves) == len(ref_leaves)
    for a, b in zip(leaves, ref_leaves):
      np.testing.assert_allclose(a, np.asarray(b), atol=2e-5)


def test_one_pool_of_two_processes_matches_local(ray_session):
  """2 processes x 4 CPU devices = one pool of 8 devices (one jax.distributed job): the
  hybrid engine's switch and every update cross the two processes. Generation runs in 2
  waves (max_num_seqs: 1 prompt's 2 samples per replica of 4), whose results each process
  gathers."""
  spec = colocated(ROLES, 8, generate_tensor=2)
  spec["roles"]["actor"]["max_num_seqs"] = 2

  def errors_come_back_as_themselves(handles):
    with pytest.raises(KeyError, match="generate_sequences needs field 'prompt_mask'"):
      handles["actor"].generate_sequences(Batch({"prompts": prompts_batch(6)["prompts"]}))
    with pytest.raises(AttributeError, match="no attribute 'generate'"):
      handles["actor"].generate(prompts_batch(8))

  _assert_same(_run_ray(spec, {"all": 2}, then=errors_come_back_as_themselves), _run_local(spec))


def test_split_placement_two_pools_match_local(ray_session):
  """Actor + reference on one pool, critic + reward model on another: one process each,
  the batches meet on the driver."""
  _assert_same(_run_ray(SPLIT, {"policy": 1, "scoring": 1}), _run_local(SPLIT))
