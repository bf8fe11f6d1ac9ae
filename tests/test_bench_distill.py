"""bench/distill.py's arithmetic on given metrics: the accuracy curve sums timing_s/step
over every step (validated or not), the first step at the level is found, an arm that
never reaches it makes the steps ratio a bound (and no figure when neither does), and the
results record passes bench/results_table.py's schema. The bench itself runs four launcher
processes even in --quick (minutes here), so it is not run by the suite."""
import importlib.util
import json
import pathlib
import sys
import types

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _load(name):
  spec = importlib.util.spec_from_file_location(name, ROOT / "bench" / f"{name}.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


distill = _load("distill")
table = _load("results_table")


def _run_dir(tmp_path, name, accs, step_s):
  """A metrics.jsonl as the launcher writes it: validation rows at step 0 and every 2nd
  step, step rows with timing_s/step, a resumed chunk repeating its last step's row."""
  d = tmp_path / name
  d.mkdir()
  rows = [{"step": 0, distill.ACC: accs[0]}]
  for step in range(1, 2 * (len(accs) - 1) + 1):
    rows.append({"step": step, "timing_s/step": step_s})
    if step % 2 == 0:
      rows.append({"step": step, distill.ACC: accs[step // 2]})
  rows.append({"step": 2, distill.ACC: accs[1]})  # merged, not duplicated
  (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
  return d


def test_curve_sums_step_times_and_finds_the_first_step_at_the_level(tmp_path):
  points = distill.curve(distill.read_metrics(_run_dir(tmp_path, "a", [0.1, 0.3, 0.55, 0.4], 1.5)))
  assert [p["step"] for p in points] == [0, 2, 4, 6]
  assert [p["train_s"] for p in points] == [0.0, 3.0, 6.0, 9.0]  # odd steps' time counts too
  assert distill.first_reaching(points, 0.5) == {"step": 4, "train_s": 6.0, "acc": 0.55}
  assert distill.first_reaching(points, 0.6) is None


def test_a_resumed_chunks_first_step_counts_as_the_median_step():
  rows = {0: {distill.ACC: 0.1}, 1: {"timing_s/step": 9.0}, 2: {"timing_s/step": 1.0},
          3: {"timing_s/step": 20.0}, 4: {"timing_s/step": 3.0, distill.ACC: 0.4}}
  assert distill.curve(rows)[-1]["train_s"] == 33.0
  # chunks of 2: step 3 resumed (counted as the median of steps 2 and 4), step 1 as measured
  assert distill.curve(rows, chunk=2)[-1] == {"step": 4, "train_s": 15.0, "acc": 0.4}


def test_median_step_leaves_out_each_chunks_first_step():
  rows = {0: {distill.ACC: 0.1}, 1: {"timing_s/step": 9.0}, 2: {"timing_s/step": 1.0},
          3: {"timing_s/step": 8.0}, 4: {"timing_s/step": 2.0}, 5: {"timing_s/step": 7.0},
          6: {"timing_s/step": 3.0}}
  assert distill.median_step_s(rows, chunk=2) == 2.0  # steps 1, 3, 5 start chunks
  assert distill.median_step_s(rows, chunk=6) == 3.0


def _curves(tmp_path, grpo, dist):
  tmp_path = tmp_path / f"runs{len(list(tmp_path.glob('runs*')))}"
  tmp_path.mkdir()
  return {"grpo": distill.curve(distill.read_metrics(_run_dir(tmp_path, "grpo", grpo, 1.0))),
          "distill": distill.curve(distill.read_metrics(_run_dir(tmp_path, "distill", dist, 2.0)))}


def _record(tmp_path, curves, level=0.5):
  reach = {arm: distill.first_reaching(curves[arm], level) for arm in distill.ARMS}
  out = tmp_path / "run.json"
  args = types.SimpleNamespace(level=level, steps=6, machine="zen4", coef=1.0,
                               task_reward_coef=0.0, start_steps=275, teacher_steps=100,
                               teacher_seed=2, seed=0, val_every=2, chunk=2, out=str(out))
  distill.write_results(args, curves, 0.8, reach, "1.00 1.00 1.00")
  return json.loads(out.read_text())


def _check_schema(record):
  assert all(k in record for k in table.RUN_KEYS) and record["machine"] in table.MACHINES
  for figure in record["figures"]:
    assert all(k in figure for k in table.FIGURE_KEYS) and figure["target"] in table.TARGETS


def test_both_arms_reach_the_level(tmp_path, monkeypatch):
  monkeypatch.setattr(sys, "argv", ["bench/distill.py"])
  record = _record(tmp_path, _curves(tmp_path, [0.1, 0.2, 0.3, 0.6], [0.1, 0.5, 0.6, 0.7]))
  _check_schema(record)
  steps, seconds, final = record["figures"]
  assert (steps["peer"], steps["hflax"], steps["ratio"]) == (6, 2, 3.0)
  assert (seconds["peer"], seconds["hflax"], seconds["ratio"]) == (6.0, 4.0, 1.5)
  assert steps["ratio_is"] == "GRPO / distillation"  # not a bound
  # the mean of the last 10 validations (here all 4 of each arm)
  assert (final["peer"], final["hflax"]) == (0.3, 0.475)
  assert final["ratio"] == pytest.approx(0.475 / 0.3, abs=1e-4)
  assert record["notes"]["curves"]["distill"][1] == {"step": 2, "train_s": 4.0, "acc": 0.5}


def test_an_arm_not_reaching_the_level_makes_the_ratio_a_bound(tmp_path, monkeypatch):
  monkeypatch.setattr(sys, "argv", ["bench/distill.py"])
  record = _record(tmp_path, _curves(tmp_path, [0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.5, 0.6]))
  steps = record["figures"][0]
  assert steps["peer"] is None and steps["hflax"] == 4
  assert steps["ratio"] == 1.5 and "lower bound" in steps["ratio_is"]  # > 6 / 4
  record = _record(tmp_path, _curves(tmp_path, [0.1, 0.5, 0.6, 0.6], [0.1, 0.2, 0.3, 0.4]))
  steps = record["figures"][0]
  assert steps["hflax"] is None and steps["ratio"] == pytest.approx(2 / 6, abs=1e-4)
  assert "upper bound" in steps["ratio_is"]


def test_refigure_recomputes_the_figures_and_keeps_the_run(tmp_path, monkeypatch):
  monkeypatch.setattr(sys, "argv", ["bench/distill.py"])
  record = _record(tmp_path, _curves(tmp_path, [0.1, 0.2, 0.3, 0.6], [0.1, 0.5, 0.6, 0.7]))
  record.update(command="python bench/distill.py --steps 6", commit="abcdef0", date="2026-01-01")
  record["figures"] = []
  old = tmp_path / "old.json"
  old.write_text(json.dumps(record))
  monkeypatch.setattr(sys, "argv", ["bench/distill.py", "--refigure", str(old), "--out",
                                    str(tmp_path / "new.json")])
  distill.main()
  new = json.loads((tmp_path / "new.json").read_text())
  assert [f["target"] for f in new["figures"]] == ["distill_steps_to_half",
                                                   "distill_seconds_to_half", "distill_final_acc"]
  assert (new["command"], new["commit"], new["date"]) == (record["command"], "abcdef0",
                                                          "2026-01-01")
  assert new["notes"]["curves"] == record["notes"]["curves"]


def test_neither_arm_reaching_the_level_leaves_only_the_final_accuracy(tmp_path, monkeypatch):
  monkeypatch.setattr(sys, "argv", ["bench/distill.py"])
  record = _record(tmp_path, _curves(tmp_path, [0.1, 0.2, 0.3, 0.4], [0.1, 0.2, 0.3, 0.3]))
  _check_schema(record)
  assert [f["target"] for f in record["figures"]] == ["distill_final_acc"]


def test_the_smollm2_job_starts_from_the_shipped_model_and_records_rows_of_its_own(
    tmp_path, monkeypatch):
  args = types.SimpleNamespace(job="smollm2", seed=0, val_every=2, start_steps=300,
                               coef=1.0, task_reward_coef=0.0)
  grpo = distill.arm_settings(args, "grpo", tmp_path / "sft", "teacher/hf")
  dist = distill.arm_settings(args, "distill", tmp_path / "sft", "teacher/hf")
  assert not any("sft_warmup" in s for s in grpo + dist)  # both arms: the model as shipped
  assert dist[:len(grpo)] == grpo and "--config.distill.teacher_path=teacher/hf" in dist
  args.job = "grpo"
  assert "--config.trainer.sft_warmup.steps=300" in distill.arm_settings(args, "grpo",
                                                                          tmp_path, "t")
  monkeypatch.setattr(sys, "argv", ["bench/distill.py", "--job", "smollm2"])
  curves = _curves(tmp_path, [0.1, 0.2, 0.3, 0.6], [0.1, 0.5, 0.6, 0.7])
  reach = {arm: distill.first_reaching(curves[arm], 0.5) for arm in distill.ARMS}
  args = types.SimpleNamespace(job="smollm2", level=0.5, steps=6, machine="zen4", coef=1.0,
                               task_reward_coef=0.0, start_steps=0, teacher_steps=12,
                               teacher_seed=2, seed=0, val_every=2, chunk=2,
                               out=str(tmp_path / "run.json"))
  distill.write_results(args, curves, 0.68, reach, "1.00 1.00 1.00")
  record = json.loads((tmp_path / "run.json").read_text())
  _check_schema(record)
  assert [f["target"] for f in record["figures"]] == [
      "distill_smollm2_steps_to_half", "distill_smollm2_seconds_to_half",
      "distill_smollm2_final_acc"]
  assert record["notes"]["job"] == "smollm2"
