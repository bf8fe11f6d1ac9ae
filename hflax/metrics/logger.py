"""MetricsLogger: one log() per training step fans the step's metrics out to backends.

  console      progress bar + key numbers (hflax.metrics.console), stderr by default
  jsonl        run_dir/metrics.jsonl, one {"step": i, ...} object a line: the record that
               plots and readers use (hflax.metrics.plot.read_jsonl)
  tensorboard  event files in run_dir/tensorboard (hflax.metrics.tb_events; no TensorFlow)
  wandb        optional; on when `wandb=` names a project. The run gets the experiment's
               name and config (hyper-parameters), and an id kept in run_dir/wandb_run_id
               with resume="allow", so a restarted run continues the same wandb run.
               WANDB_MODE (online, offline, disabled) and WANDB_DIR are wandb's own
               settings and are honoured; without WANDB_DIR the files go to run_dir/wandb

Steps are 1-based as in verl (step 0: validation before training); `start_step` is the last
step completed before a resume.
"""
from __future__ import annotations

import json
import os
import secrets
import string
import sys
import time

import numpy as np

from hflax.metrics.console import ConsoleBackend
from hflax.metrics.tb_events import EventFileWriter

BACKENDS = ("console", "jsonl", "tensorboard", "wandb")


def to_floats(metrics: dict) -> dict[str, float]:
  """Python floats from floats, numpy scalars or JAX device scalars (0-d arrays)."""
  jax = sys.modules.get("jax")
  if jax is not None:
    # One device_get for the whole dict starts every transfer before waiting on any:
    # a single host sync per step instead of one per metric.
    metrics = jax.device_get(dict(metrics))
  out = {}
  for key, value in metrics.items():
    if not isinstance(key, str) or key == "step":
      raise ValueError(f"metric names must be strings other than 'step', got {key!r}")
    if np.ndim(value) != 0:
      raise TypeError(f"metric {key!r} is not a scalar: shape {np.shape(value)}; "
                      "reduce it (mean/max/...) before logging")
    out[key] = float(value)
  return out


def generations_markdown(samples: list[dict]) -> str:
  """A Markdown table (what TensorBoard's text plugin renders) of validation samples."""
  def cell(text) -> str:
    return str(text).replace("|", "\\|").replace("\n", "<br>")
  rows = [f"| {i + 1} | {cell(s['input'])} | {cell(s['output'])} | {s['score']:g} |"
          for i, s in enumerate(samples)]
  return "\n".join(["| # | input | output | score |", "|---|---|---|---|", *rows])


class JsonlBackend:
  def __init__(self, run_dir: str):
    self.path = os.path.join(run_dir, "metrics.jsonl")
    # A run killed mid-write can leave a partial last line; start ours on a fresh one so
    # only the broken record is lost (readers skip it).
    needs_newline = False
    if os.path.exists(self.path) and os.path.getsize(self.path) > 0:
      with open(self.path, "rb") as f:
        f.seek(-1, os.SEEK_END)
        needs_newline = f.read(1) != b"\n"
    # Append, even on resume: readers resolve steps logged twice (see read_jsonl).
    self._file = open(self.path, "a", encoding="utf-8")
    if needs_newline:
      self._file.write("\n")

  def write(self, step: int, values: dict[str, float]):
    self._file.write(json.dumps({"step": step, **values}) + "\n")
    self._file.flush()  # into the OS each step: a killed (not crashed-machine) run keeps it

  def write_generations(self, step: int, samples: list[dict]):
    with open(os.path.join(os.path.dirname(self.path), "val_generations.jsonl"), "a",
              encoding="utf-8") as f:
      f.write(json.dumps({"step": step, "samples": samples}) + "\n")

  def close(self):
    self._file.close()


class TensorboardBackend:
  """Scalars to run_dir/tensorboard (see hflax.metrics.tb_events for why not tensorboardX)."""

  def __init__(self, run_dir: str, start_step: int = 0):
    # Resuming from a checkpoint at start_step: hide the earlier run's steps from
    # start_step + 1 on. Rerunning a run that crashed before its first checkpoint: hide
    # all of them, step 0 (validation before training) included.
    logdir = os.path.join(run_dir, "tensorboard")
    earlier = os.path.isdir(logdir) and any(n.startswith("events.out.tfevents.")
                                            for n in os.listdir(logdir))
    purge = start_step + 1 if start_step > 0 else (0 if earlier else None)
    self._writer = EventFileWriter(logdir, purge_step=purge)

  def write(self, step: int, values: dict[str, float]):
    self._writer.write(step, values)

  def write_generations(self, step: int, samples: list[dict]):
    self._writer.write(step, texts={"val/generations": generations_markdown(samples)})

  def close(self):
    self._writer.close()


WANDB_RUN_ID_FILE = "wandb_run_id"


def _new_run_id() -> str:
  """8 random lower-case letters and digits, the form of wandb's own run ids."""
  alphabet = string.ascii_lowercase + string.digits
  return "".join(secrets.choice(alphabet) for _ in range(8))


