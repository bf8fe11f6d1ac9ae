"""The split placement on the Ray backend (placement role "rollout" on a pool of its own):
the actor trains in the train pool's process and generates in the rollout pool's, its
weights sent through Ray's object store before each generation. On the tiny GRPO job it
runs the local backend's split, sync and one_step_off alike: the same tokens, the same
metrics and final weights to float32 rounding (the pools are other processes, whose
programs XLA compiles on its own), and the weight sync's bytes are the actor's weights
(its adapters with LoRA). trainer.mode = "async" streams in the rollout pool's process
(its engine decoding there while the train pool updates) and runs the local split's async
run; resumed from a checkpoint it trains the trajectories the checkpoint held finished.
Where the actor generates on its own pool (colocated), async streams beside it in that
pool's processes, its weight sync in-process, and runs the local colocated async run.
The Trainers join the module's Ray session, so each takes the parked processes a previous
one left of its layout (cluster.reuse_workers): the one_step_off test checks the pids, and
a killed parked process replaced.

Runs only inside a loopback-only network namespace (../shared/bin/netless), else skips.
"""
import json
import os
import shutil
import signal

import jax
import numpy as np
import pytest

from ray_cluster import loopback_session, on_loopback_only  # noqa: E402

pytestmark = [on_loopback_only(), pytest.mark.xdist_group("ray_split")]

from hflax.checkpoint import Checkpointer  # noqa: E402
from hflax.launch.backends import make_backend  # noqa: E402
from hflax.launch.trainer import Trainer  # noqa: E402
from hflax.models.lora import split_adapters  # noqa: E402
from ray_tool_task import register, site_dir  # noqa: E402
from tiny_config import get_config as tiny_config  # noqa: E402

SPLIT = {"pools": {"train": 1, "rollout": 1},
         "roles": {"actor": {"pool": "train"}, "rollout": {"pool": "rollout"}}}
TIMED = ("timing_s/", "perf/throughput", "perf/time")
# The local split reshards onto the rollout device; Ray's replica receives the weights in
# its own process and reshards them there (nothing crosses devices in that reshard).
LAYOUT = ("reshard/",)


@pytest.fixture(scope="module")
def ray_session():
  """One Ray cluster for the file (the trainers join it, and leave it running)."""
  session = loopback_session()
  yield session
  session.close()


# The built-in task's rule gives an untrained model 0 for every sample (no advantage, no
# update); this reward varies between samples, so every step changes the weights.
REWARD = ("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
          "  return sum(ord(ch) % 2 for ch in solution_str) / max(len(solution_str), 1)\n")


def config(tmp_path, run, backend, mode="sync", steps=3, lora=0):
  c = tiny_config()
  c.actor.use_kl_loss = False  # the actor alone: fewer programs to compile per process
  (tmp_path / "reward.py").write_text(REWARD)
  c.reward.custom_fn.path = str(tmp_path / "reward.py")
  c.actor.optim.lr = 1e-2  # large enough that a step's update changes the next tokens
  c.model.lora_rank = lora
  c.trainer.update(total_steps=steps, run_dir=str(tmp_path / run), mode=mode, keep=None)
  c.placement.update(kind="custom", **SPLIT)
  c.cluster.update(backend=backend, require_loopback=True, log_to_driver=False)
  return c


def two_processes_a_pool(c):
  """c with each pool 2 devices in 2 processes (a jax.distributed job)."""
  c.placement.pools = {"train": 2, "rollout": 2}
  c.trainer.devices, c.cluster.processes_per_pool = 4, 2
  return c


def run(c, pools=None):
  """(final actor weights, {step: (responses, rollout versions)}, {step: metrics}); on Ray
  `pools` gets {pool: (its roles, its process ids)}."""
  trainer = Trainer(c, log=lambda *_: None)
  for g in getattr(trainer.backend, "groups", []) if pools is not None else []:
    pools[g.name] = (g.roles, {info["pid"] for info in g.infos})
  seen = {}
  trainer.add_hook(lambda info: seen.update({info.step: (
      np.asarray(info.batch["responses"]),
      set(np.asarray(info.batch["rollout_version"]).tolist()))}))
  try:
    trainer.fit()
    params = jax.tree.map(np.asarray, trainer.roles.actor.params)
  finally:
    trainer.close()
  with open(os.path.join(c.trainer.run_dir, "metrics.jsonl")) as f:
    rows = [json.loads(line) for line in f]
  return params, seen, {r["step"]: r for r in rows}


