"""The agent loop makes segments itself where a history is not append-only: the rows it
trains are the segments built by hand from the same sampled ids, exactly on-policy."""
import jax
import numpy as np
import pytest

from hflax.models import ModelConfig, create
from hflax.models.tokenizer import ByteTokenizer
from hflax.rollout import Request, RolloutEngine, SamplingParams
from hflax.rollout.agents import AgentLoop, MessageDelta, Observation, Trajectory, Turn
from hflax.rollout.agents import to_batch_fields
from hflax.rollout.agents.segments import segment_rows, trajectory_rows

TOKENIZER = ByteTokenizer()
CFG = ModelConfig(vocab_size=264, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2)
SAMPLED = SamplingParams(max_new_tokens=10, temperature=1.0, eos_ids=TOKENIZER.eos_ids,
                         pad_id=TOKENIZER.pad_id)


class DropsReasoning(ByteTokenizer):
  """ChatML whose template renders an assistant turn that is not the last message by its
  final 3 characters only: it drops the earlier turns' reasoning, as Qwen3's drops their
  <think> part (a random model never writes </think>, so the cut is by length)."""

  def apply_chat_template(self, messages, add_generation_prompt=True, **template_vars):
    shown = [{**m, "content": m["content"][-3:]} if m["role"] == "assistant" and k < len(
        messages) - 1 else m for k, m in enumerate(messages)]
    return super().apply_chat_template(shown, add_generation_prompt, **template_vars)


@pytest.fixture(scope="module")
def model():
  return create(CFG, seed=5)


class Scripted:
  """A tool message after every turn, done after `turns`; records each turn's sampled ids.
  compact=True: the environment rewrites its history itself (Observation.context), the
  previous assistant turn shown by its last 2 characters (its reasoning dropped)."""

  def __init__(self, turns: int, compact: bool = False):
    self.turns, self.compact, self.sampled, self.contexts = turns, compact, [], []

  def reset(self, sample):
    self.history = [{"role": "user", "content": sample}]
    return list(self.history)

  def step(self, turn: Turn) -> Observation:
    self.sampled.append(list(turn.token_ids))
    if turn.index + 1 == self.turns:
      return Observation([], reward=1.0, done=True)
    tool = [{"role": "tool", "content": f"result {turn.index}"}]
    if not self.compact:
      return Observation(tool)
    self.history += [{"role": "assistant", "content": turn.text[-2:]}] + tool
    self.contexts.append(list(self.history))
    return Observation(tool, context=list(self.history))


def engine_for(model, params=SAMPLED, prompt=200):
  return RolloutEngine(*model, params, slots=4, steps_per_call=4, max_prompt_len=prompt,
                       max_turn_len=40, max_context_len=400, key=jax.random.key(1))


def by_hand(prompt_ids, contexts, sampled, tokenizer=TOKENIZER):
  """A trajectory's segments from its sampled turns: segment t is context t (the prompt,
  then each rewritten conversation rendered) and turn t's ids (log-probs left out)."""
  segments = []
  for ids_before, turn in zip([prompt_ids] + [tokenizer.encode_chat(c) for c in contexts],
                              sampled):
    s = Trajectory(0, [], [], [], [], len(ids_before))
    s.append(ids_before, model=False)
    s.append(turn, model=True, log_probs=[0.0] * len(turn), versions=[0] * len(turn))
    segments.append(s)
  return segments


def check_rows_are_the_hand_built_segments(trajectories, envs, samples, contexts, tokenizer):
  rows, owner = trajectory_rows(trajectories)
  hand, _ = segment_rows([by_hand(tokenizer.encode_chat([{"role": "user", "content": q}]),
                                  c, e.sampled, tokenizer)
                          for q, c, e in zip(samples, contexts, envs)])
  assert owner == [i for i, e in enumerate(envs) for _ in e.sampled]
  got, want = to_batch_fields(rows, 0), to_batch_fields(hand, 0)
  for key in ("prompts", "prompt_mask", "responses", "response_mask", "attention_mask",
              "position_ids"):
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  return rows


