"""The auto-mapper under the runtime's continuous batching and packed passes: its memory
model against XLA's compiled memory analysis of the runtime's programs (the slot decode
loop, a packed update and forward pass), and its time model's ranking of the modes.

Stated factor, as tests/test_automap_memory.py: prediction / XLA within [0.7, 1.5].
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from hflax.algorithms.losses import ppo_clip_loss
from hflax.controller.training import make_train_step
from hflax.models import create
from hflax.models.logprobs import packed_log_probs
from hflax.rollout.sampler import SamplingParams, _generate, decode_segments
from hflax.sharding import automap
from hflax.sharding.automap import MeshShape, Overheads, Planner, Simulator, Workload, memory
from hflax.sharding.automap.cost import forward_flops
from test_automap_memory import assert_within, config, xla

A100 = automap.get_profile("a100-80gb")
LLAMA_7B = automap.llama2_config("7b")
GEN_CFG = config(d=256, heads=4, kv=4)


@functools.lru_cache(maxsize=None)
def slot_decode_memory(prompts, prompt_len, new_tokens, n, slots):
  """XLA's (temp, total) of the sampler's continuous-batching program (decode_slots)."""
  graphdef, state = create(GEN_CFG)
  params = SamplingParams(max_new_tokens=new_tokens, temperature=0.0, n=n)
  tokens = jnp.zeros((prompts, memory.length_bucket(prompt_len)), jnp.int32)
  return xla(_generate.lower(graphdef, state, tokens, jnp.ones(tokens.shape, bool),
                             jax.random.key(0), params=params,
                             segments=decode_segments(new_tokens), slots=slots).compile())


@pytest.mark.parametrize("prompts, prompt_len, new_tokens, n, slots, rows_cache_misses", [
    (8, 64, 128, 4, 4, True),     # 32 rows in 4 slots: the slots' cache, not the rows'
    (16, 40, 128, 2, 8, False),   # the prompt's bucket (64 for 40)
    (32, 64, 128, 1, 4, False),   # many prompts: their kept cache and the prefill dominate
])
def test_slot_decode_memory_within_factor(prompts, prompt_len, new_tokens, n, slots,
                                          rows_cache_misses):
  temp, total = slot_decode_memory(prompts, prompt_len, new_tokens, n, slots)
  predicted = memory.slots_generate_bytes(GEN_CFG, prompts, prompt_len, new_tokens, slots)
  assert_within(predicted.transient, temp, "slot decode temp")
  assert_within(predicted.total, total, "slot decode total")
  if rows_cache_misses:  # the waves' model, a decode cache for every row, overshoots
    assert memory.generate_bytes(GEN_CFG, prompts, prompt_len, new_tokens, n).transient > \
        2 * temp


def test_the_prompts_prefill_cache_stays_alive_beside_the_slots():
  """4x the prompts into the same 4 slots: XLA's scratch grows by what the model charges
  for the prompts' kept cache and their prefill, with no more slots."""
  few, many = (slot_decode_memory(p, 64, 128, 1, 4)[0] for p in (8, 32))
  model = [memory.slots_generate_bytes(GEN_CFG, p, 64, 128, 4).transient for p in (8, 32)]
  assert_within(model[1] - model[0], many - few, "growth with kept prompts")
  kept = memory.kv_cache_bytes(GEN_CFG, 32 - 8, 64)
  assert many - few > kept  # the cache of every prompt, at least


def packed_rows(cfg, length, sequences, scored):
  """One packed row of `sequences` equal sequences, `scored` response tokens each."""
  each = length // sequences
  return {"tokens": jax.random.randint(jax.random.key(0), (1, length), 0, cfg.vocab_size),
          "segments": jnp.repeat(jnp.arange(1, sequences + 1, dtype=jnp.int32), each)[None],
          "index": (jnp.arange(sequences)[:, None] * each + each - scored
                    + jnp.arange(scored)[None]).astype(jnp.int32),
          "valid": jnp.ones((sequences, scored), bool),
          "old_log_probs": jnp.zeros((sequences, scored)),
          "advantages": jnp.ones((sequences, scored))}


