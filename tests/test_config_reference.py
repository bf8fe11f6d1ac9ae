"""docs/config.md is the config reference generated from base_config: the committed file
must equal the generator's output, so a field added, removed, re-defaulted or checked
differently without regenerating the reference fails here.

Regenerate with: python -m hflax.launch.config_reference > docs/config.md
"""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "config.md"


def _generated() -> str:
  # A fresh process: tests register algorithms and estimators of their own, which would
  # show up among a field's choices if the reference were rendered in this one.
  return subprocess.run([sys.executable, "-m", "hflax.launch.config_reference"], cwd=ROOT,
                        check=True, capture_output=True, text=True).stdout


def test_committed_reference_equals_the_generated_one():
  assert REFERENCE.read_text() == _generated(), (
      "docs/config.md is out of date: python -m hflax.launch.config_reference > docs/config.md")


def test_every_field_of_base_config_is_in_the_reference():
  from hflax.launch.config import base_config
  from hflax.launch.config_reference import _leaves
  text = REFERENCE.read_text()
  missing = [path for path, _ in _leaves(base_config()) if f"| `{path}` |" not in text]
  assert not missing


def test_a_changed_default_or_check_changes_the_reference():
  from hflax.launch import config_reference
  from hflax.launch.ranges import RANGES, Range
  before = config_reference.probe_check("actor.optim.lr", 1e-5)
  saved = RANGES["actor.optim.lr"]
  RANGES["actor.optim.lr"] = Range(low=0, high=1, low_open=True)
  try:
    after = config_reference.probe_check("actor.optim.lr", 1e-5)
  finally:
    RANGES["actor.optim.lr"] = saved
  assert before == "a finite number > 0" and after == "a finite number in (0, 1]"


def test_readme_is_at_most_300_lines_and_links_the_reference():
  readme = (ROOT / "README.md").read_text()
  assert len(readme.splitlines()) <= 300
  assert "docs/config.md" in readme
