"""Checkpoints with integrity (issue 19, items 2 and 3): each fault reproduced, then the documented behaviour.

A module fixture trains one tiny run (3 SFT + 2 RL steps, a checkpoint every
step, the newest two kept: global steps 4 and 5); each whole-run test works on
a copy of its folder. Faults are injected directly (truncated and bit-flipped
files, NaN parameters, a step that returns NaN weights with a finite loss,
a failing save, a checkpoint folder replaced by a file), never through timing.
"""

import json
import os
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

from jaxrl_llm import bridge, errors, jobs
from jaxrl_llm.diagnostics import writers
from jaxrl_llm.jobs import resume
from jaxrl_llm.learner import checkpoint

from tiny_configs import tiny_config


def _config(run_dir, **overrides):
  return tiny_config(run_dir, **{"export__hf": True, "log__tensorboard": False, **overrides})


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
  """A finished run's folder (global steps 1-3 SFT, 4-5 RL; checkpoints 4 and 5 kept) and its exported params."""
  run_dir = tmp_path_factory.mktemp("finished") / "run"
  jobs.RLJob(_config(run_dir)).train()
  return run_dir, _export(run_dir)


def _copy(finished, tmp_path):
  run_dir = tmp_path / "run"
  shutil.copytree(finished[0], run_dir)
  return run_dir


def _export(run_dir):
  flat = jax.tree_util.tree_flatten_with_path(bridge.load_hf_params(str(run_dir / "hf_export")))[0]
  return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


def _biggest_array_file(step_dir):
  files = [os.path.join(r, f) for r, _, fs in os.walk(step_dir / "state") for f in fs]
  return max(files, key=os.path.getsize)


def _rl_steps(run_dir):
  return [r["step"] for r in writers.read_jsonl(run_dir / "metrics.jsonl") if "reward/mean" in r]


