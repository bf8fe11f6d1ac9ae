"""Exports are whole or absent: a failure mid-export leaves nothing that looks like a
model, loading an unfinished one is refused, and the next export succeeds."""
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


def test_kill_9_during_the_export_then_the_rerun_redoes_it(tmp_path):
  """Through python -m hflax.launch: kill -9 while the export is half written (the test
  pause HFLAX_TEST_PAUSE holds it after the weights, before the tokenizer) leaves no
  hf_actor, only hf_actor.incomplete-<pid>/ marked INCOMPLETE; the same command again
  resumes at the last step, exports whole and removes the leftovers."""
  import signal
  import subprocess
  import sys
  import time
  run_dir = tmp_path / "run"
  command = [sys.executable, "-m", "hflax.launch", "--config", TINY,
             f"--config.trainer.run_dir={run_dir}", "--config.trainer.total_steps=2"]
  env = {**os.environ, "PYTHONPATH": ROOT}
  proc = subprocess.Popen(command, env={**env, "HFLAX_TEST_PAUSE": "export=120"}, cwd=tmp_path,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
  deadline = time.monotonic() + 400
  partial = None
  while partial is None:
    assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
    found = [p for p in (os.listdir(run_dir) if run_dir.is_dir() else ())
             if p.startswith(f"hf_actor{atomic_export._PARTIAL}")]
    if found and (run_dir / found[0] / "model.safetensors").is_file():
      partial = run_dir / found[0]
    time.sleep(0.1)
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert not (run_dir / "hf_actor").exists()
  assert (partial / INCOMPLETE).is_file() and not is_complete(partial)
  done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True,
                        timeout=400)
  assert done.returncode == 0, done.stderr
  assert "resumed from step 2" in done.stdout and "exported the actor to" in done.stdout, \
      done.stdout
  assert is_complete(run_dir / "hf_actor") and not (run_dir / "hf_actor" / INCOMPLETE).exists()
  assert {"model.safetensors", "config.json", "hflax_tokenizer.json"} <= set(
      os.listdir(run_dir / "hf_actor"))
  assert [p for p in os.listdir(run_dir) if p.startswith("hf_actor")] == ["hf_actor"]
