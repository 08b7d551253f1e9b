"""The vLLM sampler path up to the engine boundary, on the CPU (no vLLM, no GPU).

The boundary objects are vLLM's: ``RequestOutput`` / ``CompletionOutput`` /
``Logprob`` (built here as plain ``SimpleNamespace`` s with the same fields),
``SamplingParams`` keyword arguments, and ``collective_rpc(method, args)``
into the worker extension. Everything on our side of it runs for real.
"""

import dataclasses
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl_llm import bridge, models
from jaxrl_llm.bridge import fingerprint as fp_lib
from jaxrl_llm.bridge import reshard, weight_transport as wt
from jaxrl_llm.sampling import JaxSampler, SamplerConfig, layout
from jaxrl_llm.sampling import vllm_sampler as vs
from test_models_hf_util import hf_config
from third_party.vllm_weight_sync import WeightSyncExtension, entry_to_torch

TOKENIZER = bridge.build_char_tokenizer("0123456789+=")
CONFIG = models.tiny("qwen2", vocab_size=32, hidden_size=32, intermediate_size=64, num_layers=2,
                     max_position_embeddings=128, pad_token_id=TOKENIZER.pad_id, eos_token_id=TOKENIZER.eos_id,
                     bos_token_id=TOKENIZER.bos_id)
STOPS = (1, 5, 6, 7)
SAMPLING = SamplerConfig(max_new_tokens=10, temperature=1.0, stop_token_ids=STOPS, seed=4, max_length=24,
                         truncate_prompts=True, num_samples=2)
PROMPTS = [[10, 11, 12], [13], list(range(3, 20))]  # the last one (17 tokens) exceeds 24 - 10 and is truncated


@pytest.fixture(scope="module")
def params():
  return models.init_params(CONFIG, jax.random.PRNGKey(0))


@pytest.fixture(scope="module")
def jax_result(params):
  return JaxSampler(CONFIG, params, SAMPLING, version=7).generate(PROMPTS)


def _logprob(value):
  return types.SimpleNamespace(logprob=float(value), rank=1, decoded_token=None)


