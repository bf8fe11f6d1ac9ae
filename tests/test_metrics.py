"""hflax.metrics: MetricsLogger backends, progress/ETA, plots and the CLI, batch metrics."""
import glob
import io
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from hflax import metrics as M

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Clock:
  """A clock the test advances by hand."""

  def __init__(self, t=100.0):
    self.t = t

  def __call__(self):
    return self.t


class TTY(io.StringIO):
  def isatty(self):
    return True


def _step_metrics(i):
  return {"critic/score/mean": 0.5 + 0.1 * i, "actor/ppo_kl": 0.001 * i,
          "response_length/mean": 100.0 + i, "timing_s/step": 2.0,
          "actor/pg_loss": -0.1 * i, "val-core/gsm8k/reward/mean@1": 0.25 * i}


def _lines(path):
  with open(path) as f:
    return [json.loads(line) for line in f]


# ---------------------------------------------------------------------------- jsonl


def test_jsonl_one_flushed_object_per_step(tmp_path):
  logger = M.MetricsLogger(tmp_path, 3, backends=("jsonl",))
  # JAX device scalars, numpy scalars and Python numbers all become floats.
  logger.log(1, {"critic/score/mean": jnp.float32(0.5), "actor/pg_loss": np.float64(-1.25),
                 "timing_s/step": 3, "perf/throughput": jnp.asarray(7.0, jnp.bfloat16)})
  # Readable before close(): a killed run keeps its log.
  assert _lines(tmp_path / "metrics.jsonl") == [
      {"step": 1, "critic/score/mean": 0.5, "actor/pg_loss": -1.25, "timing_s/step": 3.0,
       "perf/throughput": 7.0}]
  logger.log(jnp.int32(2), {"critic/score/mean": 0.75})
  logger.close()
  assert _lines(tmp_path / "metrics.jsonl")[1] == {"step": 2, "critic/score/mean": 0.75}


def test_log_rejects_non_scalars(tmp_path):
  with M.MetricsLogger(tmp_path, 3, backends=("jsonl",)) as logger:
    with pytest.raises(TypeError, match="actor/entropy"):
      logger.log(1, {"actor/entropy": np.ones(3)})
    with pytest.raises(ValueError, match="step"):
      logger.log(1, {"step": 1.0})


def test_resume_appends_and_readers_take_the_resumed_history(tmp_path):
  with M.MetricsLogger(tmp_path, 10, backends=("jsonl",)) as logger:
    for i in range(1, 6):
      logger.log(i, {"critic/score/mean": float(i)})
  # Crash after step 5 from a checkpoint at step 3; the restart validates at step 3 first.
  with M.MetricsLogger(tmp_path, 10, backends=("jsonl",), start_step=3) as logger:
    logger.log(3, {"val-core/gsm8k/reward/mean@1": 0.5})
    logger.log(4, {"critic/score/mean": 40.0})
  assert len(_lines(tmp_path / "metrics.jsonl")) == 7  # the file is kept, then appended
  assert M.read_jsonl(tmp_path / "metrics.jsonl") == {
      1: {"critic/score/mean": 1.0}, 2: {"critic/score/mean": 2.0},
      3: {"critic/score/mean": 3.0, "val-core/gsm8k/reward/mean@1": 0.5},
      4: {"critic/score/mean": 40.0}}  # the dead run's step 5 is gone


def test_partial_last_line_from_a_killed_run_is_skipped(tmp_path):
  path = tmp_path / "metrics.jsonl"
  path.write_text('{"step": 1, "a": 1.0}\n{"step": 2, "a": 2')
  with M.MetricsLogger(tmp_path, 10, backends=("jsonl",), start_step=1) as logger:
    logger.log(2, {"a": 5.0})
  assert M.read_jsonl(path) == {1: {"a": 1.0}, 2: {"a": 5.0}}


# -------------------------------------------------------------------------- console