@pytest.mark.parametrize("layers, d, vocab, length, sequences, scored, tied", [
    (2, 512, 512, 1024, 8, 64, False),    # MLP activations, blockwise attention
    (2, 64, 8192, 1024, 8, 128, False),   # the logits block of the row's 8 sequences
    (2, 64, 8192, 1024, 8, 128, True),    # the same with a tied head
    (2, 64, 4096, 512, 4, 128, False),    # dense attention scores of a 512-token row
])
def test_packed_update_and_forward_memory_within_factor(layers, d, vocab, length, sequences,
                                                        scored, tied):
  """A packed micro-batch: one row of `length` real tokens (the token budget). The actor's
  update as the packed path runs it (packed_log_probs, PPO-clip, AdamW, donated) and the
  packed log-prob pass, against the model's one row of budget tokens."""
  cfg = dataclasses.replace(config(layers, d, vocab), tie_word_embeddings=tied)
  graphdef, state = create(cfg)
  params = nnx.state(nnx.merge(graphdef, state), nnx.Param)
  rows = packed_rows(cfg, length, sequences, scored)

  def log_probs(p, r):
    return packed_log_probs(graphdef, p, r["tokens"], r["segments"], r["index"], r["valid"])[0]

  def loss(p, r):
    per_token, _ = ppo_clip_loss(log_probs(p, r), r["old_log_probs"], r["advantages"],
                                 r["valid"].astype(jnp.float32))
    return jnp.mean(per_token), {}

  tx = optax.adamw(1e-3)
  step = jax.jit(make_train_step(loss, tx, 1), donate_argnums=(0, 1))
  temp, total = xla(step.lower(params, tx.init(params), rows).compile())
  predicted = memory.update_bytes(cfg, 1, length, scored, scored_rows=sequences)
  assert_within(predicted.transient, temp, "packed update temp")
  assert_within(predicted.total, total, "packed update total")
  temp, total = xla(jax.jit(log_probs).lower(state, rows).compile())
  predicted = memory.forward_bytes(cfg, 1, length, scored, scored_rows=sequences)
  assert_within(predicted.transient, temp, "packed forward temp")
  assert_within(predicted.total, total, "packed forward total")


def workload(mean=2048, continuous=False, packed=False, **kw):
  """7B PPO, 1024-token prompts and up to 2048 generated, responses of `mean` on average."""
  base = dict(prompts_per_step=256, mini_batch_size=64, prompt_len=1024, response_len=2048,
              micro_batch_size=8, attention="blockwise")
  return Workload.ppo(LLAMA_7B, mean_response_len=mean, continuous_batching=continuous,
                      packed=packed, **{**base, **kw})


def test_simulator_charges_packed_micro_batches_by_their_token_budget():
  mesh = MeshShape(8, 1, 1)
  padded, packed = (Simulator(workload(mean=256, packed=p), A100) for p in (False, True))
  _, micro, row = packed._micro_batches(32, train=True)
  # micro_batch_size sequences' real tokens, one row: 8 x (1024 + 256).
  assert (micro, row) == (8, 8 * 1280)
  assert packed._activations(LLAMA_7B, mesh, micro, True, False, row) == \
      memory.activation_bytes(LLAMA_7B, 1, 10240, 2048, "blockwise", scored_rows=8)
  assert packed._activations(LLAMA_7B, mesh, micro, True, False, row) < \
      0.6 * padded._activations(LLAMA_7B, mesh, micro, True, False)
  budget = Simulator(workload(mean=256, packed=True, token_budget=16384), A100)
  calls, _, row = budget._micro_batches(32, train=True)
  assert (calls, row) == (3, 16384)  # 32 x 1280 = 40960 tokens in rows of 16384
  forward = Simulator(workload(mean=256, packed=True, token_budget=16384,
                               forward_token_budget=32768), A100)
  assert forward._micro_batches(32, train=False)[2] == 32768


def test_packed_attention_is_charged_per_sequence():
  """A packed pass costs the matmuls of its real tokens and each sequence's own causal
  attention (by hand), however long the packed rows are: no cross-sequence scores."""
  cfg = LLAMA_7B
  seq = 1024 + 300
  matmul = cfg.num_params - cfg.vocab_size * cfg.hidden_size
  by_hand = 2 * matmul * seq + 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq * seq
  for budget in (0, 3072, 65536):
    sim = Simulator(workload(mean=300, packed=True, token_budget=budget), A100)
    assert sim.pass_flops(cfg, 10) == pytest.approx(10 * by_hand)
  padded = Simulator(workload(mean=300), A100)
  assert padded.pass_flops(cfg, 10) == pytest.approx(10 * forward_flops(cfg, 3072))
  # With no weight gathers or calls to count, longer packed rows cost the same time.
  times = [Simulator(workload(mean=300, packed=True, token_budget=b), A100,
                     Overheads.roofline()).forward("ref", MeshShape(8, 1, 1), 60e9).time
           for b in (3072, 65536)]
  assert times[0] == pytest.approx(times[1])


