"""Sampler actors on GPUs: placement, the learner's GPUs kept apart, engine settings at the vLLM boundary.

The machine has no GPU. Ray accepts GPUs declared at start-up (``num_gpus`` with
``CUDA_VISIBLE_DEVICES`` naming them) and then assigns them to actors that ask for GPUs,
setting each actor's ``CUDA_VISIBLE_DEVICES``, exactly as on a GPU node. The vLLM actors
build the real ``VllmSampler`` up to ``vllm.LLM(**kwargs)``, which a stand-in package
(``tests/fake_vllm``) records instead of starting an engine.
"""

import dataclasses
import json
import os
import sys
import types

import jax
import numpy as np
import pytest

from jaxrl_llm import bridge, configuration as C, jobs, models
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.jobs.collect import vllm_engine_config
from jaxrl_llm.rollout import SamplerPool, SamplerSpec, placement, sources
from jaxrl_llm.sampling import SamplerConfig
from jaxrl_llm.sampling.vllm_engine import VllmEngineConfig

sys.path.insert(0, os.path.dirname(__file__))
from tiny_configs import tiny_config  # noqa: E402

FAKE_VLLM = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fake_vllm")
MACHINE = ["0", "1", "2", "3", "5", "7"]  # this "machine's" GPUs (CUDA_VISIBLE_DEVICES)
LEARNER = ["0", "1"]  # the learner's JAX devices
SAMPLER_GPUS = ["2", "3", "5", "7"]
CONFIG = models.tiny("qwen2", vocab_size=48, hidden_size=32, intermediate_size=64, num_layers=1,
                     max_position_embeddings=32, pad_token_id=0, eos_token_id=1)
TOKENIZER = bridge.build_char_tokenizer("abcdefghijklmnopqrstuvwxyz")


# ------------------------------------------------------------------------------ pure placement rules


def test_gpus_per_actor_follows_the_sampler_and_transport():
  g = placement.gpus_per_actor
  assert g("vllm", tensor_parallel_size=1) == 1 and g("vllm", tensor_parallel_size=4) == 4
  assert g("vllm", tensor_parallel_size=2, weight_transport="nccl") == 3  # the actor's own NCCL sender GPU
  assert g("vllm", tensor_parallel_size=1, actor_gpus=0.5) == 0.5  # two one-GPU engines per GPU
  assert g("jax") == 0 and g("jax", platform="gpu") == 1 and g("jax", actor_gpus=2) == 2
  with pytest.raises(ConfigError, match=r"rollout.actor_gpus=1: a vLLM sampler actor holds exactly 2 GPU"):
    g("vllm", tensor_parallel_size=2, actor_gpus=1)
  with pytest.raises(ConfigError, match=r"rollout.actor_gpus=0 with sampler.platform='gpu'"):
    g("jax", platform="gpu", actor_gpus=0)


def test_the_learners_gpus_are_never_offered_to_samplers():
  devices = [types.SimpleNamespace(platform="gpu", local_hardware_id=i) for i in range(2)]
  env = {"CUDA_VISIBLE_DEVICES": "4,6,0"}
  assert placement.learner_gpu_ids(devices, env) == ["4", "6"]  # CUDA ordinals index the visible list
  assert placement.learner_gpu_ids([types.SimpleNamespace(platform="cpu", local_hardware_id=0)], env) == []
  assert placement.local_sampler_gpus("auto", LEARNER, MACHINE) == SAMPLER_GPUS
  assert placement.local_sampler_gpus("none", LEARNER, MACHINE) == []
  assert placement.local_sampler_gpus("3,5", LEARNER, MACHINE) == ["3", "5"]
  with pytest.raises(ConfigError, match=r"rollout.local_gpus='1,2': GPU\(s\) \['1'\] are the learner's"):
    placement.local_sampler_gpus("1,2", LEARNER, MACHINE)
  for bad in ("a,b", "1,1", "-1"):
    with pytest.raises(ConfigError, match="rollout.local_gpus"):
      placement.parse_gpu_ids(bad)


