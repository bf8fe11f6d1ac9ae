"""Console backend: a progress bar with ETA and one short line of key numbers per step.

On a TTY the bar is redrawn in place (carriage return) under the step lines; anywhere
else (log files, CI) each step is one plain line, so logs stay greppable.
"""
from __future__ import annotations

import json
import sys
import time

# (label, candidates: the first present is shown, format). Only the numbers one glances
# at while a run goes; everything else is in the JSONL / TensorBoard.
KEY_NUMBERS = (
    ("score", ("critic/score/mean",), "{:.4g}"),
    ("kl", ("actor/ppo_kl", "actor/kl_loss", "critic/kl"), "{:.3g}"),
    ("resp_len", ("response_length/mean",), "{:.1f}"),
    ("step_time", ("timing_s/step",), "{:.2f}s"),
)


def format_duration(seconds: float | None) -> str:
  """MM:SS, or H:MM:SS from an hour on; '?' when unknown."""
  if seconds is None:
    return "?"
  s = int(round(max(seconds, 0.0)))
  h, rem = divmod(s, 3600)
  m, s = divmod(rem, 60)
  return f"{h}:{m:02d}:{s:02d}" if h else f"{m:02d}:{s:02d}"


def eta_seconds(elapsed: float, step: int, total_steps: int, start_step: int = 0):
  """Time left at the mean step time of this process; None before its first step.

  Steps are 1-based as in verl (step N is the last). Steps done before a resume
  (<= start_step) took no time in this process, so they are not in the mean.
  """
  done = step - start_step
  if done <= 0:
    return None
  return elapsed / done * max(total_steps - step, 0)


class Progress:
  """Step i of N, elapsed and ETA against an injectable clock (tests pass a fake one)."""

  def __init__(self, total_steps: int, start_step: int = 0, clock=time.monotonic):
    self.total_steps, self.start_step, self.clock = total_steps, start_step, clock
    self.step = start_step
    self.t0 = clock()

  def update(self, step: int):
    self.step = step

  @property
  def elapsed(self) -> float:
    return self.clock() - self.t0

  @property
  def fraction(self) -> float:
    return min(max(self.step / max(self.total_steps, 1), 0.0), 1.0)

  def eta(self):
    return eta_seconds(self.elapsed, self.step, self.total_steps, self.start_step)

  def summary(self) -> str:
    """'step 6/10 (60%) 00:12<00:08': elapsed < ETA, as tqdm prints them."""
    return (f"step {self.step}/{self.total_steps} ({self.fraction:.0%}) "
            f"{format_duration(self.elapsed)}<{format_duration(self.eta())}")

  def bar(self, width: int = 30) -> str:
    # ASCII only: a non-UTF-8 terminal must not crash the run.
    filled = int(round(self.fraction * width))
    return f"[{'#' * filled}{'-' * (width - filled)}] {self.summary()}"


def key_numbers(values: dict[str, float]) -> str:
  parts = []
  for label, candidates, fmt in KEY_NUMBERS:
    key = next((k for k in candidates if k in values), None)
    if key is not None:
      parts.append(f"{label} {fmt.format(values[key])}")
  return "  ".join(parts)


def _one_line(text: str) -> str:
  return " ".join(str(text).split())


class ConsoleBackend:
  def __init__(self, total_steps: int, start_step: int = 0, stream=None, clock=time.monotonic):
    self.stream = sys.stderr if stream is None else stream
    isatty = getattr(self.stream, "isatty", None)
    self.tty = bool(isatty and isatty())
    self.progress = Progress(total_steps, start_step, clock)
    self._bar_shown = False

  def line(self, values: dict[str, float]) -> str:
    numbers = key_numbers(values)
    return self.progress.summary() + (f" | {numbers}" if numbers else "")

  def write(self, step: int, values: dict[str, float]):
    self.progress.update(step)
    if self.tty:
      # Clear the bar, print the step line above it, redraw the bar without a newline.
      self.stream.write(f"\r\x1b[K{self.line(values)}\n{self.progress.bar()}")
      self._bar_shown = True
    else:
      self.stream.write(self.line(values) + "\n")
    self.stream.flush()

  def write_generations(self, step: int, samples: list[dict]):
    lines = [f"validation samples at step {step}:"]
    for s in samples:
      # The end of the prompt (a chat template's head repeats) and the start of the answer.
      prompt, answer = _one_line(s["input"]), json.dumps(s["output"], ensure_ascii=False)
      lines.append(f"  [score {s['score']:g}] ...{prompt[-80:]} -> {answer[:160]}")
    self.stream.write(("\r\x1b[K" if self._bar_shown else "") + "\n".join(lines) + "\n")
    self._bar_shown = False
    self.stream.flush()

  def close(self):
    if self._bar_shown:  # leave the cursor on a fresh line for whatever prints next
      self.stream.write("\n")
      self.stream.flush()
      self._bar_shown = False