def wandb_run_id(run_dir: str, new_id) -> str:
  """The wandb run id kept in run_dir/wandb_run_id, written there (new_id()) the first
  time: a restart in the same run directory resumes the same wandb run."""
  path = os.path.join(run_dir, WANDB_RUN_ID_FILE)
  if os.path.exists(path):
    with open(path, encoding="utf-8") as f:
      run_id = f.read().strip()
    if run_id:
      return run_id
  run_id = str(new_id())
  tmp = path + ".tmp"
  with open(tmp, "w", encoding="utf-8") as f:
    f.write(run_id + "\n")
  os.replace(tmp, path)  # never a half-written id
  return run_id


class WandbBackend:
  """wandb.init(project, name, config, id kept in the run directory, resume="allow"); a
  dict `wandb` passes more wandb.init arguments and wins over these defaults."""

  def __init__(self, run_dir: str, wandb_args, name: str | None = None,
               config: dict | None = None):
    try:
      import wandb
    except ImportError as e:
      raise ImportError("the 'wandb' metrics backend needs the wandb package "
                        "(pip install wandb)") from e
    kwargs = {"project": wandb_args} if isinstance(wandb_args, str) else dict(wandb_args or {})
    if not kwargs.get("project"):
      raise ValueError("the 'wandb' backend needs a project: wandb='name' or "
                       "wandb={'project': 'name', ...}")
    if name:
      kwargs.setdefault("name", name)
    if config is not None:
      kwargs.setdefault("config", config.to_dict() if hasattr(config, "to_dict") else
                        dict(config))
    if "id" not in kwargs:
      kwargs["id"] = wandb_run_id(run_dir, _new_run_id)
    kwargs.setdefault("resume", "allow")
    if not os.environ.get("WANDB_DIR"):
      kwargs.setdefault("dir", run_dir)
    # No mode here: wandb reads WANDB_MODE itself (online when unset and logged in).
    try:
      self._run = wandb.init(**kwargs)
    except Exception as e:  # noqa: BLE001 - not logged in, no network, a bad setting
      why = " ".join(str(e).split())[:300]
      raise ValueError(f"wandb.init for project {kwargs['project']!r} failed "
                       f"({type(e).__name__}: {why}); log in (wandb login), or set "
                       "WANDB_MODE=offline to keep the run local") from None
    self._generation_rows: list[list] = []

  def write(self, step: int, values: dict[str, float]):
    self._run.log(values, step=step)

  def write_generations(self, step: int, samples: list[dict]):
    """One row per validation, as verl's table: step, then input/output/score per sample
    (the whole table is logged again each time: wandb tables are immutable)."""
    import wandb
    self._generation_rows.append([step] + [s[k] for s in samples
                                           for k in ("input", "output", "score")])
    columns = ["step"] + [f"{k}_{i + 1}" for i in range(len(samples))
                          for k in ("input", "output", "score")]
    self._run.log({"val/generations": wandb.Table(columns=columns, data=self._generation_rows)},
                  step=step)

  def close(self):
    self._run.finish()


class MetricsLogger:
  """Logs one dict of scalar metrics per step to every backend; use as a context manager.

  wandb: None (off), a project name, or a dict of wandb.init keyword arguments with a
  'project'; giving it turns the wandb backend on. name (the experiment's name, verl's
  trainer.experiment_name) and config (the run's whole configuration, a dict or a
  ConfigDict) are what wandb shows as the run's name and hyper-parameters.
  stream, clock: where the console writes (stderr) and its time source (tests).
  The ETA's clock starts here: create the logger right before the training loop.
  """

  def __init__(self, run_dir: str, total_steps: int,
               backends=("console", "jsonl", "tensorboard"), wandb=None, start_step: int = 0,
               *, name: str | None = None, config=None, stream=None, clock=time.monotonic):
    names = {backends} if isinstance(backends, str) else set(backends)
    names |= {"wandb"} if wandb is not None else set()
    unknown = sorted(names - set(BACKENDS))
    if unknown:
      raise ValueError(f"unknown metrics backends {unknown}; choose from {BACKENDS}")
    self.run_dir = str(run_dir)
    os.makedirs(self.run_dir, exist_ok=True)
    self.backends = []
    try:
      # jsonl first: it is the record, written even if a later backend fails in log().
      for backend in sorted(names, key=("jsonl", "console", "tensorboard", "wandb").index):
        if backend == "jsonl":
          self.backends.append(JsonlBackend(self.run_dir))
        elif backend == "console":
          self.backends.append(ConsoleBackend(total_steps, start_step, stream, clock))
        elif backend == "tensorboard":
          self.backends.append(TensorboardBackend(self.run_dir, start_step))
        else:
          self.backends.append(WandbBackend(self.run_dir, wandb, name, config))
    except BaseException:
      self.close()  # release the files of the backends already opened
      raise

  def log(self, step: int, metrics: dict):
    """Converts the values (the step's one host sync) and writes them to every backend."""
    values = to_floats(metrics)
    step = int(step)
    for backend in self.backends:
      backend.write(step, values)

  def log_generations(self, step: int, samples: list[dict]):
    """A few validation samples ({input, output, score} each; verl's
    trainer.log_val_generations) to every backend that shows text."""
    for backend in self.backends:
      if hasattr(backend, "write_generations"):
        backend.write_generations(int(step), samples)

  def close(self):
    backends, self.backends = self.backends, []
    for backend in backends:
      backend.close()

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
