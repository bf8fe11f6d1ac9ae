"""rollout.max_num_seqs: the actor generates in waves, each replica holding at most that many
sequences, and samples exactly what one call over the whole batch would have."""
import jax
import numpy as np
import pytest

from ppo_step import CFG, SAMPLING, prompts_batch
from hflax.controller import actor as workers
from hflax.launch.config import base_config, validate
from hflax.launch.plan import workload
from hflax.models import create
from hflax.rollout import generation_waves, sampler
from hflax.sharding import automap
from hflax.sharding.automap import memory
from hflax.sharding.automap.mesh import MeshShape
from hflax.sharding.placement import build_placement

FIELDS = ("responses", "response_mask", "rollout_log_probs", "input_ids", "group_ids")


def test_generation_waves_by_hand():
  assert generation_waves(10, 2, 2) == (1, 5)        # no cap: one wave of 5 per replica
  assert generation_waves(10, 2, 2, 4) == (3, 2)     # 2 prompts fit: 5 -> waves of 2, 2, 1
  assert generation_waves(10, 2, 2, 7) == (2, 3)     # 3 fit: 2 waves of 3 (not 3 + 2 ... 3, 2)
  assert generation_waves(7, 4, 1, 1) == (2, 1)      # 2 per replica (7 padded to 8)
  assert generation_waves(8, 1, 2, 100) == (1, 8)    # the cap is not reached
  with pytest.raises(ValueError, match="less than the 4 samples"):
    generation_waves(4, 1, 4, 3)


def make_actor(pool, mesh, t_g, cap, sampling=SAMPLING):
  spec = {"pools": {"p": pool}, "roles": {"actor": {
      "pool": "p", "mesh": mesh, "generate_tensor": t_g, "max_num_seqs": cap}}}
  placed = build_placement(spec, jax.devices()[:pool])
  return workers.ActorRolloutWorker(placed["actor"], *create(CFG, seed=0), sampling=sampling)


@pytest.fixture
def calls(monkeypatch):
  """The prompt rows of every generation program the actor runs."""
  seen, real = [], sampler._generate

  def spy(graphdef, state, tokens, *args, **kw):
    seen.append(tokens.shape[0])
    return real(graphdef, state, tokens, *args, **kw)

  monkeypatch.setattr(sampler, "_generate", spy)
  return seen


