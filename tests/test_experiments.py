"""Experiments: sweep validation before launch, a local 2-work-unit sweep end to end, XManager job groups."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_determinism import REPO, cache_env, compile_cache  # noqa: E402,F401

from jaxrl_llm import experiments  # noqa: E402
from jaxrl_llm.configuration import ConfigError  # noqa: E402

TINY_RUN = '''
"""Tiny default-path run of the experiment tests."""
import ml_collections
from jaxrl_llm.configuration import base_config


def get_config():
  c = base_config()
  c.name = "exp"
  c.model.hidden_size = 32
  c.model.intermediate_size = 64
  c.model.num_layers = 1
  c.model.num_heads = 2
  c.model.num_kv_heads = 1
  c.model.max_position_embeddings = 32
  c.task.kwargs = ml_collections.ConfigDict({"max_digits": 1, "eval_fraction": 0.3, "format_reward": 0.3})
  c.task.eval_size = 4
  c.sft.steps = 1
  c.sft.batch_size = 4
  c.rl.steps = 2
  c.rl.prompts_per_step = 2
  c.rl.samples_per_prompt = 2
  c.rl.max_new_tokens = 3
  c.learner.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": 1, "tensor": 1})
  c.eval.every = 100
  c.eval.pass_k = 2
  c.checkpoint.every = 100
  c.log.progress = False
  c.log.tensorboard = False
  c.export.hf = False
  return c
'''


@pytest.fixture
def config_file(tmp_path):
  path = tmp_path / "tiny_run.py"
  path.write_text(TINY_RUN)
  return str(path)


def test_a_sweep_naming_a_missing_field_fails_before_anything_launches(tmp_path, config_file):
  exp = experiments.Experiment(name="bad", config=config_file, root=str(tmp_path / "out"),
                               sweep=[{"objective.kwargs.eps": 0.1}, {"objective.epsilon": 0.2}])
  with pytest.raises(ConfigError, match=r"work unit 1 .*config field 'objective.epsilon' does not exist"):
    experiments.plan(exp)
  with pytest.raises(ConfigError, match="'objective.epsilon' does not exist"):
    experiments.run_local(exp)
  assert not (tmp_path / "out").exists(), "nothing may be written or started before every work unit is valid"
  # the same through the command line: a usage error naming the field, nothing launched
  cli = subprocess.run([sys.executable, "-m", "launch.xm_launch", "--backend=local", "--name=bad",
                        f"--config={config_file}", "--sweep=objective.kwargs.eps=0.1,0.2", "--set=rl.stepz=3",
                        f"--root={tmp_path / 'cli'}"], cwd=REPO, capture_output=True, text=True, timeout=600)
  assert cli.returncode == 2, cli.stderr  # a usage error: one paragraph, no traceback
  assert "config field 'rl.stepz' does not exist" in cli.stderr and "Traceback" not in cli.stderr
  assert not (tmp_path / "cli").exists()


def test_values_the_field_cannot_take_are_named(tmp_path, config_file):
  bad_type = experiments.Experiment(name="t", config=config_file, sweep=[{"rl.steps": "many"}], root=str(tmp_path))
  with pytest.raises(ConfigError, match=r"config field 'rl.steps' cannot take 'many'"):
    experiments.plan(bad_type)
  out_of_range = experiments.Experiment(name="r", config=config_file, sweep=[{"rl.temperature": -1.0}],
                                        root=str(tmp_path))
  with pytest.raises(ConfigError, match=r"rl.temperature=-1.0: expected a finite number > 0"):
    experiments.plan(out_of_range)
  with pytest.raises(ConfigError, match="experiment config .*no such file"):
    experiments.plan(experiments.Experiment(name="m", config=str(tmp_path / "nope.py")))


def test_local_eps_sweep_writes_each_work_unit_to_its_own_folder(tmp_path, config_file, compile_cache, monkeypatch):
  exp = experiments.Experiment(name="eps_sweep", config=config_file, root=str(tmp_path),
                               overrides={"rl.steps": 2},
                               sweep=[{"objective.kwargs.eps": 0.1}, {"objective.kwargs.eps": 0.3}])
  for k, v in cache_env(compile_cache).items():  # the work units' processes inherit the environment
    if k.startswith("JAX_"):
      monkeypatch.setenv(k, v)
  results = experiments.run_local(exp, parallel=2, timeout_s=1200)
  assert [r.ok for r in results] == [True, True], [open(j.log).read()[-2000:] for r in results for j in r.jobs]
  folders = [r.unit.directory for r in results]
  assert len(set(folders)) == 2 and all(os.path.dirname(f) == str(tmp_path / "eps_sweep") for f in folders)
  for r, eps in zip(results, ("0.1", "0.3")):
    d = r.unit.directory
    for name in ("metrics.jsonl", "curves.png", "summary.json", "work_unit.json", "logs/learner_0.log"):
      assert os.path.isfile(os.path.join(d, name)), (d, name)
    records = [json.loads(line) for line in open(os.path.join(d, "metrics.jsonl"))]
    assert max(rec["step"] for rec in records) == 2 and any("reward/mean" in rec for rec in records)
    record = json.load(open(os.path.join(d, "work_unit.json")))
    assert record["ok"] and record["point"] == {"objective.kwargs.eps": eps}
    assert f"--config.objective.kwargs.eps={eps}" in record["jobs"][0]["command"]
    assert json.load(open(os.path.join(d, "summary.json")))["rl_steps"] == 2
  index = json.load(open(tmp_path / "eps_sweep" / "experiment.json"))
  assert [u["directory"] for u in index["work_units"]] == folders


def test_job_specs_of_a_multi_host_work_unit_with_sampler_nodes(tmp_path, config_file):
  exp = experiments.Experiment(name="big", config=config_file, root=str(tmp_path), learner_processes=2,
                               devices_per_process=4, samplers=2, sweep=[{"objective.kwargs.eps": 0.2}])
  (unit,) = experiments.plan(exp)
  jobs = unit.jobs(experiments.Addresses(coordinator="127.0.0.1:7000", ray_head="127.0.0.1:7001"))
  assert [j.name for j in jobs] == ["sampler_0", "sampler_1", "learner_0", "learner_1"]
  assert jobs[0].args[:3] == ("start", "--head", "--port=7001") and "--block" in jobs[0].args
  assert "--address=127.0.0.1:7001" in jobs[1].args
  learner = jobs[3].args
  for flag in ("--config.objective.kwargs.eps=0.2", "--config.rollout.mode=pipeline",
               "--config.rollout.address=127.0.0.1:7001", f"--run_dir={unit.directory}", "--process_id=1",
               "--coordinator_address=127.0.0.1:7000"):
    assert flag in learner, flag
  assert not os.path.exists(unit.directory)  # planning writes nothing


def test_launch_scripts_parse_sweeps_into_work_units(config_file):
  from launch import xm_launch
  exp = xm_launch.build_experiment("s", config_file, ["objective.kwargs.eps=0.1,0.2", "rl.temperature=0.5,1.0"],
                                   ["rl.steps=3", "model.batch_invariant=false"])
  assert exp.sweep == [{"objective.kwargs.eps": e, "rl.temperature": t} for e in (0.1, 0.2) for t in (0.5, 1.0)]
  assert exp.overrides == {"rl.steps": 3, "model.batch_invariant": False}
  assert len(experiments.plan(exp)) == 4


def test_xm_backend_says_which_extra_to_install(monkeypatch):
  monkeypatch.setitem(sys.modules, "xmanager", None)
  from jaxrl_llm.experiments import xm_backend
  with pytest.raises(ImportError, match=r"pip install 'jaxrl_llm\[xm\]'"):
    xm_backend.import_xm()


def test_xm_job_groups_built_with_the_real_api(tmp_path, config_file):
  pytest.importorskip("xmanager", reason="the [xm] extra is not installed")
  from xmanager import xm
  from xmanager.xm_local import executables as local_executables

  from jaxrl_llm.experiments import xm_backend
  x, xm_local = xm_backend.import_xm()
  exp = experiments.Experiment(name="xm", config=config_file, root=str(tmp_path), learner_processes=2,
                               overrides={"rl.steps": 2},
                               sweep=[{"objective.kwargs.eps": 0.1}, {"objective.kwargs.eps": 0.3}])
  units = experiments.plan(exp)
  pk = xm_backend.packageables(x, xm_local, samplers=False)
  assert isinstance(pk["learner"], xm.Packageable) and pk["learner"].executable_spec.path == sys.executable
  executables = {"learner": local_executables.LocalBinary(name="learner", command=sys.executable,
                                                          args=xm.SequentialArgs.from_collection(["-m", "launch.train"]))}
  addresses = experiments.Addresses(coordinator="127.0.0.1:7100")
  group = xm_backend.job_group(x, executables, xm_local.Local(), units[1], addresses)
  assert isinstance(group, xm.JobGroup) and sorted(group.jobs) == ["learner_0", "learner_1"]
  job = group.jobs["learner_1"]
  assert isinstance(job, xm.Job) and job.executable is executables["learner"]
  merged = xm.merge_args(job.args, xm_backend.work_unit_args(units[1])["learner_1"]["args"]).to_list()
  for flag in ("--config.objective.kwargs.eps=0.3", "--config.rl.steps=2", f"--run_dir={units[1].directory}",
               "--process_id=1", "--coordinator_address=127.0.0.1:7100"):
    assert flag in merged, (flag, merged)
  assert "--config.objective.kwargs.eps=0.1" not in merged
