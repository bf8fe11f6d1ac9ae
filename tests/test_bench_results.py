"""bench/results/: one JSON file per benchmark run, and the table of latest figures in
bench/README.md generated from them (bench/results_table.py). Every file has the keys a
reader needs to trust a figure (command, commit, date, machine, load, both sides of each
ratio), and the README's table equals the generator's output."""
import datetime
import importlib.util
import json
import math
import numbers
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
RESULTS = sorted((ROOT / "bench" / "results").glob("*.json"))


def _generator():
  spec = importlib.util.spec_from_file_location("results_table",
                                                ROOT / "bench" / "results_table.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _number(x):
  return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)


def test_there_are_results():
  assert len(RESULTS) >= 10


@pytest.mark.parametrize("path", RESULTS, ids=lambda p: p.name)
def test_every_result_file_has_the_required_keys(path):
  table = _generator()
  run = json.loads(path.read_text())
  missing = [k for k in table.RUN_KEYS if k not in run]
  assert not missing, f"{path.name} lacks {missing}"
  datetime.date.fromisoformat(run["date"])
  assert path.name.startswith(run["date"]), "file names start with the run's date"
  assert run["machine"] in table.MACHINES, f"unknown machine {run['machine']!r}"
  for field in ("command", "commit", "cpu", "load", "script"):
    assert isinstance(run[field], str) and run[field].strip(), field
  assert len(run["commit"]) >= 7 and all(c in "0123456789abcdef" for c in run["commit"])
  assert run["figures"]
  for figure in run["figures"]:
    missing = [k for k in table.FIGURE_KEYS if k not in figure]
    assert not missing, f"{path.name}: a figure lacks {missing}"
    assert figure["target"] in table.TARGETS, f"unknown target {figure['target']!r}"
    if table.TARGETS[figure["target"]][1] == "acc":
      assert _number(figure["hflax"]) and _number(figure["peer"])
    else:
      assert _number(figure["ratio"]), f"{path.name}: {figure['target']} has no ratio"
    # Both sides, where the run recorded them as numbers, give the ratio (to rounding).
    if figure.get("ratio_checked", True) and _number(figure["hflax"]) and \
        _number(figure["peer"]) and _number(figure["ratio"]):
      hflax, peer = figure["hflax"], figure["peer"]
      got = hflax / peer if figure["ratio_is"].startswith("hflax/peer") else peer / hflax
      assert got == pytest.approx(figure["ratio"], rel=0.03), (path.name, figure["target"])


def test_the_readme_table_is_the_generated_one():
  table = _generator()
  readme = (ROOT / "bench" / "README.md").read_text()
  assert table.BEGIN in readme and table.END in readme
  assert table.rewrite(readme, table.table()) == readme, (
      "bench/README.md's results table is out of date: python bench/results_table.py")


def test_the_table_shows_the_latest_run_per_target_and_machine():
  table = _generator()
  base = {"script": "bench/x.py", "command": "x", "cpu": "c", "load": "0", "machine": "zen4"}
  figure = {"target": "gen_fp32", "unit": "s", "hflax": 1.0, "peer": 3.0,
            "peer_name": "p", "ratio_is": "peer/hflax"}
  runs = [("2026-01-02-b.json", {**base, "date": "2026-01-02", "commit": "bbbbbbb",
                                 "figures": [{**figure, "ratio": 2.0}]}),
          ("2026-01-01-a.json", {**base, "date": "2026-01-01", "commit": "aaaaaaa",
                                 "figures": [{**figure, "ratio": 3.0}]})]
  text = table.table(runs)
  assert "2.00x" in text and "bbbbbbb" in text and "aaaaaaa" not in text


def test_bench_readme_is_at_most_250_lines():
  assert len((ROOT / "bench" / "README.md").read_text().splitlines()) <= 250