def test_duration_and_eta_math():
  assert M.format_duration(0) == "00:00"
  assert M.format_duration(59.6) == "01:00"
  assert M.format_duration(3 * 3600 + 62) == "3:01:02"
  assert M.format_duration(None) == "?"
  assert M.eta_seconds(elapsed=12.0, step=0, total_steps=10) is None
  assert M.eta_seconds(elapsed=12.0, step=6, total_steps=10) == pytest.approx(8.0)
  assert M.eta_seconds(elapsed=12.0, step=12, total_steps=10) == 0.0
  # Resumed at 40: only the 2 steps of this process count toward the mean (6 s each).
  assert M.eta_seconds(elapsed=12.0, step=42, total_steps=50, start_step=40) == 48.0
  clock = Clock()
  progress = M.Progress(100, start_step=40, clock=clock)
  clock.t += 30.0
  progress.update(50)
  assert progress.eta() == pytest.approx(150.0)
  assert progress.summary() == "step 50/100 (50%) 00:30<02:30"
  assert progress.bar(width=10) == "[#####-----] step 50/100 (50%) 00:30<02:30"


def test_console_plain_lines(tmp_path):
  clock, stream = Clock(), io.StringIO()
  logger = M.MetricsLogger(tmp_path, 4, backends=("console",), stream=stream, clock=clock)
  clock.t += 4.0
  logger.log(1, _step_metrics(1))
  clock.t += 4.0
  logger.log(2, {"critic/kl": 0.25, "actor/pg_loss": 1.0})  # fallback KL; no other key number
  clock.t += 4.0
  logger.log(3, {"actor/pg_loss": 1.0})
  logger.close()
  assert stream.getvalue().splitlines() == [
      "step 1/4 (25%) 00:04<00:12 | score 0.6  kl 0.001  resp_len 101.0  step_time 2.00s",
      "step 2/4 (50%) 00:08<00:08 | kl 0.25",
      "step 3/4 (75%) 00:12<00:04"]
  assert "\r" not in stream.getvalue()


def test_console_tty_redraws_the_bar(tmp_path):
  clock, stream = Clock(), TTY()
  logger = M.MetricsLogger(tmp_path, 2, backends=("console",), stream=stream, clock=clock)
  clock.t += 10.0
  logger.log(1, {"critic/score/mean": 1.0})
  out = stream.getvalue()
  assert out.startswith("\r\x1b[Kstep 1/2 (50%) 00:10<00:10 | score 1\n[")
  assert out.endswith("] step 1/2 (50%) 00:10<00:10") and "#" in out
  logger.close()
  assert stream.getvalue().endswith("\n")


def test_console_goes_to_stderr_by_default(tmp_path, capsys):
  with M.MetricsLogger(tmp_path, 2, backends=("console",)) as logger:
    logger.log(1, {"timing_s/step": 1.5})
  captured = capsys.readouterr()
  assert captured.out == "" and "step 1/2" in captured.err and "step_time 1.50s" in captured.err


# ---------------------------------------------------------------------- tensorboard


def _crc32c(data):
  crc = 0xFFFFFFFF
  for byte in data:
    crc ^= byte
    for _ in range(8):
      crc = (crc >> 1) ^ (0x82F63B78 & -(crc & 1))
  return crc ^ 0xFFFFFFFF


def _masked_crc(data):
  crc = _crc32c(data)
  return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _fields(data):
  """Protobuf wire format -> [(field number, value)]: varints, 64/32-bit, bytes."""
  out, pos = [], 0

  def varint():
    nonlocal pos
    value, shift = 0, 0
    while True:
      byte = data[pos]
      pos += 1
      value |= (byte & 0x7F) << shift
      shift += 7
      if byte < 0x80:
        return value

  while pos < len(data):
    key = varint()
    number, wire = key >> 3, key & 7
    if wire == 0:
      out.append((number, varint()))
    elif wire == 1:
      out.append((number, struct.unpack("<d", data[pos:pos + 8])[0]))
      pos += 8
    elif wire == 5:
      out.append((number, struct.unpack("<f", data[pos:pos + 4])[0]))
      pos += 4
    else:
      assert wire == 2, wire
      length = varint()
      out.append((number, data[pos:pos + length]))
      pos += length
  return out


def _read_events(path):
  """TFRecords (u64 length, masked crc32c(length), data, masked crc32c(data)) of Events:
  {wall_time 1, step 2, file_version 3, summary 5 {value 1 {tag 1, simple_value 2}},
   session_log 7 {status 1}}, decoded without any TensorBoard package."""
  events, blob, pos = [], Path(path).read_bytes(), 0
  while pos < len(blob):
    header = blob[pos:pos + 8]
    (length,) = struct.unpack("<Q", header)
    data = blob[pos + 12:pos + 12 + length]
    assert blob[pos + 8:pos + 12] == struct.pack("<I", _masked_crc(header))
    assert blob[pos + 12 + length:pos + 16 + length] == struct.pack("<I", _masked_crc(data))
    event = dict(_fields(data))
    if 5 in event:
      event[5] = {dict(_fields(v))[1].decode(): dict(_fields(v))[2]
                  for n, v in _fields(event[5]) if n == 1}
    events.append(event)
    pos += 16 + length
  return events


