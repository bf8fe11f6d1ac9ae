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
