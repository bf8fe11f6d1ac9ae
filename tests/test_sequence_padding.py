"""The padded (use_remove_padding=False) passes skip the prompt columns that are padding in
every row: a PPO step on prompts padded to a config's max_prompt_length computes what the
step on their own bucket computes, with the same compiled programs."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ppo_step import build_workers, ppo_step, prompts_batch
from hflax.controller.batch import Batch
from hflax.controller.protocol import without_shared_padding
from hflax.sharding.placement import colocated

EXTRA = 24  # pad columns in front of prompts that fit their 8-column bucket


def sequences(prompt_lengths, prompt_width, response_width=4):
  rows = [[0] * (prompt_width - p) + [1] * (p + 2) + [0] * (response_width - 2)
          for p in prompt_lengths]
  mask = np.asarray(rows, np.int32)
  tokens = np.where(mask > 0, np.arange(mask.size).reshape(mask.shape) % 50 + 1, 0)
  return Batch({"input_ids": tokens.astype(np.int32), "attention_mask": mask,
                "position_ids": np.maximum(np.cumsum(mask, 1) - 1, 0),
                "responses": tokens[:, prompt_width:], "response_mask": mask[:, prompt_width:]})


def test_cuts_only_columns_padded_in_every_row_keeping_the_prompt_bucket():
  batch = sequences([5, 11, 2, 8], prompt_width=40)
  out = without_shared_padding(batch)
  for k in ("input_ids", "attention_mask", "position_ids"):  # 12 prompt columns + 4
    assert out[k].shape == (4, 16), k  # 11 prompt tokens: bucket 12 (3/4 of 16)
    np.testing.assert_array_equal(out[k], np.asarray(batch[k])[:, 28:], err_msg=k)
  assert not batch["attention_mask"][:, :28].any()
  assert out["responses"] is batch["responses"] and out["response_mask"] is batch["response_mask"]
  # Nothing to cut: a prompt fills the width, prompts already at their bucket, no responses.
  for same in (sequences([40, 3], 40), sequences([5, 8], 8),
               Batch({k: v for k, v in batch.arrays.items() if k != "responses"})):
    assert without_shared_padding(same) is same


def widened(prompts: Batch) -> Batch:
  pad = lambda x: jnp.pad(jnp.asarray(x), ((0, 0), (EXTRA, 0)))  # noqa: E731
  return Batch({"prompts": pad(prompts["prompts"]), "prompt_mask": pad(prompts["prompt_mask"])})


ROLE_PROGRAMS = {"jit(_generate)", "jit(fn)", "jit(stage)", "jit(cut_and_step)"}


@pytest.fixture
def compiled():
  """The names of the programs XLA compiles while the test runs."""
  names = []

  def listen(event, _, fun_name=None, **kw):
    if event.endswith("backend_compile_duration"):
      names.append(fun_name)
  jax.monitoring.register_event_duration_secs_listener(listen)
  yield names
  jax.monitoring.unregister_event_duration_listener(listen)


def test_ppo_step_on_wide_prompts_is_the_bucket_width_step_without_new_programs(compiled):
  """Workers A: a step on 8-column prompts, then one on the next prompts padded to 32.
  Workers B: both steps on 8 columns. A's second step compiles none of the role programs
  (generation, log-probs, values, reward, updates) and equals B's bit for bit."""
  spec = colocated(["actor", "ref", "critic", "reward"], 2)
  first, second = prompts_batch(seed=0), prompts_batch(seed=1)
  assert second["prompts"].shape[1] == 8
  a, b = build_workers(spec), build_workers(spec)
  ppo_step(a, first)
  assert ROLE_PROGRAMS <= set(compiled)  # the names this test watches are the right ones
  before = len(compiled)
  got, got_metrics = ppo_step(a, widened(second))
  assert not ROLE_PROGRAMS & set(compiled[before:]), compiled[before:]
  ppo_step(b, first)
  want, want_metrics = ppo_step(b, second)
  assert got["input_ids"].shape[1] == want["input_ids"].shape[1] + EXTRA
  for k in ("responses", "response_mask", "token_level_scores", "old_log_probs",
            "ref_log_prob", "values", "advantages"):
    np.testing.assert_array_equal(np.asarray(got[k]), np.asarray(want[k]), err_msg=k)
  for k in [k for k in want_metrics if not k.startswith("timing")]:
    np.testing.assert_array_equal(np.asarray(got_metrics[k]), np.asarray(want_metrics[k]),
                                  err_msg=k)
  for role in ("actor", "critic"):
    for x, y in zip(jax.tree.leaves(a[role].params), jax.tree.leaves(b[role].params)):
      np.testing.assert_array_equal(np.asarray(x), np.asarray(y), err_msg=role)