def _event_file(run_dir):
  (path,) = glob.glob(str(run_dir / "tensorboard" / "events.out.tfevents.*"))
  return path


def test_tensorboard_events_read_back(tmp_path):
  with M.MetricsLogger(tmp_path, 3, backends=("tensorboard",)) as logger:
    for i in (1, 2):
      logger.log(i, {"critic/score/mean": jnp.float32(0.5 * i), "actor/pg_loss": -float(i)})
    logger.log(3, {"perf/huge": 1e300, "nan": float("nan")})  # beyond float32: inf
  first, *steps = _read_events(_event_file(tmp_path))
  assert first[3] == b"brain.Event:2" and first[1] > 1e9  # wall time in seconds
  assert [(e[2], e[5]) for e in steps[:2]] == [
      (1, {"critic/score/mean": 0.5, "actor/pg_loss": -1.0}),
      (2, {"critic/score/mean": 1.0, "actor/pg_loss": -2.0})]
  assert steps[2][5]["perf/huge"] == np.inf and np.isnan(steps[2][5]["nan"])


def test_tensorboard_reads_our_events_and_purges_on_resume(tmp_path):
  """The real reader, where the tensorboard package is installed (not a dependency)."""
  accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
  with M.MetricsLogger(tmp_path, 5, backends=("tensorboard",)) as logger:
    for i in range(1, 6):
      logger.log(i, {"critic/score/mean": float(i)})
  with M.MetricsLogger(tmp_path, 5, backends=("tensorboard",), start_step=3) as logger:
    logger.log(4, {"critic/score/mean": 40.0})
  events = accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
  events.Reload()
  assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == [
      (1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0)]  # the crashed run's 4 and 5 are hidden
  # A run that crashed before its first checkpoint starts again from step 0 (validation
  # before training): its events replace the earlier ones instead of doubling them.
  rerun = tmp_path / "rerun"
  for value in (1.0, 10.0):
    with M.MetricsLogger(rerun, 5, backends=("tensorboard",)) as logger:
      logger.log(0, {"val-core/acc": value})
      logger.log(1, {"critic/score/mean": value})
  events = accumulator.EventAccumulator(str(rerun / "tensorboard"))
  events.Reload()
  assert [(e.step, e.value) for e in events.Scalars("critic/score/mean")] == [(1, 10.0)]
  assert [(e.step, e.value) for e in events.Scalars("val-core/acc")] == [(0, 10.0)]


def test_missing_packages_give_clear_errors(tmp_path, monkeypatch):
  # Never wandb itself in tests, installed or not: make its import fail.
  monkeypatch.setitem(sys.modules, "wandb", None)
  with pytest.raises(ImportError, match="pip install wandb"):
    M.MetricsLogger(tmp_path, 3, backends=("jsonl",), wandb="hflax-test")
  with pytest.raises(ImportError, match="pip install wandb"):
    M.MetricsLogger(tmp_path, 3, backends=("jsonl", "wandb"))
  with pytest.raises(ValueError, match="unknown metrics backends"):
    M.MetricsLogger(tmp_path, 3, backends=("jsonl", "mlflow"))


# ---------------------------------------------------------------------------- plots


def _run(tmp_path, steps=6):
  run_dir = tmp_path / "run"
  with M.MetricsLogger(run_dir, steps, backends=("jsonl",)) as logger:
    for i in range(1, steps + 1):
      metrics = _step_metrics(i)
      if i % 3:  # validation every 3 steps only
        del metrics["val-core/gsm8k/reward/mean@1"]
      logger.log(i, metrics)
  return run_dir


def _assert_png(path):
  data = Path(path).read_bytes()
  assert data[:8] == PNG_MAGIC and len(data) > 1000