def assert_same(ray_run, local_run):
  (params, seen, metrics), (ref_params, ref_seen, ref_metrics) = ray_run, local_run
  assert seen.keys() == ref_seen.keys() == metrics.keys() == ref_metrics.keys()
  for step in seen:
    np.testing.assert_array_equal(seen[step][0], ref_seen[step][0], err_msg=f"step {step}")
    assert seen[step][1] == ref_seen[step][1], step
    keep = lambda m: {k: v for k, v in m.items() if not k.startswith(TIMED + LAYOUT)}
    got, want = keep(metrics[step]), keep(ref_metrics[step])
    assert got.keys() == want.keys(), step
    for key, value in want.items():
      np.testing.assert_allclose(got[key], value, rtol=1e-4, atol=1e-6, err_msg=f"{step} {key}")
  leaves, ref_leaves = jax.tree.leaves(params), jax.tree.leaves(ref_params)
  assert len(leaves) == len(ref_leaves)
  for a, b in zip(leaves, ref_leaves):
    np.testing.assert_allclose(a, b, atol=2e-5)


def last_step(result):
  """A run's final weights with its last step's tokens, versions and metrics."""
  params, seen, metrics = result
  last = max(seen)
  return params, {last: seen[last]}, {last: metrics[last]}


def without_sync_bytes(*runs):
  return [(params, seen, {step: {k: v for k, v in m.items() if k != "rollout/weight_sync_bytes"}
                          for step, m in metrics.items()}) for params, seen, metrics in runs]


def assert_synced(metrics, sent_bytes):
  for step, m in metrics.items():
    assert m["rollout/weight_sync_bytes"] == sent_bytes, step
    assert m["timing_s/weight_sync"] > 0, step


def test_split_sync_on_ray_is_the_local_split(tmp_path, ray_session):
  pools = {}
  ray_run = run(config(tmp_path, "ray", "ray", steps=2), pools)
  local_run = run(config(tmp_path, "local", "local", steps=2))
  # The actor trains in one process and generates in another.
  assert {pool: roles for pool, (roles, _) in pools.items()} == {
      "train": ("actor",), "rollout": ("rollout",)}
  assert pools["train"][1].isdisjoint(pools["rollout"][1])
  assert_same(ray_run, local_run)
  params, seen, metrics = ray_run
  assert {s: v for s, (_, v) in seen.items()} == {1: {0}, 2: {1}}
  assert_synced(metrics, sum(x.nbytes for x in jax.tree.leaves(params)))  # float32, whole


def test_split_one_step_off_on_ray_is_the_local_split(tmp_path, ray_session):
  pools = {}
  ray_run = run(config(tmp_path, "ray", "ray", mode="one_step_off"), pools)
  local_run = run(config(tmp_path, "local", "local", mode="one_step_off"))
  assert_same(ray_run, local_run)
  params, seen, metrics = ray_run
  assert {s: v for s, (_, v) in seen.items()} == {1: {0}, 2: {0}, 3: {1}}
  for step in (2, 3):
    assert metrics[step]["rollout/staleness_1"] == 1.0
  assert_synced(metrics, sum(x.nbytes for x in jax.tree.leaves(params)))
  # Continued from step 2 by a second Trainer: the uninterrupted run's step 3. The run above
  # wrote checkpoint 2 (trainer.save_every=2) exactly as a run stopped after step 2 writes
  # it (the same save, holding step 3's batch sampled on the rollout pool), so its
  # checkpoints without step 3's (the driver's and each pool's) are the stopped run's,
  # without training its 2 steps again.
  c = config(tmp_path, "resumed", "ray", mode="one_step_off", steps=3)
  checkpoints = tmp_path / "resumed" / "checkpoints"
  shutil.copytree(tmp_path / "ray" / "checkpoints", checkpoints)
  for step_3 in [checkpoints / "3", *checkpoints.glob("pools/*/3")]:
    shutil.rmtree(step_3)
  c.trainer.resume = True
  # cluster.reuse_workers on the module's session: the first run's processes wait parked;
  # the rollout pool's process is killed there, so the resumed run takes the train pool's
  # process and starts a new rollout process.
  (killed,) = pools["rollout"][1]
  os.kill(killed, signal.SIGKILL)
  resumed_pools = {}
  resumed = run(c, resumed_pools)
  assert resumed_pools["train"][1] == pools["train"][1]
  assert resumed_pools["rollout"][1].isdisjoint({killed})
  assert sorted(resumed[1]) == [3]  # it trained step 3 alone
  assert_same(last_step(resumed), last_step(ray_run))


