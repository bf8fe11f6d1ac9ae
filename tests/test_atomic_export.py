"""Exports are whole or absent: a failure mid-export leaves nothing that looks like a
model, loading an unfinished one is refused, and the next export succeeds. (kill -9 of
python -m hflax.launch mid-export, then the rerun: tests/test_interrupt_resume.py.)"""
import os

import pytest

from hflax.launch import atomic_export
from hflax.launch.__main__ import cli
from hflax.launch.atomic_export import COMPLETE, INCOMPLETE, atomic_directory, is_complete

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "tests", "tiny_config.py")


def test_a_failure_mid_export_leaves_no_directory_then_a_rerun_exports(tmp_path, capsys,
                                                                       monkeypatch):
  from hflax.models import hf
  real = hf.export_checkpoint

  def half_then_fail(path, *args, **kw):
    real(path, *args, **kw)  # the weights are written; the tokenizer never is
    raise OSError("disk full (simulated)")
  monkeypatch.setattr(hf, "export_checkpoint", half_then_fail)
  run_dir = tmp_path / "run"
  args = ["--config", TINY, f"--config.trainer.run_dir={run_dir}", "--config.trainer.total_steps=2"]
  assert cli(args) == 2
  assert "disk full" in capsys.readouterr().err
  assert not (run_dir / "hf_actor").exists()
  assert [p for p in os.listdir(run_dir) if p.startswith("hf_actor")] == []
  monkeypatch.setattr(hf, "export_checkpoint", real)
  assert cli(args) == 0, capsys.readouterr().err  # resumes at step 2 and exports
  assert is_complete(run_dir / "hf_actor")
  assert (run_dir / "hf_actor" / "model.safetensors").is_file()
  assert not (run_dir / "hf_actor" / INCOMPLETE).exists()


def test_a_killed_export_is_cleaned_up_and_never_loaded(tmp_path, capsys):
  final = tmp_path / "hf_actor"
  with atomic_directory(str(final)) as partial:
    open(os.path.join(partial, "config.json"), "w").write("{}")
  first = (final / COMPLETE).read_text()
  # What a kill -9 mid-export leaves: the temporary directory, marked unfinished.
  killed = tmp_path / f"hf_actor{atomic_export._PARTIAL}999999"
  killed.mkdir()
  (killed / INCOMPLETE).write_text("")
  (killed / "config.json").write_text("{}")
  code = cli(["--config", TINY, f"--config.trainer.run_dir={tmp_path}/run",
              f"--config.model.path={killed}"])
  err = capsys.readouterr().err.strip()
  assert code == 2 and "is an unfinished export" in err, err
  assert (final / COMPLETE).read_text() == first  # the complete one is untouched
  with atomic_directory(str(final)) as partial:
    open(os.path.join(partial, "config.json"), "w").write('{"new": 1}')
  assert not killed.exists()  # the next export removed the leftovers
  assert (final / "config.json").read_text() == '{"new": 1}'
  assert [p for p in os.listdir(tmp_path) if p.startswith("hf_actor")] == ["hf_actor"]


def test_an_exception_inside_removes_the_partial_and_keeps_the_old(tmp_path):
  final = tmp_path / "out"
  with atomic_directory(str(final)) as partial:
    open(os.path.join(partial, "a"), "w").write("old")
  with pytest.raises(RuntimeError):
    with atomic_directory(str(final)) as partial:
      open(os.path.join(partial, "a"), "w").write("new")
      raise RuntimeError("mid-export")
  assert (final / "a").read_text() == "old" and sorted(os.listdir(tmp_path)) == ["out"]