def _request_outputs(result, config, *, reverse_completions=False):
  """vLLM-shaped outputs carrying exactly the tokens and log-probabilities of ``result``."""
  n = config.num_samples
  rows = range(result.trajectory.batch_size)
  completions = []
  for r in rows:
    tokens = result.response_tokens[r]
    logps = result.response_logprobs[r]
    completions.append(types.SimpleNamespace(
        index=r % n, text="", token_ids=list(tokens), cumulative_logprob=float(np.sum(logps)),
        logprobs=[{t: _logprob(lp), (t + 1) % CONFIG.vocab_size: _logprob(-50.0)} for t, lp in zip(tokens, logps)],
        finish_reason="stop" if tokens[-1] in STOPS else "length"))
  per_request = [completions[g * n:(g + 1) * n] for g in range(len(rows) // n)]
  return [types.SimpleNamespace(request_id=str(g), prompt_token_ids=result.prompt_tokens[g * n],
                                outputs=list(reversed(c)) if reverse_completions else c, finished=True)
          for g, c in enumerate(per_request)]


# ------------------------------------------------------------- SamplingParams
def test_sampling_params_kwargs_map_every_field():
  config = SamplerConfig(max_new_tokens=12, temperature=0.7, top_k=5, top_p=0.9, stop_token_ids=(1, 2),
                         num_samples=3, seed=11)
  stops = layout.stop_token_ids(config, CONFIG)
  assert vs.sampling_params_kwargs(config, stops, seed=123) == dict(
      n=3, temperature=0.7, top_k=5, top_p=0.9, seed=123, max_tokens=12, min_tokens=0, stop_token_ids=[1, 2],
      ignore_eos=True, logprobs=0, detokenize=False)
  # top_k 0 (off) -> -1; stop_token_ids None -> (eos,); () -> never stop (vLLM adds no EOS of its own)
  off = config.replace(top_k=0, stop_token_ids=None)
  kw = vs.sampling_params_kwargs(off, layout.stop_token_ids(off, CONFIG), seed=5)
  assert kw["top_k"] == -1 and kw["stop_token_ids"] == [CONFIG.eos_token_id] and kw["ignore_eos"] is True
  never = config.replace(stop_token_ids=())
  assert vs.sampling_params_kwargs(never, layout.stop_token_ids(never, CONFIG), seed=5)["stop_token_ids"] == []
  greedy = config.replace(greedy=True)
  kw = vs.sampling_params_kwargs(greedy, stops, seed=5)
  assert (kw["temperature"], kw["n"], kw["seed"], kw["top_k"], kw["top_p"], kw["logprobs"]) == (0.0, 1, None, -1,
                                                                                                 1.0, 0)
  with pytest.raises(ValueError, match="vLLM samples greedily below 1e-05"):
    vs.sampling_params_kwargs(config.replace(temperature=1e-6), stops, seed=5)
  with pytest.raises(ValueError, match="pad id"):
    layout.stop_token_ids(config.replace(stop_token_ids=(CONFIG.pad_token_id,)), CONFIG)
  # every SamplerConfig field is either mapped to vLLM or handled on the host; a new field fails here
  mapped = {"max_new_tokens", "temperature", "top_k", "top_p", "greedy", "stop_token_ids", "num_samples", "seed"}
  host = {"max_length", "truncate_prompts", "min_prompt_bucket", "min_batch_bucket"}
  assert {f.name for f in dataclasses.fields(SamplerConfig)} == mapped | host


def test_requests_and_seeds_repeat_per_row():
  config = SAMPLING
  stops = layout.stop_token_ids(config, CONFIG)
  base = vs.call_base_seed(config.seed, 0)
  assert base == vs.call_base_seed(config.seed, 0) and 0 <= base < 2**56
  assert len({vs.call_base_seed(config.seed, c) for c in range(4)} | {vs.call_base_seed(5, 0)}) == 5
  requests = vs.build_requests([[3, 4], [5]], config, stops, base)
  assert [ids for ids, _ in requests] == [[3, 4], [5]]
  assert [kw["seed"] for _, kw in requests] == [base, base + 2] and all(kw["n"] == 2 for _, kw in requests)
  # vLLM gives child j of a request the seed `seed + j`: rows 0..3 draw with base + 0..3
  assert [kw["seed"] + j for _, kw in requests for j in range(kw["n"])] == [base + r for r in range(4)]
  key = jax.random.PRNGKey(9)
  assert vs.call_base_seed(0, 0, key) == vs.call_base_seed(1, 5, key) == vs.call_base_seed(0, 0, np.asarray(key))
  assert vs.call_base_seed(0, 0, jax.random.key(9)) == vs.call_base_seed(0, 0, key)
  assert vs.call_base_seed(0, 0, jax.random.PRNGKey(10)) != vs.call_base_seed(0, 0, key)
  greedy = vs.build_requests([[3, 4], [5]], config.replace(greedy=True), stops, base)
  assert [ids for ids, _ in greedy] == [[3, 4], [3, 4], [5], [5]] and all(kw["n"] == 1 for _, kw in greedy)
  # a pool's slice with global row ids: consecutive ids keep n-sample requests, others go one row per request
  assert [kw["seed"] for _, kw in vs.build_requests([[3, 4], [5]], config, stops, base, [6, 7, 8, 9])] == [
      base + 6, base + 8]
  split = vs.build_requests([[3, 4], [5]], config, stops, base, [6, 2, 8, 9])
  assert [(ids, kw["seed"], kw["n"]) for ids, kw in split] == [([3, 4], base + 6, 1), ([3, 4], base + 2, 1),
                                                               ([5], base + 8, 1), ([5], base + 9, 1)]
  with pytest.raises(ValueError, match=r"row_ids has shape \(3,\), expected \(4,\)"):
    vs.build_requests([[3, 4], [5]], config, stops, base, [0, 1, 2])


# ------------------------------------------------------- RequestOutput -> layout
def test_request_outputs_give_the_jax_sampler_layout(jax_result):
  prompts, truncated = layout.prepare_prompts(PROMPTS, SAMPLING, CONFIG)
  assert truncated == [False, False, True] and prompts[2] == PROMPTS[2][-14:]
  got = vs.outputs_to_result(_request_outputs(jax_result, SAMPLING, reverse_completions=True), prompts, truncated,
                             SAMPLING, CONFIG, version=7)
  want = jax_result.trajectory
  for field in dataclasses.fields(want):
    a, b = np.asarray(getattr(got.trajectory, field.name)), np.asarray(getattr(want, field.name))
    assert a.dtype == b.dtype and a.shape == b.shape, field.name
    np.testing.assert_array_equal(a, b, err_msg=field.name)
  assert got.prompt_tokens == jax_result.prompt_tokens and got.response_tokens == jax_result.response_tokens
  np.testing.assert_array_equal(got.prompt_truncated_b, jax_result.prompt_truncated_b)
  assert got.policy_version == jax_result.policy_version == 7
  assert want.finished_b.any() and not want.finished_b.all()  # both stop kinds are covered


def test_greedy_logprobs_are_kept_only_when_vllm_computes_ours(jax_result):
  prompts, truncated = layout.prepare_prompts(PROMPTS, SAMPLING, CONFIG)
  n = SAMPLING.num_samples
  outs = [types.SimpleNamespace(prompt_token_ids=c.prompt_token_ids, outputs=[o])
          for c in _request_outputs(jax_result, SAMPLING) for o in c.outputs]
  exact = vs.outputs_to_result(outs, prompts, truncated, SAMPLING.replace(greedy=True), CONFIG, version=7)
  np.testing.assert_array_equal(exact.trajectory.behaviour_logp_bt, jax_result.trajectory.behaviour_logp_bt)
  tempered = vs.outputs_to_result(outs, prompts, truncated, SAMPLING.replace(greedy=True, temperature=0.7),
                                  CONFIG, version=7)
  mask = tempered.trajectory.response_mask_bt
  assert np.isnan(tempered.trajectory.behaviour_logp_bt[mask]).all()
  assert (tempered.trajectory.behaviour_logp_bt[~mask] == 0).all()
  assert tempered.response_tokens == jax_result.response_tokens and len(outs) == len(prompts) * n


def test_malformed_engine_outputs_are_rejected(jax_result):
  prompts, truncated = layout.prepare_prompts(PROMPTS, SAMPLING, CONFIG)

  def convert(outs):
    return vs.outputs_to_result(outs, prompts, truncated, SAMPLING, CONFIG, version=7)

  per_row = [types.SimpleNamespace(prompt_token_ids=c.prompt_token_ids, outputs=[o])
             for c in _request_outputs(jax_result, SAMPLING) for o in c.outputs]
  assert convert(per_row).response_tokens == jax_result.response_tokens  # one request per row is fine too
  with pytest.raises(ValueError, match=r"2 request outputs for 3 \(or 6, one per row\)"):
    convert(_request_outputs(jax_result, SAMPLING)[:2])
  outs = _request_outputs(jax_result, SAMPLING)
  outs[1].outputs[0].logprobs = None
  with pytest.raises(ValueError, match=r"row 2 .*logprobs must be 0"):
    convert(outs)
  outs = _request_outputs(jax_result, SAMPLING)
  first = outs[0].outputs[0]
  first.logprobs[0] = {first.token_ids[0]: _logprob(-np.inf)}
  with pytest.raises(ValueError, match="processed_logprobs"):
    convert(outs)
  outs = _request_outputs(jax_result, SAMPLING)
  outs[0].outputs[1].token_ids = [STOPS[0], 20]
  outs[0].outputs[1].logprobs = [{STOPS[0]: _logprob(-1.0)}, {20: _logprob(-1.0)}]
  with pytest.raises(ValueError, match="stop token 1 occurs before the end"):
    convert(outs)
  outs = _request_outputs(jax_result, SAMPLING)
  outs[2].prompt_token_ids = [3, 4]
  with pytest.raises(ValueError, match="request output 2 is for prompt"):
    convert(outs)


# --------------------------------------------------------------- versions, fingerprints
def test_versions_must_increase_strictly():
  assert wt.next_version(3, 4) == 4 and wt.next_version(-1, 0) == 0
  for stale in (3, 2):
    with pytest.raises(ValueError, match=f"version {stale} is not newer than the current version 3"):
      wt.next_version(3, stale)
  with pytest.raises(ValueError, match="must be an int"):
    wt.next_version(3, 4.0)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory, params):
  folder = tmp_path_factory.mktemp("vllm_ckpt")
  return str(bridge.export_hf_checkpoint(params, CONFIG, folder, tokenizer=TOKENIZER))


def test_fingerprint_mismatch_names_both_fingerprints(hf_folder):
  other = bridge.build_char_tokenizer("0123456789+-")
  learner = bridge.make_fingerprint(other, CONFIG)
  sampler = vs.sampler_fingerprint(hf_folder, CONFIG)
  with pytest.raises(fp_lib.FingerprintMismatchError) as err:
    vs.VllmSampler(CONFIG, hf_folder, learner, SAMPLING)
  message = str(err.value)
  assert learner.digest() in message and sampler.digest() in message and "tokenizer differs" in message
  assert err.value.parts == ["tokenizer"]
  with pytest.raises(fp_lib.FingerprintMismatchError, match="model config/revision differs"):
    vs.VllmSampler(CONFIG, hf_folder, bridge.make_fingerprint(TOKENIZER, CONFIG, revision="step-9"), SAMPLING)
  with pytest.raises(fp_lib.FingerprintMismatchError, match="pass the learner's ModelConfig"):
    vs.VllmSampler(CONFIG.replace(rope_theta=5e5), hf_folder, bridge.make_fingerprint(TOKENIZER, CONFIG), SAMPLING)


def test_missing_vllm_says_to_install_the_extra(hf_folder, monkeypatch):
  monkeypatch.setitem(sys.modules, "vllm", None)  # `import vllm` raises ImportError, installed or not
  with pytest.raises(ImportError, match=r"install the \[vllm\] extra"):
    vs.VllmSampler(CONFIG, hf_folder, bridge.make_fingerprint(TOKENIZER, CONFIG), SAMPLING)


def test_importing_the_vllm_path_imports_neither_vllm_nor_torch():
  code = ("import sys, jaxrl_llm.sampling, jaxrl_llm.sampling.vllm_sampler, jaxrl_llm.bridge.weight_transport; "
          "print(sorted(m for m in ('torch', 'vllm') if m in sys.modules))")
  out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
  assert out.stdout.strip() == "[]", out.stderr


def test_engine_arguments_and_worker_extension(monkeypatch):
  monkeypatch.setenv("PYTHONPATH", "/somewhere")
  engine = vs.VllmEngineConfig(dtype="bfloat16", tensor_parallel_size=2, extra_engine_args={"max_num_seqs": 64})
  kw = engine.llm_kwargs("/ckpt", CONFIG, SAMPLING)
  assert kw["logprobs_mode"] == "processed_logprobs" and kw["max_model_len"] == 24
  assert kw["dtype"] == "bfloat16" and kw["tensor_parallel_size"] == 2 and kw["max_num_seqs"] == 64
  assert kw["generation_config"] == "vllm" and kw["model"] == kw["tokenizer"] == "/ckpt"
  module, cls = kw["worker_extension_cls"].rsplit(".", 1)
  assert getattr(__import__(module, fromlist=[cls]), cls) is WeightSyncExtension
  root = vs.ensure_worker_extension_importable()
  assert __import__("os").environ["PYTHONPATH"].split(":")[:2] == [root, "/somewhere"]
  with pytest.raises(ValueError, match=r"extra_engine_args sets \['logprobs_mode'\]"):
    vs.VllmEngineConfig(extra_engine_args={"logprobs_mode": "raw_logprobs"})
  with pytest.raises(ValueError, match="transport='grpc'"):
    vs.VllmEngineConfig(transport="grpc")


# ------------------------------------------------------------ weights to the engine
class _HFModelAsVllm:
  """What the extension calls on vLLM's model, over a transformers model: load_weights(weights=[(name, t)])."""

  def __init__(self, model):
    self.model, self.loaded = model, []

  def load_weights(self, weights):
    state = dict(weights)
    missing, unexpected = self.model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    self.loaded += list(state)
    return set(state)


def _worker(model):
  worker = WeightSyncExtension()
  worker.model_runner = types.SimpleNamespace(model=model)
  worker.device = torch.device("cpu")
  return worker


def test_object_store_payload_in_transformers_gives_learner_logits(params):
  hf = __import__("transformers").Qwen2ForCausalLM(hf_config(CONFIG)).float().eval()
  with torch.no_grad():
    for p in hf.parameters():
      p.zero_()
  target = _HFModelAsVllm(hf)
  worker = _worker(target)
  calls = []

  def rpc(method, args):  # collective_rpc over one worker
    calls.append(method)
    return [getattr(worker, method)(*args)]

  transport = wt.ObjectStoreTransport(bucket_bytes=40_000)
  stats = transport.publish(params, CONFIG, rpc)
  specs = bridge.layout.backbone_specs(CONFIG)
  assert sorted(target.loaded) == sorted(s.hf_name for s in specs) == sorted(hf.state_dict())
  assert stats.num_tensors == len(specs) and stats.calls == len(calls) > 1
  assert stats.bytes == sum(int(np.prod(s.shape)) * 4 for s in specs) and stats.seconds > 0
  rng = np.random.default_rng(0)
  tokens = rng.integers(3, CONFIG.vocab_size, size=(2, 9)).astype(np.int32)
  mask = np.ones((2, 9), bool)
  mask[1, 6:] = False
  tokens[1, 6:] = CONFIG.pad_token_id
  ours = np.asarray(models.forward(params, CONFIG, jnp.asarray(tokens), models.positions_from_mask(jnp.asarray(mask)),
                                   jnp.asarray(mask))["logits_btv"])
  with torch.no_grad():
    theirs = hf(input_ids=torch.from_numpy(tokens.astype(np.int64)),
                attention_mask=torch.from_numpy(mask.astype(np.int64))).logits.numpy()
  np.testing.assert_allclose(ours[mask], theirs[mask], atol=1e-5, rtol=0)
  assert np.abs(theirs[mask]).max() > 0.1


def test_bfloat16_wire_entries_round_like_torch(params):
  entries = list(wt.hf_entries(params, CONFIG, dtype="bfloat16"))
  name, dtype, shape, data = entries[1]
  assert dtype == "bfloat16" and data.dtype == np.uint16 and shape == data.shape
  _, tensor = entry_to_torch(entries[1])
  want = torch.from_numpy(np.array(dict(reshard.iter_hf_tensors(params, CONFIG))[name])).to(torch.bfloat16)
  assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, want)
  with pytest.raises(ValueError, match="int32 cannot be sent"):
    wt.encode_entry("x", np.zeros(3, np.int32))