def test_split_over_pools_of_two_processes_on_ray_is_the_local_split(tmp_path, ray_session):
  """Each pool 2 devices in 2 processes (a jax.distributed job): the train pool gathers the
  weights across its processes, and both rollout processes read the one copy sent."""
  def two_by_two(run, backend):
    return two_processes_a_pool(config(tmp_path, run, backend, mode="one_step_off", steps=2))
  pools = {}
  ray_run = run(two_by_two("ray", "ray"), pools)
  local_run = run(two_by_two("local", "local"))
  assert [len(pids) for _, pids in pools.values()] == [2, 2]
  params, _, metrics = ray_run
  weights = sum(x.nbytes for x in jax.tree.leaves(params))
  assert_synced(metrics, weights)  # one copy sent; the local split copies one per device
  assert_synced(local_run[2], 2 * weights)
  assert_same(*without_sync_bytes(ray_run, local_run))


def test_split_with_lora_on_ray_sends_only_the_adapters(tmp_path, ray_session):
  ray_run = run(config(tmp_path, "ray", "ray", mode="one_step_off", lora=4))
  local_run = run(config(tmp_path, "local", "local", mode="one_step_off", lora=4))
  params, _, metrics = ray_run
  adapters = sum(x.nbytes for x in jax.tree.leaves(split_adapters(params)[0]))
  assert 0 < adapters < sum(x.nbytes for x in jax.tree.leaves(params)) / 4
  assert_synced(metrics, adapters)
  # The local split copies the merged weights to the rollout device; Ray sends adapters.
  assert_same(*without_sync_bytes(ray_run, local_run))


def test_bad_split_placements_on_ray_fail_before_ray_starts(tmp_path):
  c = config(tmp_path, "bad", "ray")
  c.placement.roles = {"actor": {"pool": "train", "generate_tensor": 2},
                       "rollout": {"pool": "rollout"}}
  with pytest.raises(ValueError, match=r"^config.placement.roles.actor.generate_tensor: 2 does "
                                       r"not divide pool 'rollout' of 1 devices$"):
    make_backend(c, log=lambda *_: None)
  c.placement.roles = {"actor": {"pool": "train"}, "rollout": {"pool": "gen"}}
  with pytest.raises(ValueError, match=r"^config.placement.roles.rollout.pool: 'gen' is not "):
    make_backend(c, log=lambda *_: None)


def async_config(tmp_path, run, backend, steps=4):
  """Async with a bound of 1 and 2 decode steps beside each update: trajectories span
  updates (partial rollouts) and some rows lag a version."""
  c = config(tmp_path, run, backend, mode="async", steps=steps)
  c.trainer.update(max_staleness=1, async_decode_steps=2)
  return c


