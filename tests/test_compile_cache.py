"""The main job's persistent compilation cache (trainer.compile_cache_dir): a rerun reads
its programs back, a directory JAX already has wins, "" turns it off.

The suite itself runs with a cache directory set (conftest.py), so the runs here are
subprocesses without JAX_COMPILATION_CACHE_DIR."""
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp

from hflax.launch.config import base_config, validate
from hflax.launch.trainer import Trainer
from hflax.platforms.compile_cache import (CompileCacheStats, compile_cache_summary,
                                           default_compile_cache_dir, use_compile_cache)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SMALL_RUN = ("--config", "grpo.py", "--config.trainer.total_steps=1",
             "--config.trainer.val_before_train=False", "--config.trainer.sft_warmup.steps=0",
             "--config.data.train_batch_size=4", "--config.actor.ppo_mini_batch_size=4",
             "--config.rollout.n=2", "--config.data.val_batch_size=8",
             "--config.data.builtin.num_val=8", "--config.trainer.log=('jsonl',)")


def _env(**extra):
  env = {k: v for k, v in os.environ.items() if k != "JAX_COMPILATION_CACHE_DIR"}
  return {**env, "PYTHONPATH": ROOT, "HFLAX_CPU_DEVICES": "2", **extra}


def _launch(*args):
  done = subprocess.run([sys.executable, "-m", "hflax.launch", *SMALL_RUN, *args], cwd=ROOT,
                        env=_env(), capture_output=True, text=True, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return done.stdout


def _read_back(stdout):
  """(programs read back, programs looked up) from the run's report line."""
  found = re.findall(r"compile cache: (\d+) of (\d+) programs read back", stdout)
  assert len(found) == 1, stdout
  return tuple(map(int, found[0]))


def _step_metrics(run_dir):
  """The first line of metrics.jsonl without the timings and throughputs."""
  with open(run_dir / "metrics.jsonl") as f:
    row = json.loads(f.readline())
  return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "perf/"))}


def test_a_rerun_reads_its_programs_back(tmp_path):
  cache = tmp_path / "cache"
  first = _launch(f"--config.trainer.run_dir={tmp_path / 'a'}",
                  f"--config.trainer.compile_cache_dir={cache}")
  assert f"compile cache: {cache} (0 programs, 0 MB; safe to delete)" in first
  hits, lookups = _read_back(first)
  assert hits == 0 and lookups > 0
  written = len(os.listdir(cache))
  assert written > 0
  # A new run of the same job (another run_dir: a fresh start, not a resume).
  second = _launch(f"--config.trainer.run_dir={tmp_path / 'b'}",
                   f"--config.trainer.compile_cache_dir={cache}")
  assert f"compile cache: {cache} ({written} programs" in second
  hits, again = _read_back(second)
  assert again == lookups and hits == lookups  # every program the same: all read back
  assert len(os.listdir(cache)) == written
  # The programs read back compute what the compiled ones did: the same step, number for number.
  steps = [_step_metrics(tmp_path / run) for run in ("a", "b")]
  assert steps[0] == steps[1] and "actor/entropy" in steps[0]


def test_an_empty_directory_turns_the_cache_off(tmp_path):
  out = _launch(f"--config.trainer.run_dir={tmp_path / 'a'}", "--config.trainer.compile_cache_dir=")
  assert "compile cache" not in out


def test_jax_own_directory_wins_over_the_config(tmp_path):
  code = ("import jax; from hflax.platforms.compile_cache import use_compile_cache as use; "
          "print(use('/elsewhere'), jax.config.jax_compilation_cache_dir)")
  mine = str(tmp_path / "mine")
  done = subprocess.run([sys.executable, "-c", code], env=_env(JAX_COMPILATION_CACHE_DIR=mine),
                        capture_output=True, text=True, timeout=120)
  assert done.stdout.split() == [mine, mine], done.stderr
  # This process (conftest's directory) too: the call changes nothing.
  before = jax.config.jax_compilation_cache_dir
  assert before and use_compile_cache(str(tmp_path / "other")) == before
  assert jax.config.jax_compilation_cache_dir == before


