"""Reading metrics.jsonl back, plotting the main curves to a PNG, and the CLI.

A resumed run appends to the same file, so a step can appear twice and a crashed run
can have logged steps past the checkpoint that the resumed run redoes. read_jsonl gives
the resumed run's view: a line whose step is below the previous line's starts a new
history from that step (later steps of the earlier run are dropped), and the metrics
of one step are merged, later values winning.
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os

PLOT_EXTRA_MISSING = ("plotting needs matplotlib, which is not installed: pip install "
                      "'hflax[plot]' (the metrics stay in metrics.jsonl)")

# (title, metric names or globs, (band low, band high) or None): whichever exist are drawn.
DEFAULT_PANELS = (
    ("score", ("critic/score/mean",), ("critic/score/min", "critic/score/max")),
    # verl's names: val-core/<source>/acc/... when the reward returns an acc, else
    # val-core/<source>/reward/... (mean@N, best@N/mean, maj@N/mean).
    ("validation", ("val-core/*/acc/*", "val-core/*/reward/*"), None),
    ("KL", ("actor/ppo_kl", "actor/kl_loss", "critic/kl"), None),
    ("response length", ("response_length/mean",),
     ("response_length/min", "response_length/max")),
    ("losses", ("actor/pg_loss", "critic/vf_loss"), None),
    ("step time (s)", ("timing_s/step",), None),
)


def read_jsonl(path: str) -> dict[int, dict[str, float]]:
  """{step: metrics} in step order; unparsable lines (a killed run's last) are skipped."""
  records: dict[int, dict[str, float]] = {}
  last = None
  with open(path, encoding="utf-8") as f:
    for line in f:
      try:
        entry = json.loads(line)
        step = int(entry.pop("step"))
      except (ValueError, KeyError, TypeError, AttributeError):
        continue
      if last is not None and step < last:  # a resume: drop what the restart redoes
        records = {s: m for s, m in records.items() if s <= step}
      records.setdefault(step, {}).update(entry)
      last = step
  return dict(sorted(records.items()))


def _series(records, key):
  steps = [s for s, m in records.items() if key in m]
  return steps, [records[s][key] for s in steps]


def _matching(records, patterns):
  names = sorted({k for m in records.values() for k in m})
  return [n for p in patterns for n in names if fnmatch.fnmatchcase(n, p)]


def plot_metrics(jsonl_path: str, out_png: str, keys=None) -> str:
  """Draws the panels that have data in a grid and writes a PNG; returns its path.

  keys: None for DEFAULT_PANELS, or metric names / globs, one panel each.
  """
  # The object API with the Agg canvas leaves pyplot's global backend alone (a notebook
  # calling this keeps its own) and needs no display.
  try:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
  except ImportError:
    raise ImportError(PLOT_EXTRA_MISSING) from None

  records = read_jsonl(jsonl_path)
  specs = DEFAULT_PANELS if keys is None else [(k, (k,), None) for k in keys]
  panels = [(title, names, band) for title, patterns, band in specs
            if (names := _matching(records, patterns))]
  if not panels:
    wanted = [p for _, patterns, _ in specs for p in patterns]
    raise ValueError(f"{jsonl_path}: no data for any of {wanted}")
  ncols = min(3, len(panels))
  nrows = math.ceil(len(panels) / ncols)
  fig = Figure(figsize=(5 * ncols, 3.2 * nrows))
  FigureCanvasAgg(fig)
  for i, (title, names, band) in enumerate(panels):
    ax = fig.add_subplot(nrows, ncols, i + 1)
    for name in names:
      steps, values = _series(records, name)
      # Markers when sparse: validation runs every few steps and a line hides single points.
      ax.plot(steps, values, label=name, marker="o" if len(steps) <= 30 else None,
              markersize=3, linewidth=1.2)
    if band and all(_series(records, b)[0] for b in band):
      (lo_steps, lo), (hi_steps, hi) = _series(records, band[0]), _series(records, band[1])
      if lo_steps == hi_steps:
        ax.fill_between(lo_steps, lo, hi, alpha=0.2, label="min-max")
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step")
    ax.grid(alpha=0.3)
    if len(names) > 1 or band:
      ax.legend(fontsize=7)
  fig.suptitle(os.path.basename(os.path.dirname(os.path.abspath(jsonl_path))), fontsize=11)
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(out_png)), exist_ok=True)
  fig.savefig(out_png, format="png", dpi=100)
  return out_png


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(prog="python -m hflax.metrics",
                                   description="hflax run metrics tools")
  sub = parser.add_subparsers(dest="command", required=True)
  plot = sub.add_parser("plot", help="re-plot a run's curves from its metrics.jsonl")
  plot.add_argument("run_dir", help="the run directory, or its metrics.jsonl")
  plot.add_argument("--out", help="PNG to write (default: RUN_DIR/metrics.png)")
  plot.add_argument("--keys", nargs="+", help="metric names or globs, one panel each")
  args = parser.parse_args(argv)
  if os.path.isdir(args.run_dir):
    jsonl, run_dir = os.path.join(args.run_dir, "metrics.jsonl"), args.run_dir
  else:
    jsonl, run_dir = args.run_dir, os.path.dirname(os.path.abspath(args.run_dir))
  if not os.path.exists(jsonl):
    parser.error(f"no metrics file at {jsonl}")
  try:
    print(plot_metrics(jsonl, args.out or os.path.join(run_dir, "metrics.png"), args.keys))
  except (ValueError, ImportError) as e:  # --keys that match nothing, no matplotlib: one line
    parser.error(str(e))
  return 0
