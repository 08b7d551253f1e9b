"""launch/gpu_check.py's pipeline part without a GPU: layouts, config overrides, run summaries, and one real
PipelineRL run of the same runner with JAX sampler actors on the CPU (a local Ray cluster on loopback)."""

import json
import math
import os
import subprocess
import sys

import pytest

from launch import gpu_check, gpu_engine, gpu_layouts, gpu_pipeline
from jaxrl_llm.rollout import placement

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (tensor-parallel size, transport) -> actors that run, or the skip reason; per visible GPU count
EXPECTED = {
    0: {(1, "object_store"): "skipped: needs 1 GPUs, 0 visible", (1, "ipc"): "skipped: needs 1 GPUs, 0 visible",
        (1, "nccl"): "skipped: needs 2 GPUs, 0 visible", (2, "object_store"): "skipped: needs 2 GPUs, 0 visible",
        (2, "ipc"): "skipped: needs 2 GPUs, 0 visible", (2, "nccl"): "skipped: needs 3 GPUs, 0 visible"},
    1: {(1, "object_store"): 2, (1, "ipc"): 2, (1, "nccl"): "skipped: needs 2 GPUs, 1 visible",
        (2, "object_store"): "skipped: needs 2 GPUs, 1 visible", (2, "ipc"): "skipped: needs 2 GPUs, 1 visible",
        (2, "nccl"): "skipped: needs 3 GPUs, 1 visible"},
    2: {(1, "object_store"): 2, (1, "ipc"): 2, (1, "nccl"): 1, (2, "object_store"): 1, (2, "ipc"): 1,
        (2, "nccl"): "skipped: needs 3 GPUs, 2 visible"},
    4: {(1, "object_store"): 2, (1, "ipc"): 2, (1, "nccl"): 2, (2, "object_store"): 2, (2, "ipc"): 2, (2, "nccl"): 1},
    8: {(1, "object_store"): 2, (1, "ipc"): 2, (1, "nccl"): 2, (2, "object_store"): 2, (2, "ipc"): 2, (2, "nccl"): 2},
}


def _config(layout, run_dir="/tmp/gpu_check_test_run"):
  return gpu_layouts.build_run_config(gpu_layouts.run_overrides(layout, checkpoint="/ckpt", run_dir=run_dir, steps=3))


# ------------------------------------------------------------------ layouts
@pytest.mark.parametrize("num_gpus", sorted(EXPECTED))
def test_layouts_run_what_fits_and_say_why_the_rest_is_skipped(num_gpus):
  layouts = gpu_layouts.pipeline_layouts(num_gpus, gpu_layouts.TRANSPORTS)
  got = {(l["tensor_parallel_size"], l["transport"]): l["skipped"] or l["num_samplers"] for l in layouts}
  assert got == EXPECTED[num_gpus]
  for layout in layouts:
    tp, transport = layout["tensor_parallel_size"], layout["transport"]
    per_actor = tp + (transport == "nccl")
    if layout["skipped"]:
      assert layout["overrides"] is None
      assert layout["gpus_needed"] == per_actor > num_gpus
      with pytest.raises(ValueError, match="skipped"):
        gpu_layouts.run_overrides(layout, checkpoint="/ckpt", run_dir="/tmp/x")
      continue
    o = layout["overrides"]
    assert o["sampler.kind"] == "vllm" and o["rollout.weight_transport"] == transport
    assert o["sampler.vllm.tensor_parallel_size"] == tp and o["rollout.num_samplers"] == layout["num_samplers"]
    if layout["shared_gpu"]:  # one GPU: two engines of P = 1 share it, each within its share of the memory
      assert num_gpus == 1 and tp == 1 and transport != "nccl"
      assert layout["actor_gpus"] == o["rollout.actor_gpus"] == 0.5 and layout["gpus_needed"] == 1
      assert o["sampler.vllm.gpu_memory_utilization"] <= 0.4
      assert layout["name"].endswith("_shared")
    else:  # GPUs of its own: what the sampler needs (rollout.actor_gpus=-1), one more for the NCCL sender
      assert o["rollout.actor_gpus"] == -1 and layout["actor_gpus"] == per_actor
      assert layout["gpus_needed"] == per_actor * layout["num_samplers"] <= num_gpus
      assert o["sampler.vllm.gpu_memory_utilization"] == 0.4
    config = _config(layout)  # the whole run config validates
    assert config.sampler.kind == "vllm" and config.rollout.mode == "pipeline"
    assert config.sampler.vllm.tensor_parallel_size == tp and config.rollout.weight_transport == transport
    assert config.init.hf_checkpoint == "/ckpt" and config.rl.steps == 3 and not config.export.hf
    assert not config.log.progress and not config.log.tensorboard and config.eval.every > 3
    # what the pool checks before its first actor starts, on a node with num_gpus GPUs
    need = placement.gpus_per_actor("vllm", tensor_parallel_size=tp, weight_transport=transport,
                                    actor_gpus=config.rollout.actor_gpus)
    assert need == layout["actor_gpus"]
    placement.check_capacity(placement.ActorResources(1.0, need), config.rollout.num_samplers, [float(num_gpus)],
                             cluster="test", kind="vllm", weight_transport=transport)