def test_per_rank_shards_fill_each_rank_and_reassemble(params):
  plan = reshard.make_reshard_plan(CONFIG, 2)
  ranks = []
  for r in range(2):
    named = {e.vllm_name: torch.nn.Parameter(torch.zeros(plan.rank_shape(e)), requires_grad=False)
             for e in plan.entries}
    worker = _worker(types.SimpleNamespace(named_parameters=named.items))
    worker._wsync_tp_rank = lambda r=r: r  # the rank vLLM's parallel state reports on that worker
    ranks.append((worker, named))
  vs.check_engine_layout([{"rank": r, "shapes": {k: tuple(v.shape) for k, v in named.items()}}
                          for r, (_, named) in enumerate(ranks)], plan)
  stats = wt.ObjectStoreTransport(tp_size=2, bucket_bytes=30_000).publish(
      params, CONFIG, lambda method, args: [getattr(w, method)(*args) for w, _ in ranks])
  assert stats.num_tensors == 2 * len(plan.entries) and stats.calls > 1
  got = reshard.reassemble([{k: v.numpy() for k, v in named.items()} for _, named in ranks], plan)
  for name, want in reshard.iter_hf_tensors(params, CONFIG):
    np.testing.assert_array_equal(got[name], want, err_msg=name)
  checks = wt.expected_checksums(params, CONFIG, tp_size=2)
  for r, (worker, _) in enumerate(ranks):
    report = worker.report_weight_checksum()
    assert report["rank"] == r and sorted(report["sums"]) == sorted(checks[r])
    for name, value in checks[r].items():
      assert report["sums"][name] == pytest.approx(value, rel=1e-9, abs=1e-9), name
  bad = {"rank": 1, "shapes": {e.vllm_name: plan.rank_shape(e) for e in plan.entries}}
  bad["shapes"]["model.layers.0.self_attn.qkv_proj.weight"] = (3, 3)
  with pytest.raises(ValueError, match=r"rank 1: model.layers.0.self_attn.qkv_proj.weight has shape \(3, 3\)"):
    vs.check_engine_layout([{"rank": 0, "shapes": {e.vllm_name: plan.rank_shape(e) for e in plan.entries}}, bad],
                           plan)


