"""Multi-turn agents on the rollout engine: token in and token out, exactly on-policy."""
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from hflax.models import ModelConfig, create
from hflax.models.logprobs import sequence_log_probs
from hflax.models.tokenizer import ByteTokenizer, load_tokenizer
from hflax.rollout import Request, RolloutEngine, SamplingParams
from hflax.rollout.agents import (AgentLoop, FunctionTool, HermesParser, MessageDelta,
                                  Observation, ToolCall, ToolEnvironment, Turn, Trajectory,
                                  to_batch_fields)

TOKENIZER = ByteTokenizer()
CFG = ModelConfig(vocab_size=264, hidden_size=32, intermediate_size=64, num_layers=2,
                  num_heads=4, num_kv_heads=2)


@pytest.fixture(scope="module")
def model():
  return create(CFG, seed=5)


class Scripted:
  """Answers every turn with a tool message; done (reward 1) after `turns` turns."""

  def __init__(self, turns: int):
    self.turns = turns

  def reset(self, sample):
    return [{"role": "user", "content": sample}]

  def step(self, turn: Turn) -> Observation:
    if turn.index + 1 == self.turns:
      return Observation([], reward=1.0, done=True)
    return Observation([{"role": "tool", "content": f"result {turn.index}: {len(turn.text)}"}],
                       counts={"tool_calls": 1})


def engine_for(model, params, **kw):
  return RolloutEngine(*model, params, slots=4, steps_per_call=4, max_prompt_len=64,
                       max_turn_len=40, max_context_len=200, key=jax.random.key(1), **kw)


GREEDY = SamplingParams(max_new_tokens=10, temperature=0, eos_ids=TOKENIZER.eos_ids,
                        pad_id=TOKENIZER.pad_id)
SAMPLED = SamplingParams(max_new_tokens=10, temperature=1.0, eos_ids=TOKENIZER.eos_ids,
                         pad_id=TOKENIZER.pad_id)


def run_loop(model, params, samples, turns=3, **kw):
  loop = AgentLoop(engine_for(model, params), TOKENIZER, max_turns=4, **kw)
  return loop.run([Scripted(turns) for _ in samples], samples)