def test_shared_prompts_are_charged_once_per_group():
  """model.share_prompts: a packed pass computes each prompt's matmuls once for its
  samples (by hand), each response still attending to it; its rows hold that many tokens."""
  cfg = LLAMA_7B
  matmul = cfg.num_params - cfg.vocab_size * cfg.hidden_size
  seq = 1024 + 300
  by_hand = (2 * matmul * (1024 / 4 + 300)
             + 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * seq * seq)
  shared = Simulator(workload(mean=300, packed=True, share_prompts=True,
                              samples_per_prompt=4), A100)
  assert shared.pass_flops(cfg, 10) == pytest.approx(10 * by_hand)
  assert shared._micro_batches(32, train=True)[2] == 8 * (1024 / 4 + 300)
  alone = Simulator(workload(mean=300, packed=True, share_prompts=True), A100)  # n = 1
  assert alone.pass_flops(cfg, 10) == pytest.approx(
      Simulator(workload(mean=300, packed=True), A100).pass_flops(cfg, 10))


def test_continuous_batching_decodes_by_total_tokens():
  """256 sequences in 32 slots (one replica of t_g = 8). Skewed lengths (mean = max / 8):
  the slots decode (256 - 32) x mean / 32 + max steps, not 8 waves of the longest row.
  Every row at the maximum: no gain, a small overhead (the slots' cache stays grown)."""
  mesh, free = MeshShape(1, 8, 1), 70e9
  times = {}
  for mean in (2048, 256):
    for continuous in (False, True):
      cost = Simulator(workload(mean, continuous, max_num_seqs=32), A100).generate(mesh, 8, free)
      assert cost.reason is None, cost.reason
      times[mean, continuous] = cost.time
      assert cost.note == ("slots=32" if continuous else "waves=8")
  assert times[2048, False] == pytest.approx(times[256, False])  # waves: the longest row
  assert 1.0 <= times[2048, True] / times[2048, False] < 1.15
  assert times[256, True] < 0.4 * times[256, False]


@pytest.mark.parametrize("continuous, cap, steps", [
    (True, 1, 7 * 512 + 2048),   # one slot: the 7 rows after the first at the mean, then one
    (True, 3, 5 * 512 / 3 + 2048),
    (True, 8, 2048),             # a slot per row: the longest row
    (False, 3, 3 * 2048),        # waves of 3, 3 and 2 rows, each the longest row long
])
def test_decode_steps_by_hand(continuous, cap, steps):
  """A decode step of 1 s and nothing else costing time: the stage takes its steps."""
  instant = A100.replace(peak_flops=1e30, memory_bandwidth=1e30, intra_node_bandwidth=1e30,
                         inter_node_bandwidth=1e30, collective_latency=0.0)
  steps_only = Overheads(decode_step=1.0, overlap=1.0, call_per_device=0.0)
  wl = workload(512, continuous, max_num_seqs=cap, prompts_per_step=8, mini_batch_size=8)
  cost = Simulator(wl, instant, steps_only).generate(MeshShape(1, 8, 1), 8, 70e9)
  assert cost.time == pytest.approx(steps, rel=1e-6)