# ------------------------------------------------------------------ gpu_check
def test_gpu_check_statistics_by_hand():
  from launch import gpu_engine  # pylint: disable=import-outside-toplevel
  learner = np.array([[0.0, -1.0, -2.0, 0.0], [0.0, -0.5, -3.0, -1.0]])
  behaviour = np.array([[0.0, -1.1, -1.0, 9.0], [0.0, -0.5, -3.3, -1.0]])
  mask = np.array([[False, True, True, False], [False, True, True, True]])
  # deltas 0.1, -1.0, 0.0, 0.3, 0.0 -> ratios 1.105, 0.368, 1, 1.35, 1: two outside [0.8, 1.25]
  got = gpu_engine.logprob_mismatch(learner, behaviour, mask)
  assert got["tokens"] == 5 and got["outside_share"] == pytest.approx(0.4)
  assert got["mean_abs"] == pytest.approx(1.4 / 5) and got["max_abs"] == pytest.approx(1.0)
  assert got["mean"] == pytest.approx(-0.6 / 5)
  with pytest.raises(ValueError, match="selects no token"):
    gpu_engine.logprob_mismatch(learner, behaviour, np.zeros_like(mask))
  agree = gpu_engine.greedy_agreement([[1, 2, 3], [4, 5], [6]], [[1, 2, 3], [4, 9, 9, 9], [7]])
  assert agree == {"rows_identical": pytest.approx(1 / 3), "prefix_share": pytest.approx((1 + 1 / 4 + 0) / 3)}