def test_an_environment_that_rewrites_its_history_makes_segments(model):
  """Observation.context: each turn after the first samples from the rewritten context in
  a fresh request (as a request for that context alone would), and the trajectory's rows
  are its segments built by hand from the same sampled ids, sharing the prompt."""
  samples = ["What is 2+2?", "Name a colour.", "Count to three."]
  envs = [Scripted(3, compact=True) for _ in samples]
  loop = AgentLoop(engine_for(model), TOKENIZER, max_turns=4)
  trajectories, metrics = loop.run(envs, samples)
  assert [t.stop for t in trajectories] == ["done"] * 3
  assert metrics["agent/segments/mean"] == 3 and metrics["agent/turns/mean"] == 3
  rows = check_rows_are_the_hand_built_segments(trajectories, envs, samples,
                                                [e.contexts for e in envs], TOKENIZER)
  fresh = RolloutEngine(*model, SAMPLED, slots=1, max_prompt_len=200, key=jax.random.key(1))
  for b, row in enumerate(rows):
    i, turn = b // 3, b % 3
    a = row.model_mask.index(True)
    (want,) = fresh.run([Request(row.token_ids[:a], row=i * 4 + turn)])
    assert row.token_ids[a:] == want.token_ids == envs[i].sampled[turn]
    np.testing.assert_allclose(row.log_probs[a:], want.log_probs, atol=1e-5)
    assert row.prompt_len == len(TOKENIZER.encode_chat([{"role": "user", "content": samples[i]}]))


def test_rewrite_history_follows_a_template_that_drops_reasoning(model):
  """rewrite_history=True re-renders the conversation with the template: where it drops
  the earlier turns' text the turn samples from the rendering, a new segment."""
  tok = DropsReasoning()
  samples = ["What is 2+2?", "Tell me a story about a cat."]
  envs = [Scripted(3) for _ in samples]
  loop = AgentLoop(engine_for(model), tok, max_turns=4, rewrite_history=True)
  trajectories, metrics = loop.run(envs, samples)
  assert metrics["agent/segments/mean"] == 3
  contexts = []
  for q, e in zip(samples, envs):
    history, cs = [{"role": "user", "content": q}], []
    for turn, ids in enumerate(e.sampled[:-1]):
      history += [{"role": "assistant", "content": tok.decode(ids)},
                  {"role": "tool", "content": f"result {turn}"}]
      cs.append(list(history))
    contexts.append(cs)
  check_rows_are_the_hand_built_segments(trajectories, envs, samples, contexts, tok)


def test_an_append_only_history_keeps_its_one_row(model):
  """Without a rewrite the loop keeps today's path: one segment a trajectory, and its
  rows are the rows to_batch_fields makes of the trajectories themselves."""
  samples = ["a", "What is 17 times 3?", "Tell me a story about a cat."]
  envs = [Scripted(3) for _ in samples]
  trajectories, metrics = AgentLoop(engine_for(model), TOKENIZER, max_turns=4).run(envs, samples)
  assert metrics["agent/segments/mean"] == 1
  assert all(not t.segments for t in trajectories)
  rows, owner = trajectory_rows(trajectories)
  assert owner == [0, 1, 2]
  want, got = to_batch_fields(trajectories, 0), to_batch_fields(rows, 0)
  assert got.keys() == want.keys()
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  delta = MessageDelta(TOKENIZER)
  for t, e, q in zip(trajectories, envs, samples):  # prompt, turn, tool message, ...
    ids = TOKENIZER.encode_chat([{"role": "user", "content": q}])
    for turn, sampled in enumerate(e.sampled):
      ids = ids + sampled + (delta.ids([{"role": "tool", "content": f"result {turn}"}])
                             if turn < 2 else [])
    assert t.token_ids == ids