@pytest.mark.parametrize("pool, mesh, t_g, count, cap, rows", [
    (1, {"fsdp": 1}, 1, 7, 4, [2, 2, 2, 2]),       # 7 prompts x 2 samples, 2 prompts a wave
    (4, {"fsdp": 4}, 2, 7, 2, [2, 2, 2, 2]),       # 2 replicas of t_g=2, 1 prompt each a wave
    (4, {"fsdp": 2, "tensor": 2}, 1, 9, 6, [12]),  # 4 replicas: 3 prompts each fit at once
])
def test_waves_sample_what_one_call_does(pool, mesh, t_g, count, cap, rows, calls):
  prompts = prompts_batch(count, seed=3)
  key = jax.random.key(7)
  whole = make_actor(pool, mesh, t_g, 0).generate_sequences(prompts, rng=key)
  assert calls == [-(-count // (pool // t_g)) * (pool // t_g)]
  calls.clear()
  waved = make_actor(pool, mesh, t_g, cap).generate_sequences(prompts, rng=key)
  assert calls == rows
  replicas = pool // t_g
  assert all(r // replicas * SAMPLING.n <= cap for r in rows)  # no replica holds more
  assert waved.meta["metrics"]["rollout/waves"] == len(rows)
  assert len(waved) == count * SAMPLING.n
  for k in FIELDS:
    if k == "rollout_log_probs":
      np.testing.assert_allclose(waved[k], whole[k], atol=1e-6)
    else:
      np.testing.assert_array_equal(waved[k], whole[k], err_msg=k)
  # Sampled, not greedy: the samples of one prompt differ somewhere.
  assert not np.array_equal(whole["responses"][0::2], whole["responses"][1::2])


def test_config_cap_and_placement_cap_take_the_tighter():
  spec = {"pools": {"p": 1}, "roles": {"actor": {"pool": "p", "max_num_seqs": 6}}}
  placed = build_placement(spec, jax.devices()[:1])["actor"]
  policy = create(CFG, seed=0)
  assert workers.ActorRolloutWorker(placed, *policy, sampling=SAMPLING).max_num_seqs == 6
  for config_cap, want in ((4, 4), (8, 6)):
    actor = workers.ActorRolloutWorker(placed, *policy, sampling=SAMPLING,
                                       max_num_seqs=config_cap)
    assert actor.max_num_seqs == want


def test_bad_caps_name_the_field():
  c = base_config()
  c.rollout.n = 4
  c.rollout.max_num_seqs = 3
  with pytest.raises(ValueError, match=r"config.rollout.max_num_seqs: 3 is less than the 4"):
    validate(c)
  c.rollout.n, c.rollout.max_num_seqs = 1, -1
  with pytest.raises(ValueError, match=r"config.rollout.max_num_seqs: must be an integer >= 0"):
    validate(c)
  spec = {"pools": {"p": 1}, "roles": {"actor": {"pool": "p", "max_num_seqs": 2.5}}}
  with pytest.raises(ValueError, match=r"placement.roles.actor.max_num_seqs: must be an integer"):
    build_placement(spec, jax.devices()[:1])
  spec = {"pools": {"p": 1}, "roles": {"critic": {"pool": "p", "max_num_seqs": 4}}}
  with pytest.raises(ValueError, match=r"roles.critic.max_num_seqs: only the actor generates"):
    build_placement(spec, jax.devices()[:1])
  with pytest.raises(ValueError, match="max_num_seqs must be 0 .* the 4 samples of one prompt"):
    automap.Workload.ppo(CFG, samples_per_prompt=2, val_samples_per_prompt=4, max_num_seqs=3)


def test_a_placement_cap_below_one_prompts_samples_fails_before_any_work(tmp_path):
  from hflax.launch.trainer import Trainer
  from tiny_config import get_config
  c = get_config()  # GRPO, rollout.n=2, the reference on the actor's pool
  c.trainer.run_dir = str(tmp_path / "run")
  c.rollout.update(val_n=4, val_temperature=1.0)
  c.placement.kind = "custom"
  c.placement.pools = {"all": 2}
  c.placement.roles = {"actor": {"pool": "all", "max_num_seqs": 3}, "ref": {"pool": "all"}}
  with pytest.raises(ValueError, match=r"^config.placement.roles.actor.max_num_seqs: 3 is less "
                     r"than the 4 samples"):
    Trainer(c, log=lambda *_: None)
  assert not (tmp_path / "run").exists()


def test_the_simulators_waves_are_the_actors():
  """The simulator sizes the KV cache from the memory a plan leaves free, carries that many
  sequences per replica into the plan (to_config's max_num_seqs), and times the waves that
  the actor, capped there, then runs."""
  c = base_config()
  c.algorithm.name, c.algorithm.adv_estimator = "grpo", "grpo"
  c.rollout.n, c.data.train_batch_size = 2, 8
  c.data.max_prompt_length, c.data.max_response_length = 8, 8
  sim = automap.Simulator(workload(c, CFG), automap.get_profile("a100-80gb"))
  # Per sequence as the sampler allocates it (automap/memory.py, checked against XLA's
  # compiled memory analysis): its decode cache of 16 slots in the model's float32 and its
  # share of the prompt's prefill cache and attention scores.
  kv_seq = memory.generate_bytes(CFG, 1, 8, 8, 2).transient / 2
  weights = 4 * CFG.num_params
  mesh = MeshShape(2, 1, 1)  # 2 replicas of 4 prompts x 2 samples
  roomy = sim.generate(mesh, 1, free=weights + 100 * kv_seq)
  assert roomy.max_num_seqs == 100 and "waves" not in roomy.note
  tight = sim.generate(mesh, 1, free=weights + 5.5 * kv_seq)
  assert tight.max_num_seqs == 5 and "waves=2" in tight.note  # 2 prompts (4 rows) a wave
  assert tight.transient == weights + 4 * kv_seq
  too_tight = sim.generate(mesh, 1, free=weights + 1.5 * kv_seq)
  assert "OOM" in too_tight.reason and "2 samples of a prompt" in too_tight.reason
  c.rollout.update(val_n=8, val_temperature=1.0)  # validation's 8 samples must fit too
  validating = automap.Simulator(workload(c, CFG), automap.get_profile("a100-80gb"))
  assert "8 samples of a prompt" in validating.generate(mesh, 1, weights + 5.5 * kv_seq).reason
  spec = {"pools": {"p": 2}, "roles": {"actor": {
      "pool": "p", "mesh": mesh.as_dict(), "max_num_seqs": tight.max_num_seqs}}}
  actor = workers.ActorRolloutWorker(build_placement(spec, jax.devices()[:2])["actor"],
                                     *create(CFG, seed=0), sampling=SAMPLING)
  out = actor.generate_sequences(prompts_batch(8), rng=jax.random.key(0))
  assert out.meta["metrics"]["rollout/waves"] == 2


def test_the_plans_workload_reads_what_the_runtime_will_do():
  c = base_config()
  c.algorithm.name, c.algorithm.adv_estimator = "grpo", "grpo"
  c.rollout.n, c.data.train_batch_size = 2, 8
  c.data.max_prompt_length, c.data.max_response_length = 8, 8
  plain = workload(c, CFG)
  assert not plain.continuous_batching and not plain.packed and plain.token_budget == 0
  c.rollout.continuous_batching = True
  c.model.use_remove_padding = True
  c.actor.update(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=64,
                 log_prob_max_token_len_per_gpu=128)
  wl = workload(c, CFG)
  assert wl.continuous_batching and wl.packed
  assert (wl.token_budget, wl.forward_token_budget) == (64, 128)