def test_a_relative_or_home_path_is_made_absolute_in_the_process_using_it(tmp_path):
  """One process: "" first leaves the cache off, then "~/c1" turns it on at $HOME/c1, and
  a later "" does not turn it off."""
  code = ("import jax; from hflax.platforms.compile_cache import use_compile_cache as use; "
          "print(use(''), jax.config.jax_compilation_cache_dir); "
          "print(use('~/c1'), jax.config.jax_compilation_cache_dir); print(use(''))")
  done = subprocess.run([sys.executable, "-c", code], env=_env(HOME=str(tmp_path)),
                        capture_output=True, text=True, timeout=120)
  lines = done.stdout.split("\n")
  assert lines[0].split() == ["None", "None"], done.stderr
  assert lines[1].split() == [str(tmp_path / "c1")] * 2, done.stderr
  assert lines[2] == str(tmp_path / "c1")  # already set: "" does not turn it off afterwards


def test_the_default_directory_and_the_summary(tmp_path, monkeypatch):
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
  assert default_compile_cache_dir() == str(tmp_path / "hflax" / "jax")
  monkeypatch.delenv("XDG_CACHE_HOME")
  assert default_compile_cache_dir() == os.path.join("~/.cache", "hflax", "jax")
  assert compile_cache_summary(str(tmp_path / "none")) == "0 programs, 0 MB"
  (tmp_path / "a-cache").write_bytes(b"x" * 3_000_000)
  (tmp_path / ".lockfile").write_bytes(b"")
  assert compile_cache_summary(str(tmp_path)) == "1 programs, 3 MB"


def test_a_file_where_the_cache_directory_goes_is_one_line_before_any_work(tmp_path):
  c = base_config()
  (tmp_path / "f").write_text("")
  c.trainer.compile_cache_dir = str(tmp_path / "f")
  try:
    validate(c)
  except ValueError as e:
    assert str(e).startswith("config.trainer.compile_cache_dir: ") and "is a file" in str(e)
  else:
    raise AssertionError("validate accepted a file as the cache directory")


def test_a_ray_pool_member_expands_the_directory_itself(tmp_path):
  """What RayBackend hands each member is the config's string; "~" is the member's home.
  (A one-process pool's initialize starts no jax.distributed job: no Ray needed here.)"""
  code = ("import jax; from hflax.controller.ray_backend.member import PoolMember; "
          "m = PoolMember('pool', 0, 1, 1, 'cpu', None, '~/cc'); m.initialize('', 10); "
          "print(jax.config.jax_compilation_cache_dir)")
  done = subprocess.run([sys.executable, "-c", code], env=_env(HOME=str(tmp_path)),
                        capture_output=True, text=True, timeout=120)
  assert done.stdout.split() == [str(tmp_path / "cc")], done.stderr[-2000:]


def test_the_counts_follow_this_process_and_stop_when_closed(tmp_path):
  stats = CompileCacheStats()
  jax.jit(lambda x: x * 7.25 + 0.5)(jnp.ones(3)).block_until_ready()  # new to this process
  assert stats.lookups >= 1 and 0 <= stats.hits <= stats.lookups
  stats.close()
  seen = stats.lookups
  jax.jit(lambda x: x * 1.75 - 2.0)(jnp.ones(3)).block_until_ready()
  assert stats.lookups == seen
  # The trainer holds one while it lives; closing it twice is harmless.
  c = base_config()
  c.trainer.update(total_steps=1, val_every=0, val_before_train=False, devices=2,
                   run_dir=str(tmp_path / "run"))
  c.trainer.sft_warmup.steps = 0
  c.data.builtin.update(num_train=16, num_val=8)
  trainer = Trainer(c, log=lambda *_: None)
  assert trainer.cache_stats is not None  # this process has conftest's directory
  trainer.close()
  trainer.close()