def test_split_async_on_ray_resumes_with_its_finished_trajectories(tmp_path, ray_session):
  """Stopped after step 2 (a checkpoint every step) and resumed to step 4 by a second Trainer:
  every group the checkpoint held finished is trained, its tokens and versions as they
  were, and no trained row lags past the bound. (Not the uninterrupted run: the samples in
  flight continue from their saved tokens with the restored weights, whose prefill rounds
  otherwise than the decode steps did.) With LoRA: each sync sends the adapters alone."""
  c = async_config(tmp_path, "resumed", "ray", steps=2)
  c.model.lora_rank = 4
  # 8 decode steps beside an update finish the next batch (responses of at most 8 tokens),
  # so a checkpoint holds a finished batch and the one admitted after the sync.
  c.trainer.update(save_every=1, async_decode_steps=8)
  params, _, metrics = run(c)
  assert_synced(metrics, sum(x.nbytes for x in jax.tree.leaves(split_adapters(params)[0])))
  finished = finished_groups(os.path.join(c.trainer.run_dir, "checkpoints"), 2)
  c.trainer.update(total_steps=4, resume=True)
  assert_trains_finished(c, finished, [3, 4])


def finished_groups(checkpoints, step: int) -> dict:
  """The groups checkpoint `step` holds finished: dataset row -> its samples' sorted
  (tokens, versions)."""
  stream = Checkpointer(str(checkpoints), keep=None,
                        save_every=1).restore(step)[1]["pending"]["stream"]
  finished = {g["row_index"]: sorted((list(d["token_ids"]), sorted(set(d["versions"])))
                                     for d in g["done"])
              for g in stream["groups"] if all(d is not None for d in g["done"])}
  assert finished, "the checkpoint holds no finished group: nothing was tested"
  return finished


def assert_trains_finished(c, finished: dict, steps: list[int]):
  """Resumes c (max_staleness 1): it trains `steps`, every group in `finished` with its
  tokens and versions as they were, and no row past the bound."""
  trainer = Trainer(c, log=lambda *_: None)
  trained, trained_steps = {}, []  # dataset row -> its samples' (tokens, versions)

  def record(info):
    batch = {k: np.asarray(info.batch[k]) for k in ("row_index", "responses",
                                                    "response_mask", "rollout_versions")}
    # The bound: step k's update starts from version k - 1.
    assert (info.step - 1) - np.asarray(info.batch["rollout_version"]).min() <= 1, info.step
    trained_steps.append(info.step)
    for row, tokens, mask, versions in zip(*batch.values()):
      trained.setdefault(int(row), []).append((tokens[mask].tolist(),
                                               sorted(set(versions[mask].tolist()))))
  trainer.add_hook(record)
  try:
    trainer.fit()
  finally:
    trainer.close()
  assert trained_steps == steps
  for row, samples in finished.items():  # held finished: trained as they were
    assert sorted(trained[row]) == samples, row


def multi_turn_config(tmp_path, run, backend, response=32, **multi_turn):
  """async_config's run on the tool task's prompts, at most two model turns a trajectory
  of `response` tokens after its prompt."""
  c = async_config(tmp_path, run, backend, steps=2)
  c.data.builtin.update(data_source="arithmetic_tools")
  c.data.update(max_prompt_length=128, max_response_length=response)
  c.rollout.multi_turn.update(enable=True, max_assistant_turns=2, max_turn_tokens=16,
                              **multi_turn)
  return c


def test_split_async_multi_turn_on_ray_is_the_local_split(tmp_path, ray_session):
  """Agent trajectories (the tool task's prompts, hermes tool calls): the stream's agent
  loop in the rollout process, the rows made by the train pool's actor."""
  ray_run = run(multi_turn_config(tmp_path, "ray", "ray"))
  local_run = run(multi_turn_config(tmp_path, "local", "local"))
  assert_same(ray_run, local_run)
  assert "agent/turns/mean" in ray_run[2][1]