def test_capacity_errors_name_the_setting_before_any_actor_starts():
  need = placement.ActorResources(cpus=1, gpus=4)
  with pytest.raises(ConfigError, match=r"needs 4 GPU\(s\) on one node \(sampler.vllm.tensor_parallel_size\), but "
                                        r"the largest node of nodes declares 2"):
    placement.check_capacity(need, 1, [2, 2], cluster="nodes", kind="vllm", weight_transport="object_store")
  with pytest.raises(ConfigError, match=r"rollout.num_samplers=3: nodes has room for 2 sampler actor\(s\)"):
    placement.check_capacity(need, 3, [8, 3, 3], cluster="nodes", kind="vllm", weight_transport="object_store")
  placement.check_capacity(need, 3, [8, 4], cluster="nodes", kind="vllm", weight_transport="object_store")


def pipeline_config(**overrides):
  c = C.base_config()
  c.rollout.mode = "pipeline"
  for path, value in overrides.items():
    C.override(c, path, value)
  return c


@pytest.mark.parametrize("overrides, field", [
    ({"sampler.kind": "vllm", "sampler.vllm.tensor_parallel_size": 4, "rollout.local_gpus": "0,1"},
     "sampler.vllm.tensor_parallel_size"),
    ({"sampler.kind": "vllm", "rollout.weight_transport": "nccl", "rollout.local_gpus": "0", }, "'nccl'"),
    ({"sampler.kind": "vllm", "rollout.num_samplers": 3, "rollout.local_gpus": "0,1"}, "rollout.num_samplers=3"),
    ({"rollout.weight_transport": "ipc"}, "rollout.weight_transport='ipc' with sampler.kind='jax'"),
    ({"sampler.kind": "vllm", "rollout.actor_gpus": 0.5}, "gpu_memory_utilization=0.85 with rollout.actor_gpus=0.5"),
    ({"sampler.platform": "gpu", "rollout.mode": "sync"}, "sampler.platform='gpu' with rollout.mode='sync'"),
    ({"sampler.vllm.gpu_memory_utilization": 1.5}, "sampler.vllm.gpu_memory_utilization"),
    ({"rollout.local_gpus": "first"}, "rollout.local_gpus='first'"),
])
def test_impossible_gpu_settings_fail_validation_naming_the_field(overrides, field):
  with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace(".", r"\.")):
    C.validate(pipeline_config(**overrides))


def test_every_vllm_setting_reaches_the_engine_arguments():
  c = pipeline_config(**{"sampler.kind": "vllm", "sampler.vllm.tensor_parallel_size": 2,
                         "sampler.vllm.gpu_memory_utilization": 0.6, "sampler.vllm.dtype": "float16",
                         "sampler.vllm.max_model_len": 96, "sampler.vllm.enable_prefix_caching": False,
                         "sampler.vllm.enforce_eager": True, "sampler.vllm.seed": 11,
                         "rollout.weight_transport": "ipc", "rollout.weight_bucket_mb": 64})
  C.validate(c)
  engine = vllm_engine_config(c)
  assert (engine.transport, engine.bucket_bytes) == ("ipc", 64 * 2**20)
  kwargs = engine.llm_kwargs("/m", CONFIG, SamplerConfig(max_new_tokens=8))
  assert {k: kwargs[k] for k in ("tensor_parallel_size", "gpu_memory_utilization", "dtype", "max_model_len",
                                 "enable_prefix_caching", "enforce_eager", "seed", "distributed_executor_backend")} == {
      "tensor_parallel_size": 2, "gpu_memory_utilization": 0.6, "dtype": "float16", "max_model_len": 96,
      "enable_prefix_caching": False, "enforce_eager": True, "seed": 11, "distributed_executor_backend": "mp"}
  # in an actor holding its GPUs: IPC buffers on each engine GPU, the NCCL sender on the extra one
  actor = engine.in_actor(nccl_port=4321)
  assert actor.ipc_devices == ("cuda:0", "cuda:1") and actor.make_transport(CONFIG).devices == ("cuda:0", "cuda:1")
  nccl = dataclasses.replace(engine, transport="nccl").in_actor(nccl_port=4321)
  assert (nccl.nccl_device, nccl.nccl_host, nccl.nccl_port) == ("cuda:2", "127.0.0.1", 4321)
  default = vllm_engine_config(pipeline_config(**{"sampler.kind": "vllm", "seed": 5}))
  assert default.seed == 5 and default.dtype is None and default.max_model_len is None  # -1 / auto / 0: derived