def test_plot_default_panels_and_keys(tmp_path):
  pytest.importorskip("matplotlib")
  run_dir = _run(tmp_path)
  _assert_png(M.plot_metrics(run_dir / "metrics.jsonl", tmp_path / "out" / "all.png"))
  _assert_png(M.plot_metrics(run_dir / "metrics.jsonl", tmp_path / "one.png",
                             keys=["actor/pg_loss", "val-core/*"]))
  with pytest.raises(ValueError, match="no data"):
    M.plot_metrics(run_dir / "metrics.jsonl", tmp_path / "none.png", keys=["critic/vf_loss"])


def test_validation_panel_takes_verl_names_with_reward_or_acc():
  """verl names validation metrics .../reward/... unless the reward returns an acc."""
  from hflax.metrics.plot import _matching
  patterns = dict((title, names) for title, names, _ in M.DEFAULT_PANELS)["validation"]
  records = {1: {"val-core/gsm8k/reward/mean@1": 0.5, "val-core/aime24/acc/mean@4": 0.25,
                 "val-aux/aime24/reward/mean@4": -0.5, "critic/score/mean": 1.0}}
  assert _matching(records, patterns) == ["val-core/aime24/acc/mean@4",
                                          "val-core/gsm8k/reward/mean@1"]


def test_cli_replots_from_jsonl(tmp_path, capsys):
  pytest.importorskip("matplotlib")
  run_dir = _run(tmp_path)
  assert M.main(["plot", str(run_dir), "--out", str(tmp_path / "cli.png")]) == 0
  assert capsys.readouterr().out.strip() == str(tmp_path / "cli.png")
  _assert_png(tmp_path / "cli.png")
  with pytest.raises(SystemExit) as stop:  # keys that match nothing: one line, status 2
    M.main(["plot", str(run_dir), "--keys", "nosuch"])
  err = capsys.readouterr().err
  assert stop.value.code == 2 and "no data for any of ['nosuch']" in err and "Traceback" not in err
  # The real entry point, default output next to the JSONL.
  env = {**os.environ, "PYTHONPATH": REPO, "JAX_PLATFORMS": "cpu"}
  subprocess.run([sys.executable, "-m", "hflax.metrics", "plot", str(run_dir)],
                 check=True, env=env, capture_output=True)
  _assert_png(run_dir / "metrics.png")


# ------------------------------------------------------------------- batch metrics


def _batch(seed=0):
  rng = np.random.default_rng(seed)
  B, T = 4, 5
  response_mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0],
                            [1, 1, 1, 1, 1]], np.float32)
  prompt_mask = np.array([[0, 1, 1], [1, 1, 1], [0, 0, 1], [0, 1, 1]], np.int32)
  f = lambda *shape: rng.normal(size=shape).astype(np.float32)  # noqa: E731
  return dict(scores=f(B), token_level_rewards=f(B, T) * response_mask, advantages=f(B, T),
              returns=f(B, T), values=f(B, T), response_mask=response_mask,
              prompt_mask=prompt_mask, max_response_length=T)


def _expected(b):
  valid = b["response_mask"] > 0
  resp_len = b["response_mask"].sum(-1)
  prompt_len = b["prompt_mask"].sum(-1)
  seq_reward = b["token_level_rewards"].sum(-1)
  out = {"response_length/clip_ratio": 0.5, "prompt_length/clip_ratio": 0.25}
  for name, x in [("critic/score", b["scores"]), ("critic/rewards", seq_reward),
                  ("critic/advantages", b["advantages"][valid]),
                  ("critic/returns", b["returns"][valid]), ("critic/values", b["values"][valid]),
                  ("response_length", resp_len), ("prompt_length", prompt_len)]:
    out.update({f"{name}/mean": x.mean(), f"{name}/max": x.max(), f"{name}/min": x.min()})
  ret, val = b["returns"][valid].astype(np.float64), b["values"][valid].astype(np.float64)
  out["critic/vf_explained_var"] = 1 - np.var(ret - val, ddof=1) / (np.var(ret, ddof=1) + 1e-5)
  return out


@pytest.mark.parametrize("as_jax", [False, True])
def test_reduce_batch_metrics_matches_numpy(as_jax):
  batch = _batch()
  args = {k: jnp.asarray(v) if as_jax and isinstance(v, np.ndarray) else v
          for k, v in batch.items()}
  got = M.to_floats(M.reduce_batch_metrics(**args, max_prompt_length=3))
  expected = _expected(batch)
  assert set(got) == set(expected)
  for key, value in expected.items():
    assert got[key] == pytest.approx(float(value), rel=1e-5, abs=1e-6), key