def test_split_async_over_pools_of_two_processes_on_ray_is_the_local_split(tmp_path,
                                                                           ray_session):
  """Each pool 2 devices in 2 processes (a jax.distributed job). The stream's engine spans
  the rollout pool's two processes: each runs the stream's host program, reading every
  engine step's tokens back with a collective, so both hold the same requests; process 0
  answers the driver. Trajectories span updates and some rows lag a version."""
  def two_by_two(run, backend):
    return two_processes_a_pool(async_config(tmp_path, run, backend))
  pools = {}
  ray_run = run(two_by_two("ray", "ray"), pools)
  local_run = run(two_by_two("local", "local"))
  assert {pool: (roles, len(pids)) for pool, (roles, pids) in pools.items()} == {
      "train": (("actor",), 2), "rollout": (("rollout",), 2)}
  assert_same(*without_sync_bytes(ray_run, local_run))
  params, seen, metrics = ray_run
  for step, (_, versions) in seen.items():  # the update of step k starts from version k - 1
    assert min(versions) >= step - 2, (step, versions)
  assert any(min(versions) < step - 1 for step, (_, versions) in seen.items())  # rows lag
  assert max(m["async/versions_per_trajectory_max"] for m in metrics.values()) > 1  # partial
  assert_synced(metrics, sum(x.nbytes for x in jax.tree.leaves(params)))  # one copy sent


def without_tool_seconds(*runs):
  """The runs' metrics without agent/tool_seconds/mean: how long the tools took."""
  return [(params, seen, {step: {k: v for k, v in m.items() if k != "agent/tool_seconds/mean"}
                          for step, m in metrics.items()}) for params, seen, metrics in runs]


def calls(log_path) -> list[tuple[int, int]]:
  """The logged tool calls, as (JAX process index, pid)."""
  if not os.path.exists(log_path):
    return []
  with open(log_path) as f:
    return [tuple(map(int, line.split())) for line in f]


def tool_runs(tmp_path, monkeypatch, configure):
  """The Ray and local runs of configure(multi-turn config, run, backend), their tools
  logging each call (tests/ray_tool_task.py): (ray run, local run, the Ray run's pools,
  the Ray run's calls, the local run's calls). Checks the driver ran no tool."""
  ray_log, local_log = tmp_path / "ray_calls.log", tmp_path / "local_calls.log"
  register(str(local_log), monkeypatch.setitem)  # this process: the config, the local run
  # Ray's members take this PYTHONPATH (ray_backend.worker_env): the task's registration.
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
      p for p in (site_dir(tmp_path, ray_log), os.environ.get("PYTHONPATH")) if p))

  def tool_config(run, backend):
    """64 tokens: room for both turns (16 each at most) and the tool's message."""
    c = multi_turn_config(tmp_path, run, backend, response=64, format="every_turn")
    return configure(c)
  pools = {}
  ray_run = run(tool_config("ray", "ray"), pools)
  assert calls(local_log) == []  # the driver ran no tool
  local_run = run(tool_config("local", "local"))
  return ray_run, local_run, pools, calls(ray_log), calls(local_log)


def assert_tools_ran_once_in(pool_pids, ray_run, local_run, ray_calls, local_calls):
  """The Ray run is the local run (tokens, versions, metrics but the tools' wall time,
  final weights); every trajectory called its tool twice; each call ran once, in the
  process of pool_pids that is JAX process 0 there."""
  assert_same(*without_sync_bytes(*without_tool_seconds(ray_run, local_run)))
  for m in ray_run[2].values():  # every trajectory continued after its first tool call
    assert m["agent/turns/mean"] == m["agent/tool_calls/mean"] == 2
  assert len(ray_calls) == len(local_calls) > 0  # the same calls, each once
  assert {index for index, _ in ray_calls} == {0}
  (pid,) = {pid for _, pid in ray_calls}  # one process ran them
  assert pid in pool_pids
  assert {pid for _, pid in local_calls} == {os.getpid()}


