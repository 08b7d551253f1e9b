"""Whole runs on a tiny model: outputs, resume, non-finite guard, bad input, the HF path."""

import json
import os

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from jaxrl_llm import bridge, jobs

from tiny_configs import tiny_config


def test_run_writes_every_output(tmp_path):
  summary = jobs.run(tiny_config(tmp_path))
  for name in ("metrics.jsonl", "curves.png", "summary.json"):
    assert os.path.isfile(tmp_path / name), name
  assert any(f.startswith("events.out.tfevents") for f in os.listdir(tmp_path / "tensorboard"))
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  assert any("reward/mean" in r for r in records)
  assert any("eval/accuracy" in r for r in records)
  assert any("sft/loss" in r for r in records)
  on_disk = json.load(open(tmp_path / "summary.json"))
  assert on_disk["rl_steps"] == 2 and on_disk["sft_steps"] == 3
  assert 0.0 <= on_disk["final_accuracy"] <= 1.0
  assert on_disk["warm_start_accuracy"] is not None
  assert summary["outputs"]["hf_export"] == str(tmp_path / "hf_export")
  transformers = pytest.importorskip("transformers")
  model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_export")
  assert model.config.num_hidden_layers == 1
  assert bridge.Tokenizer.from_folder(tmp_path / "hf_export").vocab_size == model.config.vocab_size


def _leaves(tree):
  return [np.asarray(x) for x in jax.tree.leaves(tree)]


def test_resume_continues_where_it_stopped_bit_for_bit(tmp_path):
  straight = jobs.RLJob(tiny_config(tmp_path / "a", rl__steps=4))
  straight.train()
  first = jobs.RLJob(tiny_config(tmp_path / "b", rl__steps=2))
  first.train()
  resumed = jobs.RLJob(tiny_config(tmp_path / "b", rl__steps=4))
  assert resumed.progress.step == 2 and resumed.progress.phase == "rl"  # the finished run, extended to 4 steps
  resumed.train()
  assert resumed.progress.step == 4
  for a, b in zip(_leaves(straight.params), _leaves(resumed.params)):
    np.testing.assert_array_equal(a, b)


def test_nonfinite_updates_are_skipped_then_the_run_stops(tmp_path):
  run = jobs.RLJob(tiny_config(tmp_path, learner__max_nonfinite_in_a_row=2, sft__steps=5))
  poisoned = jax.tree.map(lambda x: x * jnp.nan, run.params)
  run.set_train_state(run.train_state.replace(params=poisoned))
  with pytest.raises(jobs.NonFiniteError, match="2 consecutive updates had a non-finite"):
    run.run_warm_start(_NullWriter(), run.sft_step)
  assert run.progress.skipped_updates == 2
  assert int(run.train_state.step) == 0  # nothing was applied


class _NullWriter:
  def write(self, step, metrics):
    return metrics


def test_unwritable_run_folder_fails_before_training(tmp_path):
  blocker = tmp_path / "a_file"
  blocker.write_text("x")
  with pytest.raises(OSError, match="run folder .* is not writable"):
    jobs.RLJob(tiny_config(blocker / "run"))


def test_dataset_row_missing_its_field_names_file_and_line(tmp_path):
  data = tmp_path / "data.jsonl"
  data.write_text('{"question": "1+1=", "answer": "#### 2"}\n{"question": "2+2="}\n')
  c = tiny_config(tmp_path / "run", task__name="jsonl")
  c.task.kwargs = ml_collections.ConfigDict({"path": str(data)})
  with pytest.raises(ValueError, match=r"data.jsonl:2: .*missing field 'answer'"):
    jobs.RLJob(c)


def _tiny_hf_checkpoint(folder, alphabet):
  transformers = pytest.importorskip("transformers")
  import torch
  tok = bridge.build_char_tokenizer(alphabet)
  cfg = transformers.Qwen2Config(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                 max_position_embeddings=128, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id,
                                 bos_token_id=tok.bos_id, tie_word_embeddings=False)
  torch.manual_seed(0)
  transformers.Qwen2ForCausalLM(cfg).save_pretrained(folder)
  tok.save(folder)


def test_hf_checkpoint_and_jsonl_dataset_path_end_to_end(tmp_path):
  import importlib
  alphabet = "0123456789+=#?abcdefghijklmnopqrstuvwxyz ,.\n<>|/_:"
  ckpt = tmp_path / "ckpt"
  _tiny_hf_checkpoint(ckpt, alphabet)
  rows = [{"question": f"what is {a} plus {b}?", "answer": f"{a} plus {b}\n#### {a + b}"}
          for a in range(6) for b in range(6)]
  data = tmp_path / "gsm.jsonl"
  data.write_text("".join(json.dumps(r) + "\n" for r in rows))
  c = importlib.import_module("configs.qwen2_5_gsm8k").get_config()
  c.run_dir = str(tmp_path / "run")
  c.init.hf_checkpoint = str(ckpt)
  c.task.kwargs.path = str(data)
  c.task.kwargs.eval_fraction = 0.2
  c.task.eval_size = 4
  c.model.param_dtype = "float32"
  c.model.dtype = "float32"
  c.rl.steps = 2
  c.rl.prompts_per_step = 2
  c.rl.samples_per_prompt = 2
  c.rl.max_new_tokens = 6
  c.eval.pass_k = 2
  c.log.progress = False
  summary = jobs.run(c)
  assert summary["rl_steps"] == 2
  export = summary["outputs"]["hf_export"]
  reloaded = bridge.load_hf_params(export)
  original = bridge.load_hf_params(str(ckpt))
  assert jax.tree.structure(reloaded) == jax.tree.structure(original)
  moved = [not np.array_equal(a, b) for a, b in zip(_leaves(reloaded), _leaves(original))]
  assert any(moved), "two RL steps should have changed the policy"