def test_reduce_batch_metrics_without_values_and_empty_rows():
  batch = _batch()
  del batch["values"]
  batch["response_mask"] = np.zeros_like(batch["response_mask"])
  got = M.to_floats(M.reduce_batch_metrics(**batch))
  assert not any(k.startswith("critic/values") for k in got)
  assert "prompt_length/clip_ratio" not in got
  # No valid token anywhere: 0, never NaN/inf.
  for key in ("critic/advantages/mean", "critic/advantages/max", "critic/returns/min"):
    assert got[key] == 0.0
  assert got["response_length/mean"] == 0.0 and got["response_length/clip_ratio"] == 0.0


def test_throughput():
  # verl: tokens / (step seconds * devices).
  assert M.throughput(12_000, 3.0, 8) == 500.0
  assert float(M.throughput(jnp.float32(1000.0), 2.0, 1)) == 500.0


def test_validation_samples_reach_jsonl_console_and_tensorboard_text(tmp_path):
  accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")
  samples = [{"input": "<|im_start|>user\nWhat is 2+2?<|im_end|>\n", "output": "4 | four\n",
              "score": 1.0},
             {"input": "What is 3+3?", "output": "", "score": 0.0}]
  console = io.StringIO()
  with M.MetricsLogger(tmp_path, 5, backends=("jsonl", "console", "tensorboard"),
                       stream=console) as logger:
    logger.log(2, {"val-core/acc": 0.5})
    logger.log_generations(2, samples)
  rows = [json.loads(line) for line in (tmp_path / "val_generations.jsonl").open()]
  assert rows == [{"step": 2, "samples": samples}]
  text = console.getvalue()
  assert "validation samples at step 2:" in text
  assert '[score 1] ...<|im_start|>user What is 2+2?<|im_end|> -> "4 | four\\n"' in text
  assert '[score 0] ...What is 3+3? -> ""' in text
  events = accumulator.EventAccumulator(str(tmp_path / "tensorboard"),
                                        size_guidance={"tensors": 0})
  events.Reload()
  assert "val/generations" in events.Tags()["tensors"]
  (event,) = events.Tensors("val/generations")
  assert event.step == 2
  table = event.tensor_proto.string_val[0].decode()
  assert table.splitlines()[:3] == ["| # | input | output | score |", "|---|---|---|---|",
                                    "| 1 | <\\|im_start\\|>user<br>What is 2+2?<\\|im_end\\|><br> | "
                                    "4 \\| four<br> | 1 |"]
  plugin = events.SummaryMetadata("val/generations").plugin_data.plugin_name
  assert plugin == "text"


def test_plot_without_matplotlib_names_the_extra(tmp_path, monkeypatch, capsys):
  """Issue 25 point 9: matplotlib is the optional `plot` extra, not a dependency."""
  run_dir = _run(tmp_path)
  for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
    monkeypatch.setitem(sys.modules, name, None)  # `import` then raises ImportError
  with pytest.raises(ImportError, match=r"^plotting needs matplotlib, which is not installed: "
                                        r"pip install 'hflax\[plot\]'"):
    M.plot_metrics(run_dir / "metrics.jsonl", tmp_path / "x.png")
  with pytest.raises(SystemExit) as stop:
    M.main(["plot", str(run_dir)])
  err = capsys.readouterr().err
  assert stop.value.code == 2 and "pip install 'hflax[plot]'" in err and "Traceback" not in err


def _setup_kwargs():
  import runpy
  import setuptools
  captured = {}
  real = setuptools.setup
  setuptools.setup = lambda **kwargs: captured.update(kwargs)
  cwd = os.getcwd()
  try:
    os.chdir(REPO)  # setup.py reads README.md relative to itself
    runpy.run_path(os.path.join(REPO, "setup.py"))
  finally:
    setuptools.setup = real
    os.chdir(cwd)
  return captured


def _names(requirements):
  return {r.split("[")[0].split("=")[0].split(">")[0].strip() for r in requirements}


def test_optional_dependencies_are_extras():
  kwargs = _setup_kwargs()
  assert "matplotlib" not in _names(kwargs["install_requires"])
  extras = kwargs["extras_require"]
  assert _names(extras["plot"]) == {"matplotlib"} and _names(extras["math"]) == {"math-verify"}
  # bench/rl_step.py's TRL side imports trl, datasets, transformers and torch.
  assert {"trl", "datasets", "transformers", "torch"} <= _names(extras["bench"])
  assert "torch==2.13.0" in extras["bench"]  # the CPU build the constraints file pins
  # The tests exercise the optional paths, so the test extra carries them.
  assert {"matplotlib", "math-verify", "wandb"} <= _names(extras["test"])
  assert _names(extras["wandb"]) == {"wandb"}