@pytest.mark.parametrize("params", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_every_turn_samples_what_a_fresh_request_for_its_context_does(model, params):
  """Token exactness: each model turn's ids are those a fresh request for the whole
  context before it samples (same key and row), and the ids between turns are the
  template's rendering of the messages alone."""
  samples = ["What is 2+2?", "Name a colour.", "Count to three, slowly please."]
  trajectories, metrics = run_loop(model, params, samples)
  delta = MessageDelta(TOKENIZER)
  fresh = RolloutEngine(*model, params, slots=1, max_prompt_len=200, key=jax.random.key(1))
  for t in trajectories:
    assert t.stop == "done" and len(t.turns) == 3 and t.rewards == [1.0]
    mask = np.asarray(t.model_mask)
    starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
    ends = np.flatnonzero(mask & ~np.concatenate([mask[1:], [False]])) + 1
    assert len(starts) == 3
    for turn, (a, b) in enumerate(zip(starts, ends)):
      (want,) = fresh.run([Request(t.token_ids[:a], row=t.index * 4 + turn)])
      assert t.token_ids[a:b] == want.token_ids
      np.testing.assert_allclose(t.log_probs[a:b], want.log_probs, atol=1e-5)
      if turn < 2:  # the tool message follows, as the template renders it
        message = {"role": "tool", "content": f"result {turn}: {len(t.turns[turn])}"}
        nxt = starts[turn + 1]
        assert t.token_ids[b:nxt] == delta.ids([message])
        assert TOKENIZER.decode(t.token_ids[b:nxt], skip_special_tokens=False) == (
            "\n<|im_start|>tool\n" + message["content"] + "<|im_end|>\n<|im_start|>assistant\n")
  assert metrics["agent/turns/mean"] == 3 and metrics["agent/stop/done"] == 1
  assert metrics["agent/tool_calls/mean"] == 2


def test_trajectory_log_probs_are_the_trainers_in_float32(model):
  """The trainer's teacher-forced log-probs of whole trajectories (one row each, the
  observations masked out of the loss) equal the sampler's: on-policy across turns."""
  samples = ["a", "bb", "What is 17 times 3?", "Tell me a story about a cat."]
  trajectories, _ = run_loop(model, SAMPLED, samples)
  fields = to_batch_fields(trajectories, TOKENIZER.pad_id)
  logp, _ = sequence_log_probs(*model, jnp.asarray(fields["input_ids"]),
                               jnp.asarray(fields["attention_mask"]))
  P = fields["prompts"].shape[1]
  mask = fields["response_mask"]
  trainer = np.asarray(logp[:, P:])[mask]
  sampler = fields["rollout_log_probs"][mask]
  assert mask.sum() == sum(sum(t.model_mask) for t in trajectories)
  # Float32 rounding of the logits only (the log-softmax is the trainer's, see
  # test_trajectory_first_minibatch_is_the_samplers_in_float32): within 2 ulps of the
  # largest log-prob (this random model's are near -log(264), where an ulp is 4.8e-7);
  # 0 where the sums happen to agree.
  diff = np.abs(trainer - sampler)
  assert diff.max() <= 2 * np.spacing(np.abs(sampler).max()), diff.max()
  assert np.mean(diff == 0) > 0.3
  assert abs(float(np.mean(sampler - trainer))) <= 1e-7  # the mismatch ppo_kl would report


def test_loss_mask_covers_exactly_the_models_tokens():
  t = Trajectory(0, [], [], [], [], prompt_len=3)
  t.append([1, 2, 3], model=False)
  t.append([10, 11], model=True, log_probs=[-0.5, -0.25], versions=[2, 2])
  t.append([20, 21, 22], model=False)
  t.append([12], model=True, log_probs=[-1.0], versions=[3])
  fields = to_batch_fields([t], pad_id=0, prompt_width=4, response_width=8)
  np.testing.assert_array_equal(fields["prompts"], [[0, 1, 2, 3]])
  np.testing.assert_array_equal(fields["responses"], [[10, 11, 20, 21, 22, 12, 0, 0]])
  np.testing.assert_array_equal(fields["response_mask"], [[1, 1, 0, 0, 0, 1, 0, 0]])
  np.testing.assert_array_equal(fields["attention_mask"], [[0, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0]])
  np.testing.assert_array_equal(fields["rollout_log_probs"], [[-0.5, -0.25, 0, 0, 0, -1, 0, 0]])
  np.testing.assert_array_equal(fields["rollout_versions"], [[2, 2, -1, -1, -1, 3, -1, -1]])
  np.testing.assert_array_equal(fields["position_ids"][0, 1:10], np.arange(9))


def test_limits_say_which_stopped_a_trajectory(model):
  trajectories, metrics = run_loop(model, GREEDY, ["x", "y"], turns=9)
  assert [t.stop for t in trajectories] == ["max_turns"] * 2
  assert all(len(t.turns) == 4 for t in trajectories)
  trajectories, metrics = run_loop(model, GREEDY, ["x"], turns=9, max_tokens=100)
  assert trajectories[0].stop == "max_tokens" and len(trajectories[0].token_ids) < 100
  assert metrics["agent/stop/max_tokens"] == 1


def test_tools_run_while_other_trajectories_decode(model):
  """A slow environment step does not hold up the engine: another trajectory's turns
  decode while it runs."""
  release = threading.Event()
  decoded_meanwhile = []

  class Slow(Scripted):
    def step(self, turn):
      if turn.index == 0:
        release.wait(timeout=60)
      return super().step(turn)

  class Fast(Scripted):
    def step(self, turn):
      decoded_meanwhile.append(turn.index)
      if turn.index == 2:
        release.set()
      return super().step(turn)

  loop = AgentLoop(engine_for(model, GREEDY), TOKENIZER, max_turns=4)
  trajectories, metrics = loop.run([Slow(2), Fast(3)], ["slow one", "fast one"])
  assert decoded_meanwhile == [0, 1, 2]  # all three fast turns ran while the slow tool waited
  assert [t.stop for t in trajectories] == ["done", "done"]
  assert metrics["timing_s/agent_decode_seconds"] > 0


def test_hermes_parser():
  parse = HermesParser().parse
  got = parse('I will add. <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>'
              '<tool_call>\n{"name": "mul", "arguments": "{\\"a\\": 3}"}\n</tool_call>')
  assert got.calls == (ToolCall("add", {"a": 1, "b": 2}), ToolCall("mul", {"a": 3}))
  assert got.errors == ()
  bad = parse('<tool_call>{"name": add}</tool_call><tool_call>{"arguments": {}}</tool_call>'
              '<tool_call>{"name": "f", "arguments": [1]}</tool_call>')
  assert bad.calls == () and len(bad.errors) == 3
  assert "not valid JSON" in bad.errors[0] and "needs a string" in bad.errors[1]
  assert "must be a JSON object" in bad.errors[2]
  assert parse("The answer is 4.").calls == ()


def test_tool_environment_reports_every_failure_as_the_tools_text():
  def divide(a, b):
    return a / b

  def slow():
    time.sleep(5)

  tools = [FunctionTool(divide, "divide", "a / b", {"type": "object", "properties": {
      "a": {"type": "number"}, "b": {"type": "number"}}}),
           FunctionTool(slow, "slow", "sleeps", {"type": "object", "properties": {}})]
  env = ToolEnvironment(tools, reward_fn=lambda text, sample: float("4" in text),
                        tool_timeout_s=0.2)
  messages = env.reset({"prompt": [{"role": "user", "content": "What is 8/2?"}]})
  assert messages[0]["role"] == "system" and '"name": "divide"' in messages[0]["content"]
  call = '<tool_call>{"name": "%s", "arguments": %s}</tool_call>'
  obs = env.step(Turn(call % ("divide", '{"a": 8, "b": 2}') + call % ("divide", '{"a": 1, "b": 0}')
                      + call % ("nope", "{}") + call % ("divide", '{"x": 1}')
                      + call % ("slow", "{}") + "<tool_call>{oops</tool_call>", (), 0))
  contents = [m["content"] for m in obs.messages]
  assert contents[0].startswith("Error: tool call is not valid JSON")  # parse errors first
  assert contents[1] == "4.0"
  assert contents[2] == "Error: ZeroDivisionError: division by zero"
  assert contents[3].startswith("Error: unknown tool 'nope'")
  assert contents[4].startswith("Error: TypeError")
  assert contents[5] == "Error: tool 'slow' timed out after 0.2 s"
  assert obs.counts["tool_calls"] == 6 and obs.counts["tool_errors"] == 5
  assert obs.counts["tool_timeouts"] == 1 and not obs.done
  final = env.step(Turn("It is 4.", (), 1))
  assert final.done and final.reward == 1.0 and final.messages == []


def test_message_delta_on_smollm2s_template():
  tokenizer = load_tokenizer("smollm2-135m-instruct")
  delta = MessageDelta(tokenizer)
  message = {"role": "tool", "content": "42"}
  text = delta.text([message])
  history = [{"role": "user", "content": "What is 6*7?"},
             {"role": "assistant", "content": '<tool_call>{"name": "calc"}</tool_call>'}]
  rendered = tokenizer.apply_chat_template(history + [message], add_generation_prompt=True)
  before = tokenizer.apply_chat_template(history, add_generation_prompt=False)
  end = "<|im_end|>"
  assert rendered == before[:before.rindex(end) + len(end)] + text
  assert delta.ids([message]) == tokenizer.encode(text)


VERL_TOOL_CONFIG = """
tools:
  - class_name: "verl.tools.gsm8k_tool.Gsm8kTool"
    config:
      type: native
    tool_schema:
      type: "function"
      function:
        name: "calc_gsm8k_reward"
        description: "A tool for calculating the reward of gsm8k"
        parameters:
          type: "object"
          properties:
            expression:
              type: "string"
          required: ["expression"]
  - class_name: "verl.tools.sandbox_fusion_tools.SandboxFusionTool"
    config:
      sandbox_fusion_url: "https://example.invalid/run_code"
      num_workers: 10
    tool_schema:
      type: "function"
      function:
        name: "code_interpreter"
        description: "A tool for executing code."
        parameters:
          type: "object"
          properties:
            code:
              type: "string"
          required: ["code"]
  - class_name: "hflax.rollout.agents.tool_config.Calculator"
"""


def test_a_verl_tool_config_file_loads_unchanged(tmp_path):
  from hflax.rollout.agents.tool_config import load_tools
  path = tmp_path / "tools.yaml"
  path.write_text(VERL_TOOL_CONFIG)
  tools = load_tools(str(path))
  names = [t.schema["function"]["name"] for t in tools]
  assert names == ["calc_gsm8k_reward", "code_interpreter", "calculator"]
  env = ToolEnvironment(tools)
  obs = env.step(Turn('<tool_call>{"name": "code_interpreter", "arguments": {"code": '
                      '"print(6 * 7)"}}</tool_call><tool_call>{"name": "calculator", '
                      '"arguments": {"expression": "347*29"}}</tool_call>', (), 0))
  assert [m["content"] for m in obs.messages] == ["42", "10063"]
  for text, message in (("tools: []", "non-empty 'tools:' list"),
                        ("tools: [{class_name: no.such.Tool}]", "cannot import class_name"),
                        ("tools: [{config: {}}]", "needs a class_name"),
                        ("tools: [", "not valid YAML")):
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
      load_tools(str(path))


def test_calculator_evaluates_arithmetic_only():
  from hflax.rollout.agents.tool_config import Calculator
  calc = Calculator()
  assert calc.execute({"expression": "347 * 29"}) == "10063"
  assert calc.execute({"expression": "(2 + 3) / 4 - -1"}) == "2.25"
  for bad in ("__import__('os').system('true')", "2 ** 100", "10 ** 13", "x + 1"):
    with pytest.raises(ValueError):
      calc.execute({"expression": bad})


def test_multi_turn_rollout_gives_the_trainer_one_row_a_trajectory(model):
  from hflax.rewards.rules import arithmetic_tool_answer
  from hflax.rollout.agents.rollout import MultiTurn, multi_turn_rollout
  raw = [[{"role": "user", "content": f"What is {a}*{b}? Use the calculator tool."}]
         for a, b in ((12, 34), (56, 78), (9, 10))]
  params = SamplingParams(max_new_tokens=99, temperature=1.0, n=2, eos_ids=TOKENIZER.eos_ids,
                          pad_id=TOKENIZER.pad_id)
  fields, infos, metrics = multi_turn_rollout(
      *model, version=3, mesh=None, sampling=params, settings=MultiTurn(max_turns=2),
      tokenizer=TOKENIZER, raw_prompts=raw, data_sources=["arithmetic_tools"] * 3,
      extra_info=[{"index": i} for i in range(3)], rng=jax.random.key(0), response_width=24)
  assert fields["responses"].shape == (6, 24) and fields["prompts"].shape[0] == 6
  assert [i["index"] for i in infos] == [0, 0, 1, 1, 2, 2]  # prompt-major, n each
  for info in infos:  # a random model calls no tool: its answer earns nothing
    assert info["agent"]["turns"] >= 1 and info["agent"]["stop"] in ("done", "context")
    assert arithmetic_tool_answer("", "408", info) == 0.0
  versions = fields["rollout_versions"][fields["response_mask"]]
  assert (versions == 3).all() and fields["response_mask"].any()
  prompt = TOKENIZER.decode(fields["prompts"][0], skip_special_tokens=False)
  assert '"name": "calculator"' in prompt  # the tools in the system message
  assert metrics["agent/turns/mean"] >= 1
  with pytest.raises(ValueError, match="data source 'gsm8k' has no built-in tools"):
    multi_turn_rollout(*model, version=0, mesh=None, sampling=params, settings=MultiTurn(),
                       tokenizer=TOKENIZER, raw_prompts=raw[:1], data_sources=["gsm8k"],
                       extra_info=[None], rng=jax.random.key(0), response_width=24)


def test_grpo_trains_on_multi_turn_trajectories_through_the_launcher(tmp_path, monkeypatch):
  """rollout.multi_turn.enable on the tiny GRPO job: every turn of the random model is read
  as a calculator call (a test parser), so each trajectory runs its 2 turns with a tool
  message between; the update trains on them exactly on-policy (float32)."""
  import json as json_
  from hflax.launch.trainer import Trainer
  from hflax.rollout.agents import tools as tools_module
  from tiny_config import get_config

  class EveryTurnCalls:
    def parse(self, text):
      return tools_module.ParsedTurn((ToolCall("calculator", {"expression": "6*7"}),), ())

  monkeypatch.setitem(tools_module.PARSERS, "every_turn", EveryTurnCalls)
  c = get_config()
  c.data.builtin.update(data_source="arithmetic_tools")
  c.data.update(max_prompt_length=128, max_response_length=80)
  c.rollout.multi_turn.update(enable=True, max_assistant_turns=2, format="every_turn",
                              max_turn_tokens=20)
  c.trainer.update(total_steps=2, run_dir=str(tmp_path / "run"))
  trainer = Trainer(c, log=lambda *_: None)
  trainer.fit()
  rows = [json_.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
  for row in rows:
    assert row["agent/turns/mean"] == 2 and row["agent/tool_calls/mean"] == 2  # both turns
    assert row["agent/stop/max_turns"] == 1 and row["agent/tool_tokens/mean"] > 0
    assert abs(row["actor/ppo_kl"]) < 1e-6  # on-policy to float32 rounding
    assert row["critic/score/mean"] == 0.0  # no final answer after the tool: no reward


class EveryTurnCalls:
  """A test parser: every model turn reads as one calculator call, so each trajectory of a
  random model has tool messages between its turns."""

  def parse(self, text):
    from hflax.rollout.agents import tools as tools_module
    return tools_module.ParsedTurn((ToolCall("calculator", {"expression": "6*7"}),), ())


def multi_turn_actor(dtype: str, monkeypatch):
  """An fp32-master actor computing in `dtype` whose generate_sequences runs 3-turn
  trajectories with a calculator message between turns (the launcher's path)."""
  from hflax.controller.actor import ActorRolloutWorker
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
  return ActorRolloutWorker(
      placed["actor"], *create(CFG.replace(dtype=dtype, param_dtype="float32"), seed=5),
      sampling=sampling, loss_fn=actor_loss, optim=OptimConfig(lr=1e-2, grad_clip=1.0),
      update=UpdateConfig(mini_batch_size=4, micro_batch_size=2, epochs=2), home=home,
      multi_turn=MultiTurn(max_turns=3, turn_tokens=12, format="every_turn"), tokenizer="byte")


def trajectory_update(dtype: str, monkeypatch):
  """One multi-turn rollout of 4 prompts x 2 through the actor, the trainer's packed
  log-prob pass over it, and one update (2 mini-batches x 2 epochs): (sampler log-probs,
  trainer log-probs, loss mask, the update's metrics)."""
  from hflax.controller.batch import Batch
  worker = multi_turn_actor(dtype, monkeypatch)
  questions = ["What is 12*34?", "a", "Tell me about cats.", "What is 17 times 3?"]
  raw = [[{"role": "user", "content": q}] for q in questions]
  encoded = [TOKENIZER.encode(q) for q in questions]
  width = max(map(len, encoded))
  tokens = np.asarray([[TOKENIZER.pad_id] * (width - len(e)) + e for e in encoded], np.int32)
  prompt_mask = np.asarray([[0] * (width - len(e)) + [1] * len(e) for e in encoded], bool)
  batch = Batch({"prompts": jnp.asarray(tokens), "prompt_mask": jnp.asarray(prompt_mask)},
                {"raw_prompt": raw, "data_source": ["arithmetic_tools"] * 4,
                 "extra_info": [{"index": i} for i in range(4)]})
  batch = worker.generate_sequences(batch)
  assert batch.meta["metrics"]["agent/tool_calls/mean"] >= 1  # tool messages between turns
  trainer = np.asarray(worker.compute_log_prob(batch)["old_log_probs"])
  sampler = np.asarray(batch["rollout_log_probs"])
  loss_mask = np.asarray(batch["response_mask"], bool)
  batch = batch.union(worker.old_log_probs(batch))
  rs = np.random.RandomState(0)
  advantages = jnp.asarray(rs.randn(*loss_mask.shape).astype(np.float32)) * loss_mask
  metrics = worker.update_actor(batch.union(Batch({"advantages": advantages}))).meta["metrics"]
  return sampler[loss_mask], trainer[loss_mask], loss_mask, {k: float(v) for k, v in metrics.items()}


def test_trajectory_first_minibatch_is_the_samplers_in_float32(monkeypatch):
  """fp32: the trainer's packed log-prob pass over multi-turn trajectories equals the
  sampler's to within 1e-6, and the update's first mini-batch is exactly on-policy.

  The sampler computes each token's log-prob with the trainer's own log-softmax
  (decoding.chosen_log_probs is chunked_head.softmax_stats), so for equal logits the two
  are bit-equal. What remains is the logits themselves: a decode step multiplies a few
  rows (the engine's slots) where the trainer multiplies a whole packed row, and on CPU
  the head and the layers' kernels put the table on the left for few rows
  (matmul.rows_by_kernel), both of which add the same products in another order; the
  attention sums over the cache's columns where the trainer sums over the packed row's.
  That is one float32 rounding of a logit, so at most a few ulps of a log-prob: this
  model's log-probs are near -log(264) = -5.6, where an ulp is 4.8e-7, and 1e-6 is two."""
  sampler, trainer, mask, metrics = trajectory_update("float32", monkeypatch)
  diff = np.abs(sampler - trainer)
  assert diff.max() <= 1e-6, diff.max()
  assert np.mean(diff == 0) > 0.3  # most tokens bit-equal
  # The mismatch KL a PPO step would see had it taken the sampler's log-probs: float noise.
  assert abs(float(np.mean(sampler - trainer))) <= 1e-7
  # The update's first mini-batch takes its own forward as the behaviour policy.
  assert metrics["actor/ppo_kl_first_minibatch"] == 0.0
  assert metrics["actor/pg_clipfrac_first_minibatch"] == 0.0
  assert mask.sum() > 40  # three model turns of several rows each


def test_trajectory_first_minibatch_within_bf16_rounding(monkeypatch):
  """bf16 compute: the sampler's log-probs are within bf16 rounding of the trainer's
  recomputed ones (the decode step and the packed pass round their bf16 matmuls apart),
  and the update's first mini-batch is still exactly on-policy (its behaviour policy is
  the recomputed pass, see update_engine.FRESH).

  The bound: bf16 keeps 8 significant bits, so a matmul output of magnitude ~1 rounds by
  up to 2^-9 ~ 0.002, and the two paths round different partial sums; a log-prob moves
  by at most twice its logits' largest move. Measured here: max 0.002, mean 0.0003; the
  test allows 0.01 and 0.002 (a few such roundings), well under what a real bug (a
  wrong token, position or mask: differences of order 1) gives."""
  sampler, trainer, _, metrics = trajectory_update("bfloat16", monkeypatch)
  diff = np.abs(sampler - trainer)
  assert diff.max() <= 0.01, diff.max()
  assert diff.mean() <= 0.002, diff.mean()
  assert diff.max() > 0  # the bf16 paths really round apart
  assert metrics["actor/ppo_kl_first_minibatch"] == 0.0
  assert metrics["actor/pg_clipfrac_first_minibatch"] == 0.0


def test_tool_config_is_loaded_once_per_run(tmp_path, monkeypatch):
  """multi_turn_rollout's environments read a tool file once: later steps share its tool
  objects, until the file changes on disk."""
  from hflax.rollout.agents import rollout as rollout_module
  from hflax.rollout.agents.rollout import MultiTurn, environments
  path = tmp_path / "tools.yaml"
  path.write_text(VERL_TOOL_CONFIG)
  reads = []
  real = rollout_module.load_tools
  monkeypatch.setattr(rollout_module, "load_tools",
                      lambda p, **kw: reads.append(p) or real(p, **kw))
  settings = MultiTurn(tool_config_path=str(path))
  first = environments(settings, ["gsm8k"] * 3)
  second = environments(settings, ["gsm8k"] * 2)
  assert len(reads) == 1
  assert second[0].tools["calculator"] is first[2].tools["calculator"]
  path.write_text(VERL_TOOL_CONFIG.replace('name: "code_interpreter"', 'name: "python"'))
  os.utime(path, ns=(1, 1))  # a different modification time, whatever the clock's grain
  third = environments(settings, ["gsm8k"])
  assert len(reads) == 2 and "python" in third[0].tools
  assert third[0].tools["calculator"] is not first[0].tools["calculator"]
  path.unlink()
  with pytest.raises(ValueError, match="no such file"):
    environments(settings, ["gsm8k"])


def dropped_reasoning_trajectory(seed: int):
  """A hand-built 2-turn trajectory under a Qwen3-style template that drops an earlier
  turn's <think> reasoning: the second turn's context renders the first answer without
  it, so the history is two segments sharing the system and user prompt."""
  rs = np.random.RandomState(seed)
  messages = [{"role": "system", "content": "Use the calculator."},
              {"role": "user", "content": f"What is {rs.randint(100, 999)}*{rs.randint(10, 99)}?"}]
  prompt = TOKENIZER.encode_chat(messages, add_generation_prompt=True)
  answer = '<tool_call>{"name": "calculator"}</tool_call>'
  turn1 = TOKENIZER.encode("<think>multiply it</think>" + answer) + [TOKENIZER.eos_ids[0]]
  tool = {"role": "tool", "content": "42"}
  first = Trajectory(0, [], [], [], [], len(prompt))
  first.append(prompt, model=False)
  first.append(turn1, model=True, log_probs=[-1.0] * len(turn1), versions=[0] * len(turn1))
  first.append(MessageDelta(TOKENIZER).ids([tool]), model=False)
  # The template renders turn 1 again without its reasoning: a context of its own.
  context = TOKENIZER.encode_chat(messages + [{"role": "assistant", "content": answer}, tool],
                                  add_generation_prompt=True)
  turn2 = TOKENIZER.encode(f"It is {rs.randint(1000, 99999)}.") + [TOKENIZER.eos_ids[0]]
  second = Trajectory(0, [], [], [], [], len(context))
  second.append(context, model=False)
  second.append(turn2, model=True, log_probs=[-1.0] * len(turn2), versions=[0] * len(turn2))
  assert second.token_ids[:len(first.token_ids)] != first.token_ids  # not append-only
  return [first, second], len(prompt)


def test_a_non_append_only_history_trains_as_its_segments_computed_separately(model):
  """Two trajectories whose templates dropped earlier reasoning, as segments sharing their
  prompt: packed with the prompt once (the trainer's packed pass with shared prefixes),
  the loss and its gradient equal those of every segment run as a row of its own."""
  from hflax.controller.packing import micro_batch_plans, prompt_groups
  from hflax.controller.update_engine import packed_fields
  from hflax.models.logprobs import packed_log_probs
  from hflax.rollout.agents.segments import segment_rows, shared_prefix
  graphdef, state = model
  trajectories, prompt_lens = zip(*(dropped_reasoning_trajectory(s) for s in (0, 1)))
  assert [shared_prefix(t) for t in trajectories] == list(prompt_lens)
  rows, owner = segment_rows(trajectories)
  assert owner == [0, 0, 1, 1]
  fields = to_batch_fields(rows, TOKENIZER.pad_id)
  ids, mask = fields["input_ids"], fields["attention_mask"]
  P, W = fields["prompts"].shape[1], fields["responses"].shape[1]
  # Each row is its segment's ids exactly, the loss mask on its model tokens.
  for b, s in enumerate(rows):
    assert ids[b][mask[b]].tolist() == s.token_ids
    assert fields["responses"][b][fields["response_mask"][b]].tolist() == [
        x for x, m in zip(s.token_ids, s.model_mask) if m]
  plan = micro_batch_plans(mask, multiple=1, prompts=prompt_groups(ids, mask, P),
                           prompt_width=P)[0]
  assert plan.shared_prompt_tokens == sum(prompt_lens)  # each prompt packed once, not twice
  arrays = {k: jnp.asarray(v) for k, v in plan.arrays(True).items()}
  slot_mask = jnp.asarray(mask)[arrays["seq_rows"]] * arrays["member"][:, None]
  packed = packed_fields(jnp.asarray(ids), slot_mask, arrays, W)
  weights = np.random.RandomState(0).randn(*fields["responses"].shape).astype(np.float32)
  weights = weights * fields["response_mask"]  # an advantage per model token

  def packed_loss(state):
    logp, _ = packed_log_probs(graphdef, state, packed["packed_tokens"], packed["segment_ids"],
                               packed["response_index"], packed["response_valid"],
                               positions_RxL=packed["positions"],
                               prefix_ids_RxL=packed["prefix_ids"],
                               before_index_BxW=packed["response_before"])
    return -jnp.sum(logp * jnp.asarray(weights)[arrays["seq_rows"]] *
                    arrays["member"][:, None])

  def separate_loss(state):  # each segment alone: its whole ids, no padding, no sharing
    total = 0.0
    for b, s in enumerate(rows):
      tokens = jnp.asarray([s.token_ids])
      logp, _ = sequence_log_probs(graphdef, state, tokens, jnp.ones_like(tokens))
      w = np.zeros(len(s.token_ids), np.float32)
      w[s.prompt_len:] = weights[b][:len(s.token_ids) - s.prompt_len]
      total = total - jnp.sum(logp[0] * w)
    return total

  # Each side one compiled program: run op by op, the separate rows' passes compiled every
  # operation for each of their four lengths.
  got, got_grad = jax.jit(jax.value_and_grad(packed_loss))(state)
  want, want_grad = jax.jit(jax.value_and_grad(separate_loss))(state)
  np.testing.assert_allclose(float(got), float(want), rtol=1e-6)
  flat_got = jax.tree.leaves(got_grad)
  flat_want = jax.tree.leaves(want_grad)
  assert len(flat_got) == len(flat_want) > 0
  for a, b in zip(flat_got, flat_want):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=2e-6)
  assert max(float(jnp.abs(a).max()) for a in flat_got) > 1e-3  # a real gradient
