"""Experiments: sweep validation before launch, a local 2-work-unit sweep end to end, XManager job groups."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_determinism import REPO, cache_env, compile_cache  # noqa: E402,F401

from jaxrl_llm import experiments  # noqa: E402
from jaxrl_llm.configuration import ConfigError  # noqa: E402
from jaxrl_llm.experiments.definition import addresses_for  # noqa: E402

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


def _no_free_port() -> int:
  raise AssertionError("an explicit address was given: no free port may be picked")


def _ports(start: int = 7000):
  """A stand-in for ``local.free_port``: 7000, 7001, ..."""
  ports = iter(range(start, start + 100))
  return lambda: next(ports)


CLUSTER_HEAD = "sampler-0.cluster:6379"
VLLM_TP2 = {"sampler.kind": "vllm", "sampler.vllm.tensor_parallel_size": 2, "rollout.num_samplers": 8,
            "rollout.weight_transport": "ipc", "rollout.max_lag": 2}


def test_job_specs_of_a_multi_host_work_unit(tmp_path, config_file):
  exp = experiments.Experiment(name="big", config=config_file, root=str(tmp_path), learner_processes=2,
                               devices_per_process=4, sweep=[{"objective.kwargs.eps": 0.2}])
  (unit,) = experiments.plan(exp)
  addresses = addresses_for(exp, _ports())
  assert addresses == experiments.Addresses(coordinator="127.0.0.1:7000", ray_head="")
  jobs = unit.jobs(addresses)
  assert [j.name for j in jobs] == ["learner_0", "learner_1"]
  learner = jobs[1].args
  for flag in ("--config.objective.kwargs.eps=0.2", f"--run_dir={unit.directory}", "--num_processes=2",
               "--process_id=1", "--coordinator_address=127.0.0.1:7000"):
    assert flag in learner, flag
  assert not any("rollout" in a for a in learner)
  assert jobs[1].env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
  cluster = dataclasses.replace(exp, coordinator="learner-0.cluster:8476")
  assert addresses_for(cluster, _no_free_port).coordinator == "learner-0.cluster:8476"
  assert not os.path.exists(unit.directory)  # planning writes nothing


def test_local_sampler_nodes_bind_loopback_on_every_node(tmp_path, config_file):
  exp = experiments.Experiment(name="local", config=config_file, root=str(tmp_path), samplers=2, sampler_cpus=2,
                               sweep=[{"objective.kwargs.eps": 0.2}])
  (unit,) = experiments.plan(exp)
  addresses = addresses_for(exp, _ports(7001))
  assert addresses == experiments.Addresses(coordinator="", ray_head="127.0.0.1:7001")
  jobs = unit.jobs(addresses)
  assert [j.name for j in jobs] == ["sampler_0", "sampler_1", "learner_0"]
  head, node, learner = (j.args for j in jobs)
  assert head == ("start", "--head", "--port=7001", "--node-ip-address=127.0.0.1", "--dashboard-host=127.0.0.1",
                  "--include-dashboard=false", "--num-cpus=2", "--num-gpus=0", "--block", "--disable-usage-stats")
  assert node == ("start", "--address=127.0.0.1:7001", "--node-ip-address=127.0.0.1", "--num-cpus=2",
                  "--num-gpus=0", "--block", "--disable-usage-stats")
  for flag in ("--config.objective.kwargs.eps=0.2", "--config.rollout.mode=pipeline",
               "--config.rollout.address=127.0.0.1:7001", f"--run_dir={unit.directory}"):
    assert flag in learner, flag
  assert not any(a.startswith(("--num_processes", "--coordinator_address")) for a in learner)
  # an explicit loopback head (``localhost``) binds loopback too
  local = dataclasses.replace(exp, ray_head="localhost:6380")
  (unit,) = experiments.plan(local)
  assert all("--node-ip-address=127.0.0.1" in j.args for j in unit.jobs(addresses_for(local, _no_free_port))
             if j.kind == "sampler")
  assert not os.path.exists(unit.directory)


def test_cluster_sampler_nodes_get_the_cluster_address_and_their_gpus(tmp_path, config_file):
  exp = experiments.Experiment(name="cluster", config=config_file, root=str(tmp_path), samplers=2, sampler_cpus=16,
                               sampler_gpus=8, ray_head=CLUSTER_HEAD, overrides=VLLM_TP2)
  (unit,) = experiments.plan(exp)
  addresses = addresses_for(exp, _no_free_port)
  assert addresses == experiments.Addresses(coordinator="", ray_head="sampler-0.cluster:6379")
  head, node, learner = (j.args for j in unit.jobs(addresses))
  assert head == ("start", "--head", "--port=6379", "--include-dashboard=false", "--num-cpus=16", "--num-gpus=8",
                  "--block", "--disable-usage-stats")
  assert node == ("start", "--address=sampler-0.cluster:6379", "--num-cpus=16", "--num-gpus=8", "--block",
                  "--disable-usage-stats")
  assert not any("127.0.0.1" in a for a in head + node)  # Ray binds each node's own address
  for flag in ("--config.sampler.kind=vllm", "--config.sampler.vllm.tensor_parallel_size=2",
               "--config.rollout.num_samplers=8", "--config.rollout.weight_transport=ipc",
               "--config.rollout.mode=pipeline", "--config.rollout.address=sampler-0.cluster:6379"):
    assert flag in learner, flag
  # 16 engines at tensor-parallel size 1 fit the same nodes; 17 do not
  tp1 = dict(VLLM_TP2, **{"sampler.vllm.tensor_parallel_size": 1, "rollout.num_samplers": 16})
  assert len(experiments.plan(dataclasses.replace(exp, overrides=tp1))) == 1
  with pytest.raises(ConfigError, match=r"rollout.num_samplers=17: the experiment's Ray cluster \(samplers=2 nodes, "
                                        r"sampler_gpus=8 each\) has room for 16"):
    experiments.plan(dataclasses.replace(exp, overrides=dict(tp1, **{"rollout.num_samplers": 17})))


IMPOSSIBLE = {
    "multi-process learner with sampler nodes": (
        dict(learner_processes=2, samplers=1, sampler_cpus=2), {},
        r"learner_processes=2 with samplers=1: the Ray sampler pool is driven from one learner process"),
    "multi-process learner with a pipeline config": (
        dict(learner_processes=2), {"rollout.mode": "pipeline"},
        r"work unit 0 .*rollout.mode='pipeline' with experiment learner_processes=2: the Ray sampler pool is driven "
        r"from one learner process"),
    "negative sampler_gpus": (dict(samplers=1, sampler_gpus=-1), {}, r"experiment sampler_gpus=-1: expected >= 0"),
    "GPUs on sampler nodes that all run on this machine": (
        dict(samplers=2, sampler_gpus=4, ray_head="localhost:6379"), VLLM_TP2,
        r"sampler_gpus=4 with ray_head='localhost:6379' \(every sampler node on this machine\): each node would hand "
        r"out GPUs 0..3 of the machine"),
    "ray_head without a port": (dict(samplers=1, ray_head="sampler-0"), {},
                                r"experiment ray_head='sampler-0': expected host:port with an integer port"),
    "ray_head with a text port": (dict(samplers=1, ray_head="sampler-0:ray"), {}, r"ray_head='sampler-0:ray'"),
    "coordinator without a host": (dict(learner_processes=2, coordinator=":8476"), {},
                                   r"experiment coordinator=':8476': expected host:port"),
    "coordinator with a port out of range": (dict(learner_processes=2, coordinator="h:70000"), {},
                                             r"coordinator='h:70000': expected host:port"),
    "coordinator of a single learner process": (dict(coordinator="learner-0:8476"), {},
                                                r"coordinator='learner-0:8476' with learner_processes=1: expected "
                                                r"learner_processes > 1"),
    "sampler nodes without CPUs": (dict(samplers=1, sampler_cpus=0), {}, r"experiment sampler_cpus=0: expected >= 1"),
    "ray_head without sampler nodes": (dict(ray_head="sampler-0:6379"), {},
                                       r"ray_head='sampler-0:6379' with samplers=0: expected samplers > 0"),
    "config sets rollout.address with sampler nodes": (
        dict(samplers=1), {"rollout.num_samplers": 1, "rollout.address": "10.0.0.1:6379"},
        r"rollout.address='10.0.0.1:6379' with experiment samplers=1: the experiment starts its own sampler nodes"),
    "tensor-parallel size larger than a node's GPUs": (
        dict(samplers=2, sampler_cpus=8, sampler_gpus=2, ray_head=CLUSTER_HEAD),
        dict(VLLM_TP2, **{"sampler.vllm.tensor_parallel_size": 4}),
        r"each sampler actor needs 4 GPU\(s\) on one node \(sampler.vllm.tensor_parallel_size\), but the largest node "
        r"of the experiment's Ray cluster \(samplers=2 nodes, sampler_gpus=2 each\) declares 2"),
    "vLLM on CPU-only sampler nodes": (
        dict(samplers=2, sampler_cpus=8), VLLM_TP2,
        r"needs 2 GPU\(s\) on one node \(sampler.vllm.tensor_parallel_size\).*sampler_gpus=0 each"),
    "nccl's extra GPU per actor": (
        dict(samplers=2, sampler_cpus=8, sampler_gpus=8, ray_head=CLUSTER_HEAD),
        dict(VLLM_TP2, **{"rollout.weight_transport": "nccl"}),
        r"rollout.num_samplers=8: .*room for 4 sampler actor\(s\) of 3 GPU\(s\) each "
        r"\(sampler.vllm.tensor_parallel_size \+ 1 for rollout.weight_transport='nccl'"),
    "JAX samplers on GPUs the nodes do not declare": (
        dict(samplers=1, sampler_cpus=2), {"sampler.platform": "gpu"},
        r"needs 1 GPU\(s\) on one node \(sampler.platform='gpu'\).*sampler_gpus=0 each"),
    "more actors than the nodes' CPUs": (
        dict(samplers=1), {"rollout.num_samplers": 2},
        r"rollout.num_samplers=2: the experiment's sampler nodes \(samplers=1, sampler_cpus=1, sampler_gpus=0 each\) "
        r"hold 1 sampler actor\(s\) of rollout.actor_cpus=1 CPU\(s\)"),
}


@pytest.mark.parametrize("case", sorted(IMPOSSIBLE))
def test_impossible_layouts_fail_in_plan_naming_the_field(tmp_path, config_file, case):
  settings, overrides, message = IMPOSSIBLE[case]
  exp = experiments.Experiment(name="bad", config=config_file, root=str(tmp_path / "out"), overrides=overrides,
                               **settings)
  with pytest.raises(ConfigError, match=message):
    experiments.plan(exp)
  with pytest.raises(ConfigError, match=message):
    experiments.run_local(exp)
  assert not (tmp_path / "out").exists(), "nothing may be written or started before the layout is valid"


def test_sampler_nodes_need_the_ray_command(tmp_path, config_file, monkeypatch):
  from jaxrl_llm.experiments import planning
  monkeypatch.setattr(planning.shutil, "which", lambda name: None)
  exp = experiments.Experiment(name="noray", config=config_file, root=str(tmp_path / "out"), samplers=2)
  with pytest.raises(ConfigError, match=r"experiment samplers=2: the `ray` command is not on PATH"):
    experiments.plan(exp)
  assert not (tmp_path / "out").exists()


def test_fixed_addresses_are_refused_for_concurrent_work_units(tmp_path, config_file, monkeypatch):
  from jaxrl_llm.experiments import xm_backend
  exp = experiments.Experiment(name="two", config=config_file, root=str(tmp_path / "out"), learner_processes=2,
                               coordinator="learner-0.cluster:8476",
                               sweep=[{"objective.kwargs.eps": 0.1}, {"objective.kwargs.eps": 0.2}])
  assert len(experiments.plan(exp)) == 2  # sequential local runs may reuse the address
  with pytest.raises(ConfigError, match=r"parallel=2 with experiment coordinator='learner-0.cluster:8476'"):
    experiments.run_local(exp, parallel=2)
  monkeypatch.setattr(xm_backend, "import_xm", lambda: pytest.fail("XManager may not be reached"))
  with pytest.raises(ConfigError, match=r"coordinator='learner-0.cluster:8476' with 2 work units"):
    xm_backend.launch(exp)
  assert not (tmp_path / "out").exists()


class _FakeXm:
  """The few XManager names :func:`xm_backend.launch` uses, recording what it is given."""

  class Job:

    def __init__(self, executable, executor, name, args, env_vars):
      self.executable, self.executor, self.name, self.args, self.env_vars = executable, executor, name, args, env_vars

  class JobGroup:

    def __init__(self, **jobs):
      self.jobs = jobs


class _FakeXmLocal:

  class Local:
    pass

  def __init__(self):
    self.added = []

  def create_experiment(self, experiment_title):
    outer = self

    class Experiment:

      def __enter__(self):
        return self

      def __exit__(self, *exc):
        return False

      def package(self, packageables):
        return [f"packaged:{p}" for p in packageables]

      def add(self, group, args):
        outer.added.append((group, args))

    del experiment_title
    return Experiment()


def test_xm_backend_gives_a_cluster_executor_the_cluster_addresses(tmp_path, config_file, monkeypatch):
  from jaxrl_llm.experiments import xm_backend
  xm_local = _FakeXmLocal()
  monkeypatch.setattr(xm_backend, "import_xm", lambda: (_FakeXm, xm_local))
  monkeypatch.setattr(xm_backend, "free_port", _no_free_port)
  exp = experiments.Experiment(name="cluster", config=config_file, root=str(tmp_path), samplers=2, sampler_cpus=16,
                               sampler_gpus=8, ray_head="sampler-0.cluster:6379", overrides=VLLM_TP2)
  with pytest.raises(ConfigError, match=r"launch packages=\['learner'\]: expected a packageable for \['sampler'\]"):
    xm_backend.launch(exp, executor="cluster-executor", packages={"learner": "learner-container"})
  xm_backend.launch(exp, executor="cluster-executor", packages={"learner": "learner-container",
                                                                 "sampler": "ray-container"})
  ((group, args),) = xm_local.added
  assert sorted(group.jobs) == ["learner_0", "sampler_0", "sampler_1"]
  assert all(j.executor == "cluster-executor" for j in group.jobs.values())
  assert group.jobs["sampler_0"].executable == "packaged:ray-container"
  assert group.jobs["sampler_0"].args[:3] == ["start", "--head", "--port=6379"]
  assert "--address=sampler-0.cluster:6379" in group.jobs["sampler_1"].args
  assert "--num-gpus=8" in group.jobs["sampler_1"].args
  assert not any("127.0.0.1" in a for j in ("sampler_0", "sampler_1") for a in group.jobs[j].args)
  assert group.jobs["learner_0"].args["config.rollout.address"] == "sampler-0.cluster:6379"
  assert args["learner_0"]["args"]["run_dir"].endswith("00_base")


def test_launch_scripts_parse_sweeps_into_work_units(config_file):
  from launch import xm_launch
  exp = xm_launch.build_experiment("s", config_file, ["objective.kwargs.eps=0.1,0.2", "rl.temperature=0.5,1.0"],
                                   ["rl.steps=3", "model.batch_invariant=false"])
  assert exp.sweep == [{"objective.kwargs.eps": e, "rl.temperature": t} for e in (0.1, 0.2) for t in (0.5, 1.0)]
  assert exp.overrides == {"rl.steps": 3, "model.batch_invariant": False}
  assert len(experiments.plan(exp)) == 4
  cluster = xm_launch.build_experiment("c", config_file, [], ["rollout.num_samplers=4"], samplers=2, sampler_cpus=4,
                                       sampler_gpus=8, ray_head="sampler-0.cluster:6379")
  assert (cluster.samplers, cluster.sampler_cpus, cluster.sampler_gpus, cluster.ray_head, cluster.coordinator) == (
      2, 4, 8, "sampler-0.cluster:6379", "")
  assert len(experiments.plan(cluster)) == 1


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
