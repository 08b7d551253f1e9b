"""HF config / checkpoint import and export against real (tiny, random) transformers models."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from safetensors.numpy import load_file, save_file

from jaxrl_llm.bridge import hf_config, hf_export, hf_import, layout, safetensors_io
from jaxrl_llm.models.config import ModelConfig, RopeScaling

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 32}

# name -> (transformers config class name, kwargs). Shapes are tiny but distinct
# (D=32, F=48, H=4, hd=8 or 16, V=96) so that a swapped or untransposed tensor
# cannot pass.
TINY_MODELS = {
    "qwen2": ("Qwen2Config", dict(num_key_value_heads=2, eos_token_id=1, bos_token_id=2)),
    "qwen3_tied": ("Qwen3Config", dict(num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
                                       eos_token_id=1, bos_token_id=2, pad_token_id=0)),
    "llama3": ("LlamaConfig", dict(num_key_value_heads=1, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE,
                                   eos_token_id=[1, 3], bos_token_id=2, max_position_embeddings=128)),
    "llama_tied": ("LlamaConfig", dict(num_key_value_heads=4, tie_word_embeddings=True, eos_token_id=1,
                                       bos_token_id=2, pad_token_id=1)),
}


def make_hf_model(name: str, seed: int = 0):
  """A tiny random transformers causal LM; every parameter is randomised (norms too)."""
  cls_name, kwargs = TINY_MODELS[name]
  config = getattr(transformers, cls_name)(vocab_size=96, hidden_size=32, intermediate_size=48,
                                            num_hidden_layers=2, num_attention_heads=4, **kwargs)
  torch.manual_seed(seed)
  model = transformers.AutoModelForCausalLM.from_config(config)
  with torch.no_grad():
    for pname, p in model.named_parameters():
      if pname.endswith("norm.weight") or "layernorm" in pname:
        p.copy_(1.0 + 0.1 * torch.randn_like(p))
      else:
        p.copy_(0.2 * torch.randn_like(p))
  return model.eval()


def save_tiny_hf_model(name: str, folder, seed: int = 0, **save_kwargs):
  model = make_hf_model(name, seed)
  model.save_pretrained(folder, **save_kwargs)
  return model


def state_dict_np(model) -> dict:
  return {k: v.detach().float().numpy() if v.dtype == torch.bfloat16 else v.detach().numpy()
          for k, v in model.state_dict().items()}


def assert_params_equal_state_dict(params, config, sd):
  specs = layout.backbone_specs(config)
  for spec in specs:
    got = np.asarray(layout.get_path(params, spec.path))
    want = sd[spec.hf_name]
    got = got.T if spec.transpose else got
    assert got.shape == want.shape, spec.hf_name
    np.testing.assert_array_equal(got, want, err_msg=spec.hf_name)
  return len(specs)


# --------------------------------------------------------------------------- config


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_config_from_saved_model(tmp_path, name):
  model = save_tiny_hf_model(name, tmp_path)
  config = hf_config.config_from_hf(tmp_path)
  hf = model.config
  assert config.family == {"Qwen2Config": "qwen2", "Qwen3Config": "qwen3", "LlamaConfig": "llama"}[
      TINY_MODELS[name][0]]
  assert (config.vocab_size, config.hidden_size, config.intermediate_size, config.num_layers) == (96, 32, 48, 2)
  assert config.num_heads == 4 and config.num_kv_heads == hf.num_key_value_heads
  assert config.resolved_head_dim == (16 if name == "qwen3_tied" else 8)
  assert config.tie_word_embeddings == hf.tie_word_embeddings
  assert config.attention_bias == (name == "qwen2")
  assert config.qk_norm == (name == "qwen3_tied")
  assert config.eos_token_id == 1 and config.bos_token_id == 2
  assert config.pad_token_id not in (1, 3)
  assert config.param_dtype == "float32"
  if name == "llama3":
    assert config.rope_theta == 500000.0
    assert config.rope_scaling == RopeScaling(8.0, 1.0, 4.0, 32)
    assert hf_config.hf_eos_token_ids(tmp_path) == (1, 3)
  else:
    assert config.rope_scaling is None


def test_pad_fallback_never_equals_eos():
  base = dict(architectures=["Qwen2ForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
              num_hidden_layers=1, num_attention_heads=2, bos_token_id=9)
  assert hf_config.config_from_hf(dict(base, eos_token_id=8)).pad_token_id == 7   # absent: top id not eos/bos
  assert hf_config.config_from_hf(dict(base, eos_token_id=4, pad_token_id=4)).pad_token_id == 8  # == eos
  assert hf_config.config_from_hf(dict(base, eos_token_id=4, pad_token_id=5)).pad_token_id == 5
  assert hf_config.config_from_hf(dict(base, eos_token_id=4), pad_token_id=0).pad_token_id == 0
  assert hf_config.config_from_hf(dict(base, eos_token_id=[8, 7])).pad_token_id == 6


def test_legacy_rope_format_and_overrides():
  hf = dict(architectures=["LlamaForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
            num_hidden_layers=1, num_attention_heads=2, eos_token_id=1, rope_theta=1e6,
            rope_scaling=dict(LLAMA3_ROPE, type="llama3"), torch_dtype="bfloat16")
  hf["rope_scaling"].pop("rope_type")
  config = hf_config.config_from_hf(hf, value_head=True)
  assert config.rope_theta == 1e6 and config.rope_scaling.factor == 8.0
  assert config.param_dtype == "bfloat16" and config.dtype == "bfloat16" and config.value_head
  assert config.num_kv_heads == 2  # absent num_key_value_heads -> num_attention_heads


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3"])
def test_config_round_trip_and_transformers_reads_export(family):
  config = ModelConfig(family=family, vocab_size=50, hidden_size=16, intermediate_size=24, num_layers=3,
                       num_heads=4, num_kv_heads=2, head_dim=8, rope_theta=5e5,
                       rope_scaling=RopeScaling(4.0, 1.0, 2.0, 64) if family == "llama" else None,
                       rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=True,
                       attention_bias=family == "qwen2", qk_norm=family == "qwen3", param_dtype="float32",
                       dtype="float32", pad_token_id=3, eos_token_id=1, bos_token_id=2)
  hf = hf_config.config_to_hf(config)
  assert hf_config.config_from_hf(json.loads(json.dumps(hf))) == config
  tf = transformers.AutoConfig.for_model(**{k: v for k, v in hf.items() if k != "model_type"},
                                         model_type=hf["model_type"])
  assert tf.num_key_value_heads == 2 and tf.head_dim == 8 and tf.rms_norm_eps == 1e-5
  assert tf.rope_parameters["rope_theta"] == 5e5
  if family == "llama":
    assert tf.rope_parameters["rope_type"] == "llama3" and tf.rope_parameters["factor"] == 4.0


@pytest.mark.parametrize("hf_update, message", [
    (dict(architectures=["MistralForCausalLM"]), "MistralForCausalLM"),
    (dict(architectures=["GPT2LMHeadModel"]), "LlamaForCausalLM"),
    (dict(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "rope_type='yarn'"),
    (dict(use_sliding_window=True), "sliding-window"),
    (dict(hidden_act="gelu"), "hidden_act='gelu'"),
    (dict(eos_token_id=None), "eos_token_id"),
    (dict(hidden_size=None), "hidden_size"),
    (dict(architectures=["LlamaForCausalLM"], attention_bias=True), "o_proj"),
    (dict(architectures=["Qwen3ForCausalLM"], attention_bias=True), "o_proj"),
    (dict(architectures=["LlamaForCausalLM"], mlp_bias=True), "mlp_bias"),
])
def test_config_errors_name_the_field(hf_update, message):
  hf = dict(architectures=["Qwen2ForCausalLM"], vocab_size=10, hidden_size=8, intermediate_size=16,
            num_hidden_layers=1, num_attention_heads=2, eos_token_id=1)
  hf.update(hf_update)
  with pytest.raises(ValueError, match=message) as info:
    hf_config.config_from_hf(hf)
  if message in ("MistralForCausalLM", "LlamaForCausalLM"):  # unsupported: lists the supported ones
    assert "Qwen2ForCausalLM" in str(info.value) and "Qwen3ForCausalLM" in str(info.value)


# --------------------------------------------------------------------------- import


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_import_matches_state_dict_exactly(tmp_path, name):
  model = save_tiny_hf_model(name, tmp_path)
  params, config = hf_import.load_hf_checkpoint(tmp_path)
  sd = state_dict_np(model)
  n = assert_params_equal_state_dict(params, config, sd)
  assert ("lm_head" in params) == (not config.tie_word_embeddings)
  n_leaves = len(jax.tree_util.tree_leaves(params))
  assert n == n_leaves
  assert all(x.dtype == jnp.float32 for x in jax.tree_util.tree_leaves(params))


def test_import_sharded_checkpoint_and_dtype_cast(tmp_path):
  model = save_tiny_hf_model("qwen2", tmp_path, max_shard_size="20KB")
  assert os.path.isfile(tmp_path / safetensors_io.INDEX_FILE)
  assert len([f for f in os.listdir(tmp_path) if f.endswith(".safetensors")]) > 2
  params, config = hf_import.load_hf_checkpoint(tmp_path, param_dtype="bfloat16")
  assert config.param_dtype == "bfloat16"
  sd = state_dict_np(model)
  for spec in layout.backbone_specs(config):
    got = layout.get_path(params, spec.path)
    assert got.dtype == jnp.bfloat16
    want = jnp.asarray(sd[spec.hf_name].T if spec.transpose else sd[spec.hf_name]).astype(jnp.bfloat16)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=spec.hf_name)


def _mesh_shardings(config, mesh):
  kernel_axes = {"q_proj": ("fsdp", "tensor"), "k_proj": ("fsdp", "tensor"), "v_proj": ("fsdp", "tensor"),
                 "o_proj": ("tensor", "fsdp"), "gate_proj": ("fsdp", "tensor"), "up_proj": ("fsdp", "tensor"),
                 "down_proj": ("tensor", "fsdp")}
  shardings = {}
  for spec in layout.backbone_specs(config):
    if spec.path[-1] == "kernel" and spec.path[0] == "lm_head":
      pspec = P("fsdp", "tensor")
    elif spec.path[-1] == "kernel":
      pspec = P(*kernel_axes[spec.path[-2]])
    elif spec.path[-1] == "embedding":
      pspec = P("tensor", "fsdp")
    elif spec.path[-1] == "bias":
      pspec = P("tensor")
    else:
      pspec = P()
    layout.set_path(shardings, spec.path, NamedSharding(mesh, pspec))
  return shardings


def test_import_into_sharded_target_reads_only_shards(tmp_path, monkeypatch):
  model = save_tiny_hf_model("qwen2", tmp_path)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("fsdp", "tensor"))
  config = hf_config.config_from_hf(tmp_path)
  shardings = _mesh_shardings(config, mesh)
  reads = []
  original = safetensors_io.SafetensorsCheckpoint.read

  def recording_read(self, name, index=None):
    out = original(self, name, index)
    reads.append((name, out.size))
    return out

  monkeypatch.setattr(safetensors_io.SafetensorsCheckpoint, "read", recording_read)
  params, loaded_config = hf_import.load_hf_checkpoint(tmp_path, shardings=lambda c: _mesh_shardings(c, mesh))
  assert loaded_config == config
  assert_params_equal_state_dict(params, config, state_dict_np(model))
  for spec in layout.backbone_specs(config):
    array = layout.get_path(params, spec.path)
    assert array.sharding == layout.get_path(shardings, spec.path), spec.flax_name
    full = int(np.prod(spec.shape))
    sizes = [size for name, size in reads if name == spec.hf_name]
    distinct_shards = len({tuple((s.start, s.stop) for s in idx)
                           for idx in array.sharding.devices_indices_map(spec.shape).values()})
    assert len(sizes) == distinct_shards, spec.hf_name          # each distinct shard read once
    assert max(sizes) == full // distinct_shards, spec.hf_name  # and never more than a shard


def test_import_with_mesh_uses_model_param_shardings(tmp_path):
  sharding_mod = pytest.importorskip("jaxrl_llm.models.sharding")
  model = save_tiny_hf_model("qwen3_tied", tmp_path)
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(1, 2, 4), ("data", "fsdp", "tensor"))
  params, config = hf_import.load_hf_checkpoint(tmp_path, mesh=mesh)
  want = sharding_mod.param_shardings(config, mesh)
  for spec in layout.backbone_specs(config):
    assert layout.get_path(params, spec.path).sharding == layout.get_path(want, spec.path)
  assert_params_equal_state_dict(params, config, state_dict_np(model))


def test_import_reports_every_problem_at_once(tmp_path):
  save_tiny_hf_model("qwen2", tmp_path)
  tensors = load_file(str(tmp_path / "model.safetensors"))
  del tensors["model.layers.1.mlp.up_proj.weight"]
  del tensors["model.norm.weight"]
  tensors["model.layers.0.self_attn.q_proj.weight"] = np.zeros((31, 32), np.float32)
  tensors["model.layers.0.self_attn.k_proj.bias"] = np.zeros((15,), np.float32)
  tensors["model.layers.0.mlp.extra.weight"] = np.zeros((3, 4), np.float32)
  tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros((4,), np.float32)  # ignored buffer
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  with pytest.raises(hf_import.CheckpointMismatchError) as info:
    hf_import.load_hf_checkpoint(tmp_path)
  got = {(p.kind, p.name, p.expected_shape, p.got_shape) for p in info.value.problems}
  assert got == {
      ("missing", "model.layers.1.mlp.up_proj.weight", (48, 32), None),
      ("missing", "model.norm.weight", (32,), None),
      ("mis-shaped", "model.layers.0.self_attn.q_proj.weight", (32, 32), (31, 32)),
      ("mis-shaped", "model.layers.0.self_attn.k_proj.bias", (16,), (15,)),
      ("unexpected", "model.layers.0.mlp.extra.weight", None, (3, 4)),
  }
  message = str(info.value)
  assert "5 problem(s)" in message and "model.safetensors" in message
  assert "expected shape (32, 32), got shape (31, 32)" in message


def test_import_tied_checkpoint_with_stored_lm_head(tmp_path, caplog):
  model = save_tiny_hf_model("qwen3_tied", tmp_path)
  tensors = load_file(str(tmp_path / "model.safetensors"))
  assert "lm_head.weight" not in tensors
  tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  with caplog.at_level("WARNING"):
    params, config = hf_import.load_hf_checkpoint(tmp_path)
  assert "lm_head" not in params and not caplog.records
  assert_params_equal_state_dict(params, config, state_dict_np(model))
  tensors["lm_head.weight"] = tensors["lm_head.weight"] + 1.0
  save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
  with caplog.at_level("WARNING"):
    params, _ = hf_import.load_hf_checkpoint(tmp_path)
  assert "lm_head" not in params and "differs" in caplog.text


# --------------------------------------------------------------------------- export


def _load_hf(folder, **kwargs):
  model, info = transformers.AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True, **kwargs)
  assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
  return model


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_export_round_trip_through_transformers(tmp_path, name):
  model = save_tiny_hf_model(name, tmp_path / "src")
  params, config = hf_import.load_hf_checkpoint(tmp_path / "src")
  hf_export.export_hf_checkpoint(params, config, tmp_path / "out",
                                 eos_token_ids=hf_config.hf_eos_token_ids(tmp_path / "src"))
  assert sorted(os.listdir(tmp_path / "out")) == ["config.json", "generation_config.json", "model.safetensors"]
  loaded = _load_hf(tmp_path / "out")
  want, got = state_dict_np(model), state_dict_np(loaded)
  assert sorted(want) == sorted(got)
  for key in want:
    np.testing.assert_array_equal(got[key], want[key], err_msg=key)
  assert type(loaded).__name__ == type(model).__name__
  assert loaded.config.tie_word_embeddings == model.config.tie_word_embeddings
  assert hf_config.config_from_hf(tmp_path / "out") == config
  generation = json.loads((tmp_path / "out" / "generation_config.json").read_text())
  assert generation["pad_token_id"] == config.pad_token_id
  assert generation["eos_token_id"] == ([1, 3] if name == "llama3" else 1)


def test_export_sharded_bf16_with_index(tmp_path):
  model = save_tiny_hf_model("llama3", tmp_path / "src")
  params, config = hf_import.load_hf_checkpoint(tmp_path / "src")
  hf_export.export_hf_checkpoint(params, config, tmp_path / "out", max_shard_size="16KB", dtype="bfloat16")
  index = json.loads((tmp_path / "out" / safetensors_io.INDEX_FILE).read_text())
  files = sorted(set(index["weight_map"].values()))
  assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
  assert sorted(index["weight_map"]) == sorted(s.hf_name for s in layout.backbone_specs(config))
  sizes = [os.path.getsize(tmp_path / "out" / f) for f in files]
  assert index["metadata"]["total_size"] < sum(sizes)
  loaded = _load_hf(tmp_path / "out", dtype=torch.bfloat16)
  want = {k: v.to(torch.bfloat16) for k, v in model.state_dict().items()}
  for key, value in loaded.state_dict().items():
    assert value.dtype == torch.bfloat16
    assert torch.equal(value, want[key]), key
  # and back: the bf16 folder re-imports to the same bf16 values
  params2, config2 = hf_import.load_hf_checkpoint(tmp_path / "out")
  assert config2.param_dtype == "bfloat16"
  np.testing.assert_array_equal(np.asarray(params2["embed"]["embedding"]),
                                np.asarray(params["embed"]["embedding"].astype(jnp.bfloat16)))


def test_export_from_sharded_params_and_heads_side_file(tmp_path):
  save_tiny_hf_model("qwen2", tmp_path / "src")
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("fsdp", "tensor"))
  config = hf_config.config_from_hf(tmp_path / "src", value_head=True, reward_head=True)
  shardings = _mesh_shardings(config, mesh)
  params = hf_import.load_hf_params(tmp_path / "src", config, shardings=shardings)
  assert "value_head" not in params   # no side file yet: heads left to the caller
  rng = np.random.default_rng(0)
  for head in ("value_head", "reward_head"):
    params[head] = {"kernel": jnp.asarray(rng.normal(size=(32, 1)), jnp.float32),
                    "bias": jnp.asarray(rng.normal(size=(1,)), jnp.float32)}
  hf_export.export_hf_checkpoint(params, config, tmp_path / "out")
  assert os.path.isfile(tmp_path / "out" / hf_import.HEADS_FILE)
  _load_hf(tmp_path / "out")   # heads are invisible to transformers
  back = hf_import.load_hf_params(tmp_path / "out", config, require_heads=True)
  for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  with pytest.raises(hf_import.CheckpointMismatchError, match="value_head/kernel"):
    hf_import.load_hf_params(tmp_path / "src", config, require_heads=True)


def test_export_rejects_params_that_do_not_match_config(tmp_path):
  save_tiny_hf_model("qwen2", tmp_path / "src")
  params, config = hf_import.load_hf_checkpoint(tmp_path / "src")
  del params["layers_1"]["mlp"]["up_proj"]
  params["layers_0"]["attn"]["q_proj"]["kernel"] = jnp.zeros((3, 3))
  params["extra"] = {"w": jnp.zeros(2)}
  with pytest.raises(ValueError) as info:
    hf_export.export_hf_checkpoint(params, config, tmp_path / "out")
  message = str(info.value)
  assert "3 problem(s)" in message
  assert "missing layers_1/mlp/up_proj/kernel" in message
  assert "mis-shaped layers_0/attn/q_proj/kernel: expected (32, 32), got (3, 3)" in message
  assert "unexpected extra/w" in message


def test_safetensors_writer_matches_reference_reader(tmp_path):
  rng = np.random.default_rng(1)
  tensors = {"a": rng.normal(size=(3, 5)).astype(np.float32),
             "b": rng.normal(size=(7,)).astype(jnp.bfloat16),
             "c": np.arange(6, dtype=np.int64).reshape(2, 3),
             "d": np.zeros((0, 4), np.float16)}
  entries = [(k, v.shape, v.dtype) for k, v in tensors.items()]
  nbytes = safetensors_io.write_safetensors(tmp_path / "x.safetensors", entries, tensors.__getitem__,
                                            {"format": "pt"})
  assert nbytes == sum(v.nbytes for v in tensors.values())
  with safetensors_io.SafetensorsCheckpoint(tmp_path, filename="x.safetensors") as reader:
    for k, v in tensors.items():
      assert reader.read(k).dtype == v.dtype
      np.testing.assert_array_equal(reader.read(k), v)
  loaded = {k: v for k, v in load_file(str(tmp_path / "x.safetensors")).items() if k != "b"}
  for k, v in loaded.items():
    np.testing.assert_array_equal(v, tensors[k])
  with pytest.raises(ValueError, match="declared"):
    safetensors_io.write_safetensors(tmp_path / "y.safetensors", [("a", (2, 2), np.float32)],
                                     lambda name: np.zeros((2, 3), np.float32))
  assert hf_export.parse_size("5GB") == 5 * 10**9 and hf_export.parse_size("2KiB") == 2048
  with pytest.raises(ValueError, match="max_shard_size"):
    hf_export.parse_size("lots")


def test_config_to_hf_eos_list_must_contain_config_eos():
  config = ModelConfig(family="llama", attention_bias=False, eos_token_id=1, pad_token_id=0)
  assert hf_config.config_to_hf(config, eos_token_ids=[1, 5])["eos_token_id"] == [1, 5]
  assert hf_config.config_to_hf(config)["eos_token_id"] == 1
  with pytest.raises(ValueError, match="does not contain ModelConfig.eos_token_id=1"):
    hf_config.config_to_hf(config, eos_token_ids=[4, 5])
  with pytest.raises(ValueError, match="has no HF equivalent"):
    hf_config.config_to_hf(config.replace(attention_bias=True))