class _FakeWandb:
  """Records wandb.init's arguments (the real package is exercised offline below)."""

  def __init__(self):
    self.inits = []

  def init(self, **kwargs):
    self.inits.append(kwargs)
    return type("Run", (), {"log": lambda *a, **k: None, "finish": lambda *a: None})()


def test_wandb_init_arguments(tmp_path, monkeypatch):
  """Issue 25 point 6: project, run name, config, an id kept in the run directory with
  resume="allow", and no mode forced (WANDB_MODE decides)."""
  from hflax.metrics import logger as logger_module
  fake = _FakeWandb()
  monkeypatch.setitem(sys.modules, "wandb", fake)
  monkeypatch.setattr(logger_module, "_new_run_id", lambda: "fake01")
  monkeypatch.delenv("WANDB_DIR", raising=False)
  config = {"actor": {"lr": 1e-6}}
  with M.MetricsLogger(tmp_path / "run", 3, backends=("jsonl",), wandb="proj", name="exp-1",
                       config=config):
    pass
  assert fake.inits[-1] == {"project": "proj", "name": "exp-1", "config": config,
                            "id": "fake01", "resume": "allow", "dir": str(tmp_path / "run")}
  assert (tmp_path / "run" / "wandb_run_id").read_text() == "fake01\n"
  # A restart reads the id back (a new one would start a new wandb run); WANDB_DIR is
  # wandb's to honour; a dict's own arguments win over the defaults.
  monkeypatch.setattr(logger_module, "_new_run_id", lambda: "other2")
  monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
  with M.MetricsLogger(tmp_path / "run", 3, backends=("jsonl",),
                       wandb={"project": "proj", "name": "mine", "tags": ["a"]}, name="exp-1"):
    pass
  assert fake.inits[-1] == {"project": "proj", "name": "mine", "tags": ["a"], "id": "fake01",
                            "resume": "allow"}
  # Old call sites (no name, no config) still work.
  with M.MetricsLogger(tmp_path / "old", 3, backends=("jsonl",), wandb="proj"):
    pass
  assert fake.inits[-1] == {"project": "proj", "id": "other2", "resume": "allow"}


def test_wandb_offline_run_logs_name_and_config_and_resumes_the_same_id(tmp_path, monkeypatch):
  wandb = pytest.importorskip("wandb", reason="wandb (in the test extra) is not installed")
  home = tmp_path / "wandb_home"
  for key, value in {"WANDB_MODE": "offline", "WANDB_DIR": str(home), "WANDB_SILENT": "true",
                     "WANDB_CONSOLE": "off", "WANDB_DISABLE_GIT": "true"}.items():
    monkeypatch.setenv(key, value)
  run_dir = tmp_path / "run"
  config = {"actor": {"optim": {"lr": 3.5e-6}}, "trainer": {"experiment_name": "verl-port-7"}}
  ids = []
  for start, steps in ((0, (0, 1, 2)), (2, (3,))):  # a run, then its restart from step 2
    with M.MetricsLogger(run_dir, 3, backends=("jsonl",), wandb="hflax-test",
                         name="verl-port-7", config=config, start_step=start) as logger:
      run = logger.backends[-1]._run
      assert run.name == "verl-port-7" and run.config["actor"]["optim"]["lr"] == 3.5e-6
      ids.append(run.id)
      for step in steps:
        logger.log(step, {"critic/score/mean": float(step)})
  assert ids[0] == ids[1] == (run_dir / "wandb_run_id").read_text().strip()
  wandb.teardown()  # wandb's service process writes the logs: wait for it to finish
  # Offline, each start writes a transaction log named by the run id; both hold the name
  # and the config (protobuf keeps strings as they are).
  logs = sorted(glob.glob(str(home / "wandb" / "offline-run-*" / f"run-{ids[0]}.wandb")))
  assert len(logs) == 2, os.listdir(home / "wandb")
  for log in logs:
    data = Path(log).read_bytes()
    assert b"verl-port-7" in data and b"optim" in data and b"lr" in data