@pytest.mark.parametrize("mode", ["async", "sync"])
def test_split_multi_turn_over_a_rollout_pool_of_two_processes_runs_each_tool_once(
    tmp_path, ray_session, monkeypatch, mode):
  """Agent trajectories whose every turn calls a tool that answers after a random wait
  (tests/ray_tool_task.py), on a rollout pool of two processes: process 0 alone runs the
  tools and broadcasts which results each engine step admits, with the results, so both
  processes run the same trajectories: the local split's run (tokens, versions, metrics,
  final weights), and each tool call ran once, in the rollout pool's process 0. Both the
  async stream's loop and the synchronous multi-turn rollout's."""
  def two_rollout_processes(c):
    """The rollout pool 2 devices in 2 processes; the train pool 1 (its processes are not
    what is tested, and each one more costs the run seconds)."""
    c.trainer.mode = mode
    c.placement.pools = {"train": 1, "rollout": 2}
    c.trainer.devices, c.cluster.devices_per_process = 3, 1
    return c
  ray_run, local_run, pools, ray_calls, local_calls = tool_runs(tmp_path, monkeypatch,
                                                                two_rollout_processes)
  assert {pool: len(pids) for pool, (_, pids) in pools.items()} == {"train": 1, "rollout": 2}
  assert_tools_ran_once_in(pools["rollout"][1], ray_run, local_run, ray_calls, local_calls)


def colocated(c):
  """c on one device, the actor generating on its own pool: one Ray process."""
  c.placement.update(kind="colocated", pools={}, roles={})
  c.trainer.devices = 1
  return c


def test_colocated_async_on_ray_is_the_local_run_and_resumes(tmp_path, ray_session):
  """The stream beside the actor in its pool's one process, its weight sync the actor's
  in-process hand-over: the local colocated async run (tokens, versions, metrics, final
  weights), trajectories spanning updates and rows lagging a version. Then continued from
  its step-2 checkpoint by a second Trainer: every group that checkpoint held finished is
  trained as it was, and no trained row lags past the bound."""
  def colocated_async(run, backend):
    c = colocated(async_config(tmp_path, run, backend))
    # 6 decode steps beside an update: partial rollouts, and checkpoint 2 holds a
    # finished group (responses of at most 8 tokens).
    c.trainer.update(save_every=1, async_decode_steps=6)
    return c
  pools = {}
  ray_run = run(colocated_async("ray", "ray"), pools)
  local_run = run(colocated_async("local", "local"))
  assert {pool: (roles, len(pids)) for pool, (roles, pids) in pools.items()} == {
      "all": (("actor",), 1)}
  assert_same(ray_run, local_run)
  params, seen, metrics = ray_run
  assert any(min(versions) < step - 1 for step, (_, versions) in seen.items())  # rows lag
  assert max(m["async/versions_per_trajectory_max"] for m in metrics.values()) > 1  # partial
  # In-process: the engine's copy of the weights, as locally (nothing sent between pools).
  assert metrics[4]["rollout/weight_sync_bytes"] == sum(x.nbytes for x in
                                                       jax.tree.leaves(params))
  c = colocated_async("resumed", "ray")
  checkpoints = tmp_path / "resumed" / "checkpoints"
  shutil.copytree(tmp_path / "ray" / "checkpoints", checkpoints)
  for later in [checkpoints / s for s in "34"] + [*checkpoints.glob("pools/*/[34]")]:
    shutil.rmtree(later)
  finished = finished_groups(checkpoints, 2)
  c.trainer.resume = True
  assert_trains_finished(c, finished, [3, 4])


def test_colocated_async_multi_turn_over_a_pool_of_two_processes_runs_each_tool_once(
    tmp_path, ray_session, monkeypatch):
  """The actor's pool 2 devices in 2 processes (one jax.distributed job), each running the
  stream beside the actor; agent trajectories whose every turn calls the logging tool:
  the local colocated run on 2 devices (tokens, versions, metrics, final weights), each
  tool call once, in the pool's process 0."""
  def two_processes(c):
    c = colocated(c)
    c.trainer.devices, c.cluster.devices_per_process = 2, 1
    return c
  ray_run, local_run, pools, ray_calls, local_calls = tool_runs(tmp_path, monkeypatch,
                                                                two_processes)
  assert {pool: (roles, len(pids)) for pool, (roles, pids) in pools.items()} == {
      "all": (("actor",), 2)}
  assert_tools_ran_once_in(pools["all"][1], ray_run, local_run, ray_calls, local_calls)
  # Trajectories spanned a weight update, and some rows lagged one.
  assert max(m["async/versions_per_trajectory_max"] for m in ray_run[2].values()) > 1
  assert any(min(v) < step - 1 for step, (_, v) in ray_run[1].items())