def test_segments_share_their_trajectorys_grpo_advantage():
  """Advantages of segmented trajectories by hand: GRPO over the trajectories (each
  counted once, with its last segment's score), then each segment row gets its
  trajectory's advantage on its own response tokens, padding rows none."""
  import jax.numpy as jnp
  from hflax import algorithms as alg
  from hflax.algorithms.segmented import trajectory_advantages
  # Prompt 0: trajectories A (2 segments: rows 0, 1) and B (row 2); prompt 1: C (row 3)
  # and D (3 segments: rows 4, 5, 6); row 7 pads.
  head = np.asarray([1, 1, 2, 3, 6, 6, 6, -1])
  scores = {1: 1.0, 2: 0.0, 3: 0.5, 6: 2.0}  # on each trajectory's last segment
  T = 5
  mask = np.ones((8, T), np.float32)
  mask[0, 3:] = 0
  mask[7] = 0
  rewards = np.zeros((8, T), np.float32)
  for r, s in scores.items():
    rewards[r, T - 1] = s
  rewards[0, 2] = 9.0  # an earlier segment's own score is not the trajectory's
  fields = {"token_level_rewards": jnp.asarray(rewards), "response_mask": jnp.asarray(mask),
            "group_ids": jnp.asarray([0, 0, 0, 1, 1, 1, 1, 0], jnp.int32)}
  advantages, returns = trajectory_advantages(
      lambda sub: alg.advantage_fn("grpo", {"num_groups": 4})(sub), fields, head)
  eps = 1e-6
  a, b = (1.0 - 0.5) / (np.std([1.0, 0.0], ddof=1) + eps), (0.0 - 0.5) / (
      np.std([1.0, 0.0], ddof=1) + eps)
  c, d = (0.5 - 1.25) / (np.std([0.5, 2.0], ddof=1) + eps), (2.0 - 1.25) / (
      np.std([0.5, 2.0], ddof=1) + eps)
  want = np.asarray([a, a, b, c, d, d, d, 0.0])[:, None] * mask
  np.testing.assert_allclose(np.asarray(advantages), want, rtol=1e-5, atol=1e-6)
  np.testing.assert_array_equal(np.asarray(returns), np.asarray(advantages))
  # A per-token reward: REINFORCE++'s return-to-go differs over the tokens, refused.
  fields["token_level_rewards"] = fields["token_level_rewards"].at[1, 1].set(3.0)
  with pytest.raises(ValueError, match="varies over a response's tokens"):
    trajectory_advantages(lambda sub: alg.advantage_fn("reinforce_plus_plus", {})(sub),
                          fields, head)


class EveryTurnCalls:
  """A test parser: every model turn reads as one calculator call."""

  def parse(self, text):
    from hflax.rollout.agents import tools as tools_module
    return tools_module.ParsedTurn((tools_module.ToolCall("calculator", {"expression": "6*7"}),),
                                   ())


