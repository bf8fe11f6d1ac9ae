"""Metrics and logging for the main job: per-step logging, plots, verl-named batch metrics.

Metric names follow verl's (actor/pg_loss, critic/score/mean, timing_s/gen,
perf/throughput, val-core/<source>/reward/mean@1 or, when the reward returns an acc,
val-core/<source>/acc/mean@1, ...) so runs compare across the two.

  with MetricsLogger(run_dir, total_steps) as logger:   # console + jsonl + tensorboard
    logger.log(step, {**reduce_batch_metrics(...), **timings})
  plot_metrics(f"{run_dir}/metrics.jsonl", f"{run_dir}/metrics.png")

or, from a shell: python -m hflax.metrics plot RUN_DIR [--out file.png]
"""
from hflax.metrics.console import ConsoleBackend, Progress, eta_seconds, format_duration
from hflax.metrics.logger import BACKENDS, MetricsLogger, to_floats
from hflax.metrics.plot import DEFAULT_PANELS, main, plot_metrics, read_jsonl
from hflax.metrics.reduce import reduce_batch_metrics, throughput

__all__ = [
    "MetricsLogger", "BACKENDS", "to_floats",
    "ConsoleBackend", "Progress", "eta_seconds", "format_duration",
    "plot_metrics", "read_jsonl", "DEFAULT_PANELS", "main",
    "reduce_batch_metrics", "throughput",
]