# ------------------------------------------------------------------------------ on a Ray cluster with declared GPUs


@pytest.fixture(scope="module")
def gpu_cluster():
  """A local cluster started the way a learner on a 6-GPU machine (GPUs 0 and 1 its own) starts it."""
  ray = pytest.importorskip("ray")
  ray.shutdown()
  saved = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "PYTHONPATH")}
  os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(MACHINE)
  os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (FAKE_VLLM, saved["PYTHONPATH"]) if p)  # actors only
  mp = pytest.MonkeyPatch()
  mp.setattr(placement, "learner_gpu_ids", lambda *a, **k: list(LEARNER))
  try:
    from jaxrl_llm.rollout import cluster
    cluster.ensure_ray(None, num_cpus=4,
                       gpu_ids=placement.local_sampler_gpus("auto", placement.learner_gpu_ids(),
                                                            placement.machine_gpu_ids()))
  finally:
    for k, v in saved.items():
      if v is None:
        os.environ.pop(k, None)
      else:
        os.environ[k] = v
  yield ray
  mp.undo()
  ray.shutdown()


def vllm_pool(params, hf_dir, tp, num, engine=None):
  engine = engine or VllmEngineConfig(tensor_parallel_size=tp, transport="ipc", gpu_memory_utilization=0.7,
                                      max_model_len=40, enforce_eager=True, seed=3)
  return sources.start_sampler_pool(model_config=CONFIG, sampler_config=SamplerConfig(max_new_tokens=4),
                                    tokenizer=TOKENIZER, params=params, version=0, num_samplers=num, kind="vllm",
                                    export_dir=str(hf_dir), actor_cpus=0.25, engine=engine)


def test_actors_get_disjoint_gpus_never_the_learners_and_the_configured_engine(gpu_cluster, tmp_path):
  ray = gpu_cluster
  assert ray.cluster_resources().get("GPU") == len(SAMPLER_GPUS)
  assert placement.learner_node_gpus(ray) == len(SAMPLER_GPUS)  # this host's node (a joined cluster warns)
  params = models.init_params(CONFIG, jax.random.PRNGKey(0))
  tp1 = vllm_pool(params, tmp_path / "a", tp=1, num=2)
  tp2 = vllm_pool(params, tmp_path / "b", tp=2, num=1)
  cpu = SamplerPool(SamplerSpec(model_config=CONFIG, sampler_config=SamplerConfig(max_new_tokens=4),
                                fingerprint=bridge.make_fingerprint(TOKENIZER, CONFIG).to_dict()),
                    params, 0, num_samplers=1, actor_cpus=0.25, validate=lambda chunk: [])
  try:
    actors = tp1.describe() + tp2.describe()
    ids = [a["gpu_ids"] for a in actors]
    assert [len(i) for i in ids] == [1, 1, 2]
    flat = [g for i in ids for g in i]
    assert sorted(flat) == sorted(SAMPLER_GPUS) and not set(flat) & set(LEARNER)  # disjoint, none the learner's
    for actor in actors:
      assert actor["cuda_visible_devices"].split(",") == actor["gpu_ids"]  # what the engine's workers inherit
      kwargs = actor["engine_kwargs"]
      assert actor["weight_transport"] == "ipc"
      assert {k: kwargs[k] for k in ("gpu_memory_utilization", "max_model_len", "enforce_eager", "seed")} == {
          "gpu_memory_utilization": 0.7, "max_model_len": 40, "enforce_eager": True, "seed": 3}
      assert kwargs["tensor_parallel_size"] == len(actor["gpu_ids"])
      assert ("distributed_executor_backend" in kwargs) == (len(actor["gpu_ids"]) > 1)
      assert kwargs["worker_extension_cls"] == "third_party.vllm_weight_sync.WeightSyncExtension"
      assert actor["jax_platforms"] == "cpu"  # the GPUs are the engine's: JAX in a vLLM actor stays off them
    (jax_actor,) = cpu.describe()
    assert jax_actor["gpu_ids"] == [] and jax_actor["cuda_visible_devices"] == ""  # a CPU actor sees no GPU
    assert jax_actor["jax_platforms"] == "cpu"
  finally:
    for pool in (tp1, tp2, cpu):
      pool.shutdown()
  assert {g["state"] for g in ray.util.placement_group_table().values()} == {"REMOVED"}  # reservations released