def test_segmented_trajectories_first_minibatch_is_the_samplers_in_float32(monkeypatch):
  """The actor's path with rewrite_history under a template that drops earlier turns'
  text: the rows are segments (more rows than trajectories, padded to the mini-batch),
  the trainer's packed log-prob pass over them (each segment's prompt shared) equals the
  sampler's within 1e-6, and the update's first mini-batch is exactly on-policy."""
  import jax.numpy as jnp
  from hflax.controller.actor import ActorRolloutWorker
  from hflax.controller.batch import Batch
  from hflax.controller.training import OptimConfig, UpdateConfig
  from hflax.rollout.agents import tools as tools_module
  from hflax.rollout.agents.rollout import MultiTurn
  from hflax.sharding.placement import build_placement, colocated
  from ppo_step import actor_loss
  monkeypatch.setitem(tools_module.PARSERS, "every_turn", EveryTurnCalls)
  placed = build_placement(colocated(["actor"], 1))
  home = jax.sharding.SingleDeviceSharding(placed["actor"].pool.devices[0])
  sampling = SamplingParams(max_new_tokens=60, temperature=1.0, n=2, eos_ids=TOKENIZER.eos_ids,
                            pad_id=TOKENIZER.pad_id)
  worker = ActorRolloutWorker(
      placed["actor"], *create(CFG.replace(dtype="float32", param_dtype="float32"), seed=5),
      sampling=sampling, loss_fn=actor_loss, optim=OptimConfig(lr=1e-2, grad_clip=1.0),
      update=UpdateConfig(mini_batch_size=4, micro_batch_size=2, epochs=2), home=home,
      multi_turn=MultiTurn(max_turns=3, turn_tokens=12, format="every_turn",
                           rewrite_history=True), tokenizer="byte")
  worker._tokenizer = DropsReasoning()
  questions = ["What is 12*34?", "a", "Tell me about cats.", "What is 17 times 3?"]
  encoded = [TOKENIZER.encode(q) for q in questions]
  width = max(map(len, encoded))
  batch = Batch({"prompts": jnp.asarray([[0] * (width - len(e)) + e for e in encoded]),
                 "prompt_mask": jnp.asarray([[0] * (width - len(e)) + [1] * len(e)
                                             for e in encoded], bool)},
                {"raw_prompt": [[{"role": "user", "content": q}] for q in questions],
                 "data_source": ["arithmetic_tools"] * 4,
                 "extra_info": [{"index": i} for i in range(4)]})
  # A call with sampling of its own (validation) is scored, not trained: one row a
  # trajectory, its last segment, no segment_head.
  scored = worker.generate_sequences(batch, sampling=sampling, rng=jax.random.key(3))
  assert scored.meta["metrics"]["agent/segments/mean"] > 1.5
  assert len(scored) == 8 and "segment_head" not in scored
  assert [i["index"] for i in scored["extra_info"]] == [0, 0, 1, 1, 2, 2, 3, 3]
  np.testing.assert_array_equal(np.asarray(scored["group_ids"]), [0, 0, 1, 1, 2, 2, 3, 3])
  batch = worker.generate_sequences(batch)
  metrics = batch.meta["metrics"]
  head = np.asarray(batch["segment_head"])
  assert metrics["agent/segments/mean"] > 1.5 and len(batch) % 4 == 0
  assert len(batch) >= 8 * metrics["agent/segments/mean"]
  rows = int((head >= 0).sum())
  assert rows == round(8 * metrics["agent/segments/mean"])
  assert len(set(head[head >= 0].tolist())) == 8  # one last segment a trajectory
  # A trajectory's rows share its prompt's group and extra_info.
  groups = np.asarray(batch["group_ids"])
  infos = batch["extra_info"]
  for r in range(rows):
    assert groups[r] == groups[head[r]] and infos[r] is infos[head[r]]
  assert [i["index"] for i in infos[head[head >= 0]]] == sorted(
      [i["index"] for i in infos[head[head >= 0]]])
  trainer = np.asarray(worker.compute_log_prob(batch)["old_log_probs"])
  sampler = np.asarray(batch["rollout_log_probs"])
  loss_mask = np.asarray(batch["response_mask"], bool)
  assert not loss_mask[rows:].any() and loss_mask.sum() > 40
  diff = np.abs(trainer[loss_mask] - sampler[loss_mask])
  assert diff.max() <= 1e-6, diff.max()
  batch = batch.union(worker.old_log_probs(batch))
  advantages = jnp.asarray(np.random.RandomState(0).randn(*loss_mask.shape).astype(np.float32))
  out = worker.update_actor(batch.union(Batch({"advantages": advantages * loss_mask})))
  metrics = {k: float(v) for k, v in out.meta["metrics"].items()}
  assert metrics["actor/ppo_kl_first_minibatch"] == 0.0
  assert metrics["actor/pg_clipfrac_first_minibatch"] == 0.0