REPO = __import__("pathlib").Path(__file__).resolve().parents[1]


def _has_gpu_and_vllm() -> bool:
  import importlib.util  # pylint: disable=import-outside-toplevel
  return torch.cuda.is_available() and importlib.util.find_spec("vllm") is not None


def test_gpu_check_without_a_gpu_exits_2_with_the_reason():
  env = dict(__import__("os").environ, CUDA_VISIBLE_DEVICES="")
  out = subprocess.run([sys.executable, "-m", "launch.gpu_check"], capture_output=True, text=True, cwd=REPO,
                       env=env)
  assert out.returncode == 2 and out.stdout == "", (out.returncode, out.stdout, out.stderr)
  assert ("no CUDA GPU is visible" in out.stderr) or ("vLLM is not importable" in out.stderr), out.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu_and_vllm(), reason="needs a CUDA GPU and the [vllm] extra")
def test_gpu_check_end_to_end_on_a_gpu():
  out = subprocess.run([sys.executable, "-m", "launch.gpu_check", "--transports=object_store,ipc"],
                       capture_output=True, text=True, cwd=REPO, timeout=900)
  report = __import__("json").loads(out.stdout.strip().splitlines()[-1])
  assert out.returncode == 0 and report["ok"], (report.get("checks"), out.stderr[-3000:])