def test_layouts_keep_the_order_and_names_and_honour_the_transport_list():
  names = [l["name"] for l in gpu_layouts.pipeline_layouts(8, ["ipc"], tensor_parallel_sizes=(2, 1))]
  assert names == ["vllm_tp2_x2_ipc", "vllm_tp1_x2_ipc"]
  one = gpu_layouts.pipeline_layouts(1, ["object_store"], gpu_memory_utilization=0.7)[0]
  assert one["gpu_memory_utilization"] == 0.4  # capped when two engines share the GPU
  own = gpu_layouts.pipeline_layouts(2, ["object_store"], gpu_memory_utilization=0.7)[0]
  assert own["gpu_memory_utilization"] == 0.7
  for bad, match in ((dict(num_gpus=-1), "num_gpus"), (dict(transports=["rdma"]), "transports"),
                     (dict(transports=[]), "transports"), (dict(sampler_kind="sglang"), "sampler_kind"),
                     (dict(num_samplers=0), "num_samplers"), (dict(tensor_parallel_sizes=[0]), "tensor_parallel"),
                     (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization")):
    kwargs = {"num_gpus": 1, "transports": gpu_layouts.TRANSPORTS, **bad}
    with pytest.raises(ValueError, match=match):
      gpu_layouts.pipeline_layouts(kwargs.pop("num_gpus"), kwargs.pop("transports"), **kwargs)


def test_jax_layouts_are_cpu_actors_with_the_object_store_only():
  layouts = gpu_layouts.pipeline_layouts(0, gpu_layouts.TRANSPORTS, sampler_kind="jax")
  assert [l["skipped"] is None for l in layouts] == [True, False, False]
  assert all("needs sampler.kind='vllm'" in l["skipped"] for l in layouts[1:])
  layout = layouts[0]
  assert layout["overrides"] == {"sampler.kind": "jax", "sampler.platform": "cpu", "rollout.weight_transport":
                                 "object_store", "rollout.num_samplers": 2, "rollout.actor_gpus": 0.0}
  config = _config(layout)
  assert config.sampler.kind == "jax" and config.rollout.actor_gpus == 0 and config.rollout.num_samplers == 2
  assert "sampler.vllm.dtype" not in gpu_layouts.run_overrides(layout, checkpoint="/c", run_dir="/r")


# ------------------------------------------------------------------ reading a run
def _write_metrics(folder, records):
  os.makedirs(folder, exist_ok=True)
  with open(os.path.join(folder, "metrics.jsonl"), "w", encoding="utf-8") as f:
    for r in records:
      f.write(json.dumps(r) + "\n")


def test_summarise_run_from_a_hand_written_metrics_file(tmp_path):
  pool = {"pool/dispatched": 6.0, "pool/delivered": 4.0, "pool/lost_items": 0.0, "pool/restarts": 0.0,
          "pool/duplicates": 0.0, "pool/rejected": 0.0, "pool/rejected_rows": 0.0, "pool/failures": 0.0}
  records = [
      {"step": -1, "loss": 2.0},  # SFT
      {"step": 0, "eval/accuracy": 0.0, "warm_start/accuracy": 0.0},
      {"step": 1, "time/step_s": 5.0, "time/publish_s": 0.3, "time/sample_s": 4.0, "reward/mean": 0.25,
       "data/lag_max": 0.0, "consistency/abs_log_ratio_mean": 0.01, "consistency/kl_k3": 1e-4,
       "consistency/out_of_bounds": 0.0, "consistency/ess_rate": 0.99, "consistency/tokens": 30.0,
       "consistency/source": 0.0, "pool/publish_s": 0.0, "pool/publish_mb": 0.0, **pool,
       "gpu_check/actor_load_s": 0.5, "gpu_check/actor_load_mb": 4.0},
      {"step": 2, "time/step_s": 1.0, "time/publish_s": 0.1, "time/sample_s": 0.5, "reward/mean": 0.5,
       "data/lag_max": 1.0, "consistency/abs_log_ratio_mean": "nan", "consistency/kl_k3": "nan",
       "consistency/tokens": 0.0, "pool/publish_s": 0.2, "pool/publish_mb": 4.0, **pool},
      {"step": 3, "time/step_s": 2.0, "time/publish_s": 0.2, "time/sample_s": 1.0, "reward/mean": 0.75,
       "data/lag_max": 1.0, "consistency/abs_log_ratio_mean": 0.03, "consistency/kl_k3": 3e-4,
       "consistency/out_of_bounds": 0.05, "consistency/ess_rate": 0.9, "consistency/tokens": 34.0,
       "pool/publish_s": 0.3, "pool/publish_mb": 4.0, **pool, "pool/lost_items": 1.0,
       "gpu_check/actor_load_s": 1.5, "gpu_check/actor_load_mb": 4.0},
      {"step": 3, "eval/accuracy": 0.1},
  ]
  _write_metrics(tmp_path, records)
  got = gpu_layouts.summarise_run(str(tmp_path))
  assert got["steps_done"] == 3
  assert got["reward_mean"] == [0.25, 0.5, 0.75] and got["step_s"] == [5.0, 1.0, 2.0]
  assert [s["step"] for s in got["steps"]] == [1, 2, 3]
  assert got["steps"][1]["mismatch"]["abs_log_ratio_mean"] is None  # "nan": not measured
  assert got["steps"][0]["mismatch"] == {"abs_log_ratio_mean": 0.01, "kl_k3": 1e-4, "out_of_bounds": 0.0,
                                         "ess_rate": 0.99, "ratio_max": None, "tokens": 30.0, "source": 0.0}
  assert [s["actor_load_s"] for s in got["steps"]] == [0.5, None, 1.5]
  ws = got["weight_sync"]
  assert ws["publish_mb"] == 4.0 and ws["learner_put_s"] == 0.3  # the last record's (the mean so far)
  assert ws["learner_put_s_per_mb"] == pytest.approx(0.075)
  assert ws["learner_publish_stage_s_mean"] == pytest.approx(0.2)
  assert ws["actor_load_s"] == pytest.approx(1.0) and ws["actor_load_mb"] == 4.0
  assert ws["actor_load_s_per_mb"] == pytest.approx(0.25) and "probe" in ws["actor_load_source"]
  m = got["mismatch"]
  assert m["steps_measured"] == 2 and m["abs_log_ratio_mean_max"] == 0.03
  assert m["abs_log_ratio_mean_mean"] == pytest.approx(0.02) and m["kl_k3_max"] == 3e-4
  assert m["out_of_bounds_max"] == 0.05 and m["ess_rate_min"] == 0.9 and m["tokens"] == 64.0
  assert got["pool"]["lost_items"] == 1.0 and got["pool"]["delivered"] == 4.0


def test_summarise_run_says_what_was_not_measured(tmp_path):
  _write_metrics(tmp_path, [{"step": 1, "time/step_s": 1.0, "pool/publish_s": 0.0, "pool/publish_mb": 0.0}])
  got = gpu_layouts.summarise_run(str(tmp_path))
  ws = got["weight_sync"]
  assert ws["publish_mb"] is None and ws["learner_put_s"] is None and ws["learner_put_s_per_mb"] is None
  assert ws["actor_load_s"] is None and ws["actor_load_source"].startswith("not measured: nothing in metrics.jsonl")
  assert got["mismatch"]["steps_measured"] == 0 and got["mismatch"]["abs_log_ratio_mean_max"] is None
  assert got["reward_mean"] == [None]
  with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
    gpu_layouts.summarise_run(str(tmp_path / "missing"))


def test_placement_problems_compare_describe_with_the_plan():
  shared = gpu_layouts.pipeline_layouts(1, ["ipc"])[0]
  actor = {"kind": "vllm", "gpu_ids": ["0"], "cuda_visible_devices": "0", "weight_transport": "ipc",
           "engine_kwargs": {"tensor_parallel_size": 1}}
  good = [dict(actor, sampler_id="sampler-0"), dict(actor, sampler_id="sampler-1")]
  assert gpu_layouts.placement_problems(shared, good) == []  # two engines on GPU 0: planned
  own = gpu_layouts.pipeline_layouts(2, ["ipc"])[0]
  problems = gpu_layouts.placement_problems(own, good)
  assert problems == ["sampler-1 and sampler-0 both hold GPU 0"]
  tp2 = gpu_layouts.pipeline_layouts(4, ["nccl"], tensor_parallel_sizes=[2])[0]
  bad = [dict(actor, sampler_id="sampler-0", gpu_ids=["0", "1"], cuda_visible_devices="0,1,2",
              weight_transport="object_store")]
  assert gpu_layouts.placement_problems(tp2, bad) == [
      "sampler-0: GPUs ['0', '1'], the layout gives each actor 3",
      "sampler-0: CUDA_VISIBLE_DEVICES='0,1,2', Ray assigned ['0', '1']",
      "sampler-0: engine tensor_parallel_size=1, the layout has 2",
      "sampler-0: weight transport 'object_store', the layout has 'nccl'"]
  jax = gpu_layouts.pipeline_layouts(0, ["object_store"], sampler_kind="jax")[0]
  cpu = {"kind": "jax", "gpu_ids": [], "cuda_visible_devices": "", "engine_kwargs": {}}
  assert gpu_layouts.placement_problems(jax, [dict(cpu, sampler_id="a"), dict(cpu, sampler_id="b")]) == []
  assert gpu_layouts.placement_problems(jax, [dict(cpu, sampler_id="a")]) == ["1 actors described, the layout has 2"]


def test_report_helpers():
  report = {"checks": {"a": True, "b": False}, "pipeline": [
      {"name": "x", "ok": True}, {"name": "y", "ok": None}, {"name": "z", "ok": False, "checks": {"c": False}},
      {"name": "w", "ok": False, "checks": None}], "pipeline_error": "every layout was skipped"}
  assert gpu_check.failures(report) == ["b", "pipeline z (c)", "pipeline w (error)", "every layout was skipped"]
  import numpy as np  # pylint: disable=import-outside-toplevel
  safe = gpu_check._json_safe({"a": float("nan"), "b": [np.float32(1.5), np.int64(2), np.bool_(True)], "c": (1,)})
  assert safe == {"a": None, "b": [1.5, 2, True], "c": [1]}
  json.dumps(safe, allow_nan=False)


def test_tiny_alphabet_covers_the_addition_task_and_fills_the_vocabulary():
  alphabet = gpu_engine.tiny_alphabet(125)
  assert len(set(alphabet)) == 125 and alphabet.startswith(gpu_engine.TINY_TASK_CHARS)
  assert set("+0123456789=") <= set(alphabet) and not set("<>") & set(alphabet)
  with pytest.raises(ValueError, match="size"):
    gpu_engine.tiny_alphabet(10)


def test_sampler_kind_jax_refuses_the_engine_part():
  out = subprocess.run([sys.executable, "-m", "launch.gpu_check", "--sampler_kind=jax"], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
  assert out.returncode != 0 and out.stdout == "", (out.returncode, out.stdout, out.stderr)
  assert "--parts=pipeline" in out.stderr


# ------------------------------------------------------------------ a real run on the CPU
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  return gpu_engine.build_tiny_checkpoint(str(tmp_path_factory.mktemp("tiny_qwen2")), seed=0)


def test_the_tiny_tokenizer_covers_the_task_and_a_short_one_is_caught(checkpoint, tmp_path):
  assert gpu_layouts.tokenizer_gaps(checkpoint, "addition") == []
  from jaxrl_llm import bridge  # pylint: disable=import-outside-toplevel
  bridge.build_char_tokenizer("0123456789=").save(str(tmp_path))
  assert gpu_layouts.tokenizer_gaps(str(tmp_path), "addition") == ["+"]


def test_pipeline_runner_with_jax_actors_on_the_cpu(checkpoint, tmp_path):
  ray = pytest.importorskip("ray")
  layout = gpu_layouts.pipeline_layouts(0, ["object_store"], sampler_kind="jax")[0]
  try:
    entry = gpu_pipeline.run_pipeline(layout, checkpoint=checkpoint, workdir=str(tmp_path), steps=2,
                                   prompts_per_step=2, samples_per_prompt=4, sft_steps=4)
  finally:
    ray.shutdown()
  assert entry["error"] is None, entry["error"]
  assert entry["ok"] and all(entry["checks"].values()), entry["checks"]
  assert entry["steps_done"] == 2 and len(entry["reward_mean"]) == 2 and all(s > 0 for s in entry["step_s"])
  # each actor's placement, as SamplerPool.describe() gave it: CPU actors, no GPU
  assert [a["sampler_id"] for a in entry["placement"]] == ["sampler-0", "sampler-1"]
  for actor in entry["placement"]:
    assert actor["kind"] == "jax" and actor["gpu_ids"] == [] and actor["cuda_visible_devices"] == ""
    assert actor["jax_platforms"] == "cpu" and actor["engine_kwargs"] == {}
  # publish figures: the learner-side put per MB; the JAX sampler reports no actor-side load
  ws = entry["weight_sync"]
  assert ws["publish_mb"] > 0 and ws["learner_put_s"] > 0
  assert ws["learner_put_s_per_mb"] == pytest.approx(ws["learner_put_s"] / ws["publish_mb"])
  assert ws["actor_load_s"] is None and "not measured" in ws["actor_load_source"]
  # the job's sampler-vs-learner mismatch: the same model on both sides, so tiny
  m = entry["mismatch"]
  assert m["steps_measured"] >= 1 and m["tokens"] > 0 and 0 <= m["abs_log_ratio_mean_max"] < 1e-3
  # the updates moved the weights, and both actors ended on the learner's final version and weights
  assert entry["learner_params_changed"]
  assert entry["learner_version"] == 4 + 2  # a version per SFT step and per RL step
  assert [a["policy_version"] for a in entry["actor_weights"]] == [6, 6]
  assert all(a["checksum_max_rel_err"] == 0 for a in entry["actor_weights"])
  # the same figures as read back from the run folder, and the report line is strict JSON
  again = gpu_layouts.summarise_run(entry["run_dir"])
  assert again["reward_mean"] == entry["reward_mean"] and again["weight_sync"] == entry["weight_sync"]
  json.dumps(gpu_check._json_safe(entry), allow_nan=False)
  assert not math.isnan(entry["seconds"])


def test_an_isolated_run_that_fails_reports_the_error(tmp_path):
  layout = gpu_layouts.pipeline_layouts(0, ["object_store"], sampler_kind="jax")[0]
  entry = gpu_pipeline.run_pipeline_isolated(layout, 300, checkpoint=str(tmp_path / "no_checkpoint"),
                                          workdir=str(tmp_path), steps=1)
  assert entry["ok"] is False and entry["name"] == layout["name"]
  assert "no_checkpoint" in entry["error"], entry["error"]
  skipped = gpu_layouts.pipeline_layouts(0, ["ipc"], sampler_kind="jax")[0]
  assert gpu_pipeline.run_pipeline_isolated(skipped, 1, checkpoint="/c", workdir="/w")["ok"] is None


def test_the_engine_parts_episode_check_on_the_cpu(checkpoint):
  """What the engine part measures on vLLM's episodes, here with the built-in sampler replaying each turn's
  history (the path vLLM takes): observations appended, model tokens after them scored like the learner."""
  from jaxrl_llm import bridge  # pylint: disable=import-outside-toplevel
  from jaxrl_llm.sampling import JaxSampler, SamplerConfig  # pylint: disable=import-outside-toplevel
  from jaxrl_llm.sampling import session  # pylint: disable=import-outside-toplevel
  tokenizer = bridge.Tokenizer.from_folder(checkpoint)
  config = bridge.config_from_hf(checkpoint, pad_token_id=tokenizer.pad_id, param_dtype="float32", dtype="float32")
  params = bridge.load_hf_params(checkpoint, config)

  sampler = JaxSampler(config, params, SamplerConfig(max_length=128))

  def replay(sampler, prompts, *, rng, row_ids, capacity, max_turn_tokens, **overrides):
    return session.ReplaySession(sampler, prompts, rng=rng, row_ids=row_ids, capacity=capacity,
                                 config=sampler.config, model_config=sampler.model_config, **overrides)

  prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
  report = gpu_engine.episode_mismatch(sampler, params, config, tokenizer, prompts, 1.0, turn_tokens=6,
                                       open_session=replay)
  assert report["rows"] == 6 and report["observation_tokens"] > 0 and report["turns_mean"] > 1
  assert report["mismatch"]["tokens"] > 0 and report["mismatch"]["mean_abs"] < 1e-3
  assert report["mismatch_after_observation"]["tokens"] > 0