def test_a_tensor_parallel_size_larger_than_any_node_fails_before_an_actor_starts(gpu_cluster, tmp_path):
  params = models.init_params(CONFIG, jax.random.PRNGKey(0))
  before = len(gpu_cluster.util.placement_group_table())
  with pytest.raises(ConfigError, match=r"each sampler actor needs 8 GPU\(s\) on one node "
                                        r"\(sampler.vllm.tensor_parallel_size\).*declares 4"):
    vllm_pool(params, tmp_path, tp=8, num=1)
  assert len(gpu_cluster.util.placement_group_table()) == before  # nothing was reserved or started


def test_pipeline_with_jax_actors_placed_on_declared_gpus_trains(gpu_cluster, tmp_path):
  run = jobs.RLJob(tiny_config(tmp_path, rl__steps=3, checkpoint__every=100, export__hf=False, eval__every=100,
                               rollout__mode="pipeline", rollout__num_samplers=2, rollout__max_lag=1,
                               rollout__actor_gpus=1.0, rollout__actor_cpus=0.25))
  run.train()
  records = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  rl = [r for r in records if "pipeline/queued_steps" in r]
  assert len(rl) == 3 and all(np.isfinite(r["loss"]) for r in rl)
  assert all(r["pool/lost_items"] == 0 and r["pool/rejected"] == 0 for r in rl)
  actors = json.load(open(tmp_path / "summary.json"))["sampler_placement"]
  ids = [a["gpu_ids"] for a in actors]
  assert [len(i) for i in ids] == [1, 1] and len({i[0] for i in ids}) == 2 and {i[0] for i in ids} <= set(SAMPLER_GPUS)
  assert all(a["jax_platforms"] == "cpu" for a in actors)  # GPUs reserved, JAX on the CPU (rollout.actor_gpus=1)
  assert {g["state"] for g in gpu_cluster.util.placement_group_table().values()} == {"REMOVED"}  # GPUs given back


def test_a_sampler_gpu_that_is_the_learners_is_refused_before_an_actor_starts(gpu_cluster, tmp_path):
  params = models.init_params(CONFIG, jax.random.PRNGKey(0))
  spec = SamplerSpec(model_config=CONFIG, sampler_config=SamplerConfig(max_new_tokens=4),
                     fingerprint=bridge.make_fingerprint(TOKENIZER, CONFIG).to_dict(), actor_gpus=1.0)
  before = len(gpu_cluster.util.placement_group_table())
  with pytest.raises(ConfigError, match=r"rollout.local_gpus='1,2': GPU\(s\) \['1'\] are the learner's"):
    SamplerPool(spec, params, 0, num_samplers=1, actor_cpus=0.25, local_gpus="1,2", validate=lambda chunk: [])
  assert len(gpu_cluster.util.placement_group_table()) == before