def test_grpo_trains_on_segments_through_the_launcher(tmp_path, monkeypatch):
  """rollout.multi_turn.rewrite_history on the tiny GRPO job, whose template drops the
  earlier turns' text: every trajectory is 2 segments, and one GRPO step trains on them
  exactly on-policy in its first mini-batch."""
  import json as json_
  from hflax.launch import config as config_module
  from hflax.launch.trainer import Trainer
  from hflax.models import tokenizer as tokenizer_module
  from hflax.rollout.agents import tools as tools_module
  from tiny_config import get_config
  monkeypatch.setitem(tools_module.PARSERS, "every_turn", EveryTurnCalls)
  real = tokenizer_module.load_tokenizer
  monkeypatch.setattr(tokenizer_module, "load_tokenizer",
                      lambda spec, *a, **kw: DropsReasoning() if spec == "byte" else real(
                          spec, *a, **kw))
  c = get_config()
  c.data.builtin.update(data_source="arithmetic_tools")
  c.data.update(max_prompt_length=128, max_response_length=80)
  c.rollout.multi_turn.update(enable=True, max_assistant_turns=2, format="every_turn",
                              max_turn_tokens=20, rewrite_history=True)
  c.trainer.update(total_steps=1, run_dir=str(tmp_path / "run"))
  trainer = Trainer(c, log=lambda *_: None)
  trainer.fit()
  (row,) = [json_.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
  assert row["agent/turns/mean"] == 2 and row["agent/tool_calls/mean"] == 2
  assert row["agent/segments/mean"] > 1 and row["agent/segment_rows"] > 8
  assert row["actor/ppo_kl_first_minibatch"] == 0.0
  assert abs(row["actor/ppo_kl"]) < 1e-6
  c.algorithm.adv_estimator = "gae"
  with pytest.raises(ValueError, match="rollout.multi_turn.rewrite_history"):
    config_module.validate(c)


def ends_turns(model, column: int = 37, im_end: int = 260):
  """The model with <|im_end|>'s head column a little above byte `column`'s: greedy turns
  end where the model would write that byte, so they close as the template closes them."""
  from flax import nnx
  graphdef, state = model
  flat = dict(nnx.to_flat_state(state))
  head = flat[("lm_head", "kernel")]
  kernel = np.asarray(head.get_value()).copy()
  kernel[:, im_end] = 1.05 * kernel[:, column]
  flat[("lm_head", "kernel")] = head.replace(jax.numpy.asarray(kernel))
  return graphdef, nnx.from_flat_state(flat)


def test_rewrite_history_keeps_an_append_only_template_on_its_one_row(model):
  """rewrite_history with ChatML (append-only) and turns that end with <|im_end|>: the
  rendering's text is the kept ids' text, so nothing is split and the rows are those of
  the run without the option, although a turn's text encodes to other ids than sampled
  (a byte that is not UTF-8 decodes to U+FFFD): the ids go on as sampled."""
  assert TOKENIZER.decode([260], skip_special_tokens=False) == "<|im_end|>"
  ended = ends_turns(model)
  greedy = SamplingParams(max_new_tokens=24, temperature=0, eos_ids=TOKENIZER.eos_ids,
                          pad_id=TOKENIZER.pad_id)
  samples = ["a", "What is 17 times 3?", "Tell me a story about a cat."]
  runs = {}
  for rewrite in (False, True):
    envs = [Scripted(3) for _ in samples]
    trajectories, metrics = AgentLoop(engine_for(ended, greedy), TOKENIZER, max_turns=4,
                                      rewrite_history=rewrite).run(envs, samples)
    runs[rewrite] = trajectories, metrics, envs
  trajectories, metrics, envs = runs[True]
  turns = [ids for e in envs for ids in e.sampled]
  assert all(ids[-1] == 260 for ids in turns) and metrics["agent/turns/mean"] == 3
  assert any(TOKENIZER.encode(TOKENIZER.decode(ids[:-1])) != ids[:-1] for ids in turns)
  assert metrics["agent/segments/mean"] == 1
  got, want = to_batch_fields(trajectory_rows(trajectories)[0], 0), to_batch_fields(
      runs[False][0], 0)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  # The same turns under a template that drops earlier turns' text: a segment a turn.
  _, metrics = AgentLoop(engine_for(ended, greedy), DropsReasoning(), max_turns=4,
                         rewrite_history=True).run([Scripted(3) for _ in samples], samples)
  assert metrics["agent/segments/mean"] == 3