def test_continuous_batching_memory_keeps_the_prompts_and_sizes_the_slots():
  """The slot budget is what the memory leaves beside the weights and every prompt's kept
  prefill cache: more prompts per replica, fewer slots; the plan's max_num_seqs is it."""
  mesh = MeshShape(1, 8, 1)
  small, large = (Simulator(workload(continuous=True, prompts_per_step=p, mini_batch_size=64),
                            A100).generate(mesh, 8, 60e9) for p in (64, 256))
  assert small.max_num_seqs > large.max_num_seqs > 0
  split = LLAMA_7B.replace(num_heads=4, num_kv_heads=4, dtype="bfloat16")
  kept = memory.slots_generate_bytes(split, 256, 1024, 2048, 0, "blockwise").transient
  per_slot = memory.kv_cache_bytes(split, 1, 1024 + 2048)
  weights = 2 * LLAMA_7B.num_params / 8
  assert large.max_num_seqs == int((60e9 - weights - kept) // per_slot)
  assert large.transient == pytest.approx(weights + kept + large.max_num_seqs * per_slot)
  tight = Simulator(workload(continuous=True, prompts_per_step=256), A100).generate(
      mesh, 8, weights + kept + 0.5 * per_slot)
  assert tight.reason and "OOM" in tight.reason and "prefill cache" in tight.reason


SPLIT = (("actor", "ref"), ("critic", "reward"))
MESHES = {"actor": MeshShape(1, 8, 1), "ref": MeshShape(8, 1, 1),
          "critic": MeshShape(1, 8, 1), "reward": MeshShape(8, 1, 1)}


def step_time(wl):
  plan = Planner(wl, A100).evaluate(SPLIT, (8, 8), MESHES, generate_tensor=2)
  assert plan.feasible, plan.reason
  return plan


def test_the_step_ranks_the_modes_as_the_runtime_does():
  """Skewed lengths (mean 256 of 2048): continuous batching shortens generation, packing
  the forward and update passes, and both together the step most. Every response at the
  maximum: neither gains (continuous batching's grown cache costs a little)."""
  kw = dict(max_num_seqs=16, samples_per_prompt=4, prompts_per_step=64, mini_batch_size=16)
  modes = [(c, p) for c in (False, True) for p in (False, True)]
  skewed = {m: step_time(workload(256, *m, **kw)) for m in modes}
  worst = {m: step_time(workload(2048, *m, **kw)) for m in modes}
  base = skewed[False, False]
  assert skewed[True, False].stage_times["generate"] < 0.5 * base.stage_times["generate"]
  assert skewed[False, True].stage_times["forward"] < 0.5 * base.stage_times["forward"]
  assert skewed[False, True].stage_times["train"] < 0.5 * base.stage_times["train"]
  assert skewed[True, True].step_time < min(skewed[True, False].step_time,
                                            skewed[False, True].step_time)
  for m in modes:
    assert 1.0 <= worst[m].step_time / worst[False, False].step_time < 1.15, m
  # Padded waves take the longest row whatever the mean.
  assert base.step_time == pytest.approx(worst[False, False].step_time)


def test_search_plans_with_continuous_batching_and_packing():
  wl = workload(256, True, True, token_budget=8192, prompts_per_step=128)
  plans = automap.search(wl, A100, 16, top_k=5)
  assert plans and all(p.feasible for p in plans)
  best = plans[0]
  assert best.max_num_seqs > 0
  assert best.to_config()["roles"]["actor"]["max_num_seqs"] == best.max_num_seqs
  padded = automap.search(workload(256, prompts_per_step=128), A100, 16, top_k=1)[0]
  assert best.step_time < padded.step_time


def test_bad_runtime_modes_name_the_field():
  cfg = config()
  cases = [(dict(mean_response_len=0), "mean_response_len"),
           (dict(response_len=64, mean_response_len=65), "mean_response_len"),
           (dict(mean_prompt_len=2000), "mean_prompt_len"),
           (dict(continuous_batching="yes"), "continuous_batching"),
           (dict(packed=1), "packed"),
           (dict(token_budget=4096), "token_budget: .* packed=True"),
           (dict(packed=True, token_budget=-1), "token_budget must be >= 0"),
           (dict(packed=True, prompt_len=64, response_len=64, token_budget=100),
            "token_budget: 100 tokens is less than the longest sequence"),
           (dict(packed=True, prompt_len=64, response_len=64, forward_token_budget=64),
            "forward_token_budget")]
  for kw, match in cases:
    with pytest.raises(ValueError, match=match):
      Workload.ppo(cfg, **kw)
  # A decode slot holds one sample: continuous batching takes a cap below n.
  assert Workload.ppo(cfg, samples_per_prompt=4, max_num_seqs=2,
                      continuous_batching=True).max_num_seqs == 2
  with pytest.raises(ValueError, match="max_num_seqs"):
    Workload.ppo(cfg, samples_per_prompt=4, max_num_seqs=2)
