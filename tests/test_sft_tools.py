"""The tool task's supervised warm-up: each example is the exchange a rollout holds,
token for token as the agent loop renders it, the loss on the model's two turns only."""
import numpy as np
import pytest

from hflax.data.arithmetic import arithmetic_task
from hflax.launch.sft import _examples
from hflax.launch.sft_tools import tool_use_example
from hflax.models.tokenizer import ByteTokenizer, load_tokenizer
from hflax.rollout.agents import HermesParser, MessageDelta, ToolCall
from hflax.rollout.agents.rollout import MultiTurn, environments


@pytest.mark.parametrize("name", ["byte", "smollm2-135m-instruct"])
def test_a_warmup_example_is_the_rollouts_exchange(name):
  tokenizer = ByteTokenizer() if name == "byte" else load_tokenizer(name)
  train, _ = arithmetic_task(4, 0, digits=(3, 3), ops="*", data_source="arithmetic_tools")
  row = train[0]
  a, b = (int(x) for x in row["prompt"][0]["content"].split("?")[0][8:].split("*"))
  prompt, answer, loss = tool_use_example(row, tokenizer)
  # The prompt the rollout renders: the calculator's schema in the system message.
  env = environments(MultiTurn(), ["arithmetic_tools"])[0]
  assert prompt == tokenizer.encode_chat(env.reset({"prompt": row["prompt"]}),
                                         add_generation_prompt=True)
  eos = tokenizer.eos_ids[0]
  first_end = answer.index(eos) + 1
  first = tokenizer.decode(answer[:first_end], skip_special_tokens=True)
  assert HermesParser().parse(first).calls == (ToolCall("calculator",
                                                         {"expression": f"{a}*{b}"}),)
  between = MessageDelta(tokenizer).ids([{"role": "tool", "content": str(a * b)}])
  assert answer[first_end:first_end + len(between)] == between
  final = answer[first_end + len(between):]
  assert final == tokenizer.encode(str(a * b)) + [eos]
  assert loss == [1] * first_end + [0] * len(between) + [1] * len(final)
  # Through the warm-up's batch: left-padded, the loss mask on the model's turns alone.
  tokens, mask, loss_mask = _examples([row], tokenizer, 2048, 256)
  real = tokens[0][mask[0]].tolist()
  assert real == prompt + answer
  np.testing.assert_array_equal(loss_mask[0][mask[0]], [0] * len(prompt) + loss)


def test_a_row_without_a_question_is_refused():
  row = {"data_source": "arithmetic_tools", "prompt": [{"role": "user", "content": "Hi"}],
         "reward_model": {"ground_truth": "1"}}
  with pytest.raises(ValueError, match="no 'What is <a><op><b>\\?' question"):
    tool_use_example(row, ByteTokenizer())


def test_the_tool_recipe_passes_the_launchers_checks():
  from hflax.configs.grpo_smollm2_tools import get_config
  from hflax.launch.config import validate
  from hflax.launch.roles import read_model_configs
  c = get_config()
  validate(c)
  assert read_model_configs(c).vocab_size == 49152  # the GGUF's metadata, no weights
  assert c.rollout.multi_turn.enable and c.data.builtin.data_source == "arithmetic_tools"
  assert c.trainer.sft_warmup.steps > 0  # the model as shipped never calls the tool