def test_truncated_latest_checkpoint_falls_back_to_the_previous_one_in_one_line(finished, tmp_path, capsys):
  run_dir = _copy(finished, tmp_path)
  victim = _biggest_array_file(run_dir / "checkpoints" / "5")
  with open(victim, "r+b") as f:
    f.truncate(os.path.getsize(victim) // 2)
  job = jobs.RLJob(_config(run_dir))
  out = capsys.readouterr().out
  job.close()
  assert job.progress.step == 1 and job.progress.phase == "rl"  # global step 4
  line = [l for l in out.splitlines() if l.startswith("Checkpoint step 5")]
  assert len(line) == 1 and "fails verification" in line[0] and "bytes, the manifest says" in line[0], out
  assert f"moved to {run_dir / 'checkpoints' / 'quarantine' / '5'}" in line[0]
  assert "Resumed from" in out and "at step 4" in out
  assert (run_dir / "checkpoints" / "quarantine" / "5").is_dir() and job.checkpointer.all_steps() == [4]
  # with every checkpoint unusable, one paragraph names the folder
  victim = _biggest_array_file(run_dir / "checkpoints" / "4")
  with open(victim, "r+b") as f:
    f.truncate(os.path.getsize(victim) // 2)
  with pytest.raises(errors.RunError, match=r"No usable checkpoint in .*checkpoints: step 4 fails "
                                            r"verification .*moved to .*A rerun starts the run from the beginning"):
    jobs.RLJob(_config(run_dir))


def test_bit_flipped_checkpoint_is_detected_and_the_export_is_never_garbage(finished, tmp_path, capsys):
  run_dir = _copy(finished, tmp_path)
  victim = _biggest_array_file(run_dir / "checkpoints" / "5")
  with open(victim, "r+b") as f:  # one flipped bit, same size: only the checksum can tell
    f.seek(os.path.getsize(victim) // 2)
    byte = f.read(1)
    f.seek(-1, os.SEEK_CUR)
    f.write(bytes([byte[0] ^ 0x10]))
  job = jobs.RLJob(_config(run_dir))
  assert "sha256 mismatch in state/" in capsys.readouterr().out
  assert job.progress.step == 1
  job.train()  # the lost step is trained again, from the verified step 4
  assert _rl_steps(run_dir) == [1, 2]  # metrics.jsonl was cut back to step 4's records: each step once
  exported = _export(run_dir)
  for name, want in finished[1].items():  # resume is bit-for-bit: the export is the uninterrupted run's
    np.testing.assert_array_equal(exported[name], want, err_msg=name)
  assert json.load(open(run_dir / "summary.json"))["rl_steps"] == 2


def test_finished_run_rerun_with_the_same_steps_changes_nothing(finished, tmp_path, capsys):
  run_dir = _copy(finished, tmp_path)
  outputs = [run_dir / "summary.json", *sorted((run_dir / "hf_export").iterdir()), run_dir / "metrics.jsonl"]
  before = [(p.read_bytes(), p.stat().st_mtime_ns) for p in outputs]
  summary = jobs.RLJob(_config(run_dir)).train()
  assert "is already complete (2 steps); nothing to do" in capsys.readouterr().out
  assert summary == json.load(open(run_dir / "summary.json"))
  assert [(p.read_bytes(), p.stat().st_mtime_ns) for p in outputs] == before


def test_more_steps_extend_a_finished_run_and_replayed_records_appear_once(finished, tmp_path, capsys):
  run_dir = _copy(finished, tmp_path)
  with open(run_dir / "metrics.jsonl", "a") as f:  # records written after the last checkpoint, then a kill
    f.write(json.dumps({"step": 3, "time": 0.0, "reward/mean": 9.0}) + '\n{"step": 4, "ti')
  job = jobs.RLJob(_config(run_dir, rl__steps=3, checkpoint__keep=3))
  out = capsys.readouterr().out
  assert "Extending the finished run: rl.steps 2 -> 3, 1 more step." in out
  assert "Resuming with config changes: checkpoint.keep 2 -> 3." in out
  summary = job.train()
  assert summary["rl_steps"] == 3 and job.progress.phase == "done"
  assert _rl_steps(run_dir) == [1, 2, 3]
  assert all(r.get("reward/mean") != 9.0 for r in writers.read_jsonl(run_dir / "metrics.jsonl"))
  saved = json.load(open(run_dir / "config.json"))
  assert saved["rl"]["steps"] == 3 and saved["checkpoint"]["keep"] == 3
  assert json.load(open(run_dir / "checkpoints" / "6" / "config.json")) == saved


def test_changed_architecture_is_an_error_naming_the_field(finished, tmp_path):
  run_dir = _copy(finished, tmp_path)
  with pytest.raises(errors.ConfigError, match=r"changes fields that a resumed run cannot change: "
                                               r"model.hidden_size 32 -> 64, task.eval_size 8 -> 16\."):
    jobs.RLJob(_config(run_dir, model__hidden_size=64, task__eval_size=16))
  assert checkpoint.Checkpointer(run_dir / "checkpoints").all_steps() == [4, 5]  # nothing moved or deleted


class _NullWriter:
  def write(self, step, metrics):
    return metrics


def test_nonfinite_state_is_never_saved_and_errors_name_the_last_good_step(tmp_path):
  config = _config(tmp_path, sft__steps=8, learner__max_nonfinite_in_a_row=2)
  job = jobs.RLJob(config)
  poison = lambda train: train.replace(params=jax.tree.map(lambda x: x * jnp.nan, train.params))

  def nan_weights_from_step_3(train, batch):  # the lr=inf fault: finite loss and gradients, NaN new weights
    new, metrics = job.sft_step(train, batch)
    return (poison(new) if job.progress.sft_step == 2 else new), metrics

  with pytest.raises(jobs.NonFiniteError, match=r"2 consecutive updates had a non-finite .* The newest verified "
                                                r"finite checkpoint is step 2 in .*checkpoints; a rerun resumes"):
    job.run_warm_start(_NullWriter(), nan_weights_from_step_3)
  assert job.progress.sft_step == 5 and job.checkpointer.all_steps() == [1, 2]  # steps 3-5 were never written
  with pytest.raises(jobs.NonFiniteError, match="step 5 holds NaN or inf: checkpoint not written. The newest "
                                                "verified finite checkpoint is step 2"):
    job.save(force=True)
  with pytest.raises(jobs.NonFiniteError, match="hf_export/ and summary.json are not written"):
    resume.check_final(job)
  job.close()

  rerun = jobs.RLJob(config)  # resumes the good state
  assert rerun.progress.sft_step == 2 and checkpoint.is_finite(rerun.state)
  folder = tmp_path / "checkpoints"
  # a run folder that becomes unwritable mid-run fails at the next save, naming it. (We run as root, so
  # chmod cannot make it read-only: the checkpoint folder is replaced by a file instead.)
  os.rename(folder, tmp_path / "moved")
  folder.write_text("not a folder")
  with pytest.raises(OSError, match=re.escape(f"checkpoint folder '{folder}' is not writable")):
    rerun.save(force=True)
  folder.unlink()
  os.makedirs(folder)
  rerun.set_train_state(poison(rerun.train_state))
  with pytest.raises(jobs.NonFiniteError, match="There is no verified finite checkpoint in .*: a rerun starts"):
    rerun.save(force=True)
  rerun.close()


# ----------------------------------------------------------------------------- the checkpointer alone


def _tree(value):
  return {"w": jnp.full((4, 3), value, jnp.float32), "count": jnp.int32(7)}


def test_same_step_save_is_atomic(tmp_path, monkeypatch):
  ck = checkpoint.Checkpointer(tmp_path, keep=2)
  ck.save(1, _tree(1.0), {"v": "old"}, config={"a": 1})

  def fail(*args):
    raise OSError(28, "No space left on device")

  monkeypatch.setattr(checkpoint, "write_manifest", fail)  # the new copy is written, then the save fails
  with pytest.raises(OSError, match="No space left"):
    ck.save(1, _tree(2.0), {"v": "new"})
  monkeypatch.undo()
  state, extra, step = ck.restore(_tree(0.0))
  assert (step, extra, float(state["w"][0, 0])) == (1, {"v": "old"}, 1.0) and ck.notes == []
  shutil.copytree(tmp_path / "1", tmp_path.parent / "held_old")
  ck.save(1, _tree(2.0), {"v": "new"})
  assert ck.restore(_tree(0.0))[1] == {"v": "new"} and sorted(os.listdir(tmp_path)) == ["1"]

  # a replacement cut between its two renames (old moved aside, new not yet in place) is repaired
  shutil.copytree(tmp_path.parent / "held_old", tmp_path / ".old-1")
  os.rename(tmp_path / "1", tmp_path / ".pending-1")
  assert ck.latest_step() == 1 and ck.restore(_tree(0.0))[1] == {"v": "new"}
  shutil.rmtree(tmp_path / "1")
  assert ck.restore(_tree(0.0))[1] == {"v": "old"}  # only the old copy left: it is used


def test_checkpoint_without_manifest_loads_unverified_and_a_nan_one_is_passed_over(tmp_path):
  manager = ocp.CheckpointManager(tmp_path, item_names=("state", "extra"), options=ocp.CheckpointManagerOptions(
      enable_async_checkpointing=False))  # the layout written before manifests existed
  for step, value in ((1, 1.0), (2, float("nan"))):
    manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(_tree(value)),
                                               extra=ocp.args.JsonSave({"step": step})))
  manager.close()
  ck = checkpoint.Checkpointer(tmp_path)
  state, extra, step = ck.restore(_tree(0.0))
  assert step == 1 and float(state["w"][0, 0]) == 1.0
  assert ck.notes[0].startswith("Checkpoint step 2") and "holds NaN or inf: moved to" in ck.notes[0]
  assert "has no manifest" in ck.notes[1] and "loaded unverified" in ck.notes[1]
  with pytest.raises(checkpoint.NonFiniteStateError):
    ck.save(3, _tree(float("inf")), {})
  assert ck.all_steps() == [1]


def test_an_optional_part_absent_at_the_save_is_restored_as_none(tmp_path):
  """A checkpoint of the warm start holds no reference policy; the run state asks for one (restorable_like)."""
  ck = checkpoint.Checkpointer(tmp_path)
  ck.save(1, {"train": _tree(1.0), "ref": None}, {})
  state, _, _ = ck.restore({"train": _tree(0.0), "ref": _tree(0.0)})
  assert state["ref"] is None and float(state["train"]["w"][0, 0]) == 1.0


def test_metrics_are_cut_back_by_line_count_or_by_step(tmp_path):
  path = tmp_path / "metrics.jsonl"
  lines = [json.dumps({"step": s}) for s in (-2, -1, 0, 0, 1, 2, 3)] + ['{"step": 4, "ti']  # torn by a kill
  for keep_lines, max_step, want in ((5, None, [-2, -1, 0, 0, 1]), (None, 2, [-2, -1, 0, 0, 1, 2]),
                                     (None, -1, [-2, -1]), (0, None, [])):
    path.write_text("\n".join(lines))
    assert writers.truncate_jsonl(str(path), keep_lines, max_step) == len(lines) - len(want)
    assert [r["step"] for r in writers.read_jsonl(path)] == want


def test_config_comparison_sorts_fields_into_fixed_steps_and_others():
  old = {"job": "rl", "model": {"num_layers": 2}, "rl": {"steps": 60, "lr": 1}, "sft": {"steps": 3},
         "run_dir": "/a", "log": {"every": 1}}
  new = {"job": "rl", "model": {"num_layers": 4}, "rl": {"steps": 80, "lr": 2}, "sft": {"steps": 3},
         "run_dir": "/b", "log": {"every": 1}, "checkpoint": {"verify": True}}  # a field added since: its default
  fixed, steps, other = resume.compare_configs(old, new, ("sft.steps", "rl.steps"))
  assert fixed == [("model.num_layers", 2, 4)] and steps == [("rl.steps", 60, 80)] and other == [("rl.lr", 1, 2)]
