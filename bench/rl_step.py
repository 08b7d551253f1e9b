"""One whole RL step (sample, reward, learn) of our loop against TRL's GRPOTrainer, on the CPU.

Both sides load the same tiny Qwen2 checkpoint (made here with ``transformers``, saved
with a char tokenizer of the addition task, vocabulary 256) and run one GRPO step on
16 prompts x 8 samples with ``N`` new tokens, every response forced to full length:

* ours: ``jaxrl_llm.jobs.RLJob`` built from ``base_config()`` pointed at the
  checkpoint (``init.hf_checkpoint``), task ``addition``, GRPO recipe. A step is the
  job's stages without diagnostics, logging, evaluation and checkpoints: collect
  (``JaxSampler.generate``), ``RLJob.prepare`` (rewards through ``RewardRunner``, group
  advantages, the ``RLBatch``), the jitted RL step, the non-finite check and
  ``sampler.update_weights``. The sampler gets
  ``stop_token_ids=()``, so no token ends a response.
* TRL: ``GRPOTrainer`` (no vLLM, ``use_cpu``, FP32, ``beta=0``, one generation and
  one optimizer step per step: ``per_device_train_batch_size=128``,
  ``num_generations=8``), prompts of the same kind (``a+b=``, 1-2 digit operands), a
  digit-share reward, ``generation_kwargs={"min_new_tokens": N}`` so EOS is never
  sampled. Steps are timed with a ``TrainerCallback`` (``on_step_begin`` ->
  ``on_step_end``; the interval between successive ``on_step_end`` is reported too).

Each side runs in its own subprocess (ours with the XLA flags chosen by
``bench/learner.py``), steady-state steps after ``--warmup`` steps; our first
step (compilation of the sampler and the update) is reported separately.

Usage (from the repository root; TRL comes from the ``bench`` extra)::

  python -m bench.rl_step                     # 8 and 64 new tokens, both sides
  python -m bench.rl_step --new-tokens 8 --steps 2 --warmup 1   # quick check

The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Optional, Sequence

from bench.common import finish, emit, load_average, run_worker, timing_stats
from bench.learner import FLAG_SETTINGS, tiny_qwen2_hf_config

TARGET_SPEEDUP_AT_64 = 2.0
PROMPTS_PER_STEP = 16
SAMPLES_PER_PROMPT = 8
VOCAB = 256
TASK_ALPHABET = "+0123456789="


def _filler_alphabet(size: int) -> str:
  """``TASK_ALPHABET`` followed by distinct filler characters, ``size`` characters in all."""
  extra = [chr(c) for c in range(0x41, 0x5B)] + [chr(c) for c in range(0x61, 0x7B)]
  extra += [chr(0x100 + i) for i in range(size)]
  chars = list(TASK_ALPHABET) + [c for c in extra if c not in TASK_ALPHABET]
  return "".join(chars[:size])


def make_checkpoint(folder: str) -> None:
  """Writes the tiny Qwen2 (random init, seed 0) and a char tokenizer to ``folder``."""
  import torch
  import transformers
  from jaxrl_llm import bridge
  tokenizer = bridge.build_char_tokenizer(_filler_alphabet(VOCAB - 3))
  if tokenizer.vocab_size != VOCAB:
    raise RuntimeError(f"char tokenizer has {tokenizer.vocab_size} ids, expected {VOCAB}")
  torch.manual_seed(0)
  config = tiny_qwen2_hf_config(vocab_size=VOCAB, pad_token_id=tokenizer.pad_id, eos_token_id=tokenizer.eos_id,
                                bos_token_id=tokenizer.bos_id)
  transformers.Qwen2ForCausalLM(config).float().save_pretrained(folder)
  transformers.GenerationConfig(eos_token_id=tokenizer.eos_id, pad_token_id=tokenizer.pad_id,
                                bos_token_id=tokenizer.bos_id).save_pretrained(folder)
  tokenizer.save(folder)


# ----------------------------------------------------------------------------- ours

def _ours_worker(a: argparse.Namespace) -> dict:
  import jax
  from jaxrl_llm.configuration import base_config
  from jaxrl_llm.jobs import RLJob

  c = base_config()
  c.name = "bench_rl_step"
  c.run_dir = os.path.join(a.workdir, f"ours_{a.new_tokens}")
  c.init.hf_checkpoint = a.checkpoint
  c.model.max_position_embeddings = 2048
  c.task.eval_size = 16
  c.sft.steps = 0
  c.rl.steps = a.warmup + a.steps
  c.rl.prompts_per_step = PROMPTS_PER_STEP
  c.rl.samples_per_prompt = SAMPLES_PER_PROMPT
  c.rl.max_new_tokens = a.new_tokens
  c.objective.recipe = "grpo"
  c.objective.kwargs.kl_coef = 0.0  # TRL's beta=0: no KL term, no reference policy
  c.advantage.estimator = "grpo"
  c.checkpoint.every = 10**6
  c.checkpoint.resume = False
  c.eval.every = 10**6
  c.log.progress = False
  c.log.tensorboard = False
  c.export.hf = False
  t0 = time.perf_counter()
  run = RLJob(c)
  setup_s = time.perf_counter() - t0
  # Force full-length responses: no stop token ends a row early.
  run.sampler.config = run.sampler.config.replace(stop_token_ids=())
  source = run.start_source()
  step_fn = run.update.step_fn(True)

  def step() -> dict:
    # The job's stages without diagnostics, logging, evaluation and checkpoints.
    t0 = time.perf_counter()
    batch, metrics = run.prepare(source.collect(run.progress.step))
    t1 = time.perf_counter()
    train, obj_state, m = step_fn(run.state.train, run.state.objective, batch)
    run.state = run.state.replace(train=train, objective=obj_state)
    run.track_nonfinite(m)
    run.sampler.update_weights(run.params, int(run.state.train.policy_version))
    jax.block_until_ready(run.params)
    run.progress.step += 1
    t2 = time.perf_counter()
    return {"step_s": t2 - t0, "sample_s": metrics["time/sample_s"], "collect_s": t1 - t0, "learn_s": t2 - t1,
            "response_length_mean": metrics["response/length_mean"], "reward_mean": metrics["reward/mean"]}

  first = step()
  for _ in range(a.warmup - 1):
    step()
  records = [step() for _ in range(a.steps)]
  run.close()
  steady = timing_stats([r["step_s"] for r in records])
  return {
      "worker": "ours", "xla_flags": os.environ.get("XLA_FLAGS", ""), "setup_s": setup_s,
      "first_step_s": first["step_s"], "compile_s_estimate": first["step_s"] - steady["median_s"],
      "step": steady,
      "sample_median_s": statistics.median(r["sample_s"] for r in records),
      "reward_and_batch_median_s": statistics.median(r["collect_s"] - r["sample_s"] for r in records),
      "learn_median_s": statistics.median(r["learn_s"] for r in records),
      "response_length_mean": statistics.fmean(r["response_length_mean"] for r in records),
      "versions": {"jax": jax.__version__},
  }


# ----------------------------------------------------------------------------- TRL

def _addition_prompts(n: int, seed: int = 0) -> list[str]:
  """``a+b=`` prompts, operands of 1-2 digits (the addition task's default range)."""
  import numpy as np
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(n):
    ops = []
    for _ in range(2):
      digits = int(rng.integers(1, 3))
      low = 0 if digits == 1 else 10 ** (digits - 1)
      ops.append(int(rng.integers(low, 10**digits)))
    out.append(f"{ops[0]}+{ops[1]}=")
  return out


def _digit_share(completions, **kwargs) -> list[float]:
  """Reward: share of digit characters in the completion."""
  del kwargs
  return [sum(ch.isdigit() for ch in text) / max(len(text), 1) for text in completions]


def _trl_worker(a: argparse.Namespace) -> dict:
  import datasets
  import torch
  import transformers
  import trl

  torch.set_num_threads(a.threads)
  total = a.warmup + a.steps
  tokenizer = transformers.AutoTokenizer.from_pretrained(a.checkpoint)
  model = transformers.AutoModelForCausalLM.from_pretrained(a.checkpoint, dtype=torch.float32)
  dataset = datasets.Dataset.from_dict({"prompt": _addition_prompts(PROMPTS_PER_STEP * total)})
  begins, ends, lengths = [], [], []

  class Timer(transformers.TrainerCallback):

    def on_step_begin(self, args, state, control, **kwargs):
      begins.append(time.perf_counter())

    def on_step_end(self, args, state, control, **kwargs):
      ends.append(time.perf_counter())

  def reward(completions, completion_ids=None, **kwargs):
    if completion_ids is not None:
      lengths.extend(len(c) for c in completion_ids)
    return _digit_share(completions)

  args = trl.GRPOConfig(
      output_dir=os.path.join(a.workdir, f"trl_{a.new_tokens}"), per_device_train_batch_size=PROMPTS_PER_STEP * SAMPLES_PER_PROMPT,
      gradient_accumulation_steps=1, num_generations=SAMPLES_PER_PROMPT, max_completion_length=a.new_tokens,
      generation_kwargs={"min_new_tokens": a.new_tokens}, temperature=1.0, beta=0.0, num_iterations=1,
      learning_rate=1e-4, max_grad_norm=1.0, max_steps=total, logging_steps=10**6, save_strategy="no",
      report_to="none", use_cpu=True, bf16=False, fp16=False, seed=0, disable_tqdm=True,
      dataloader_num_workers=0, log_completions=False)
  trainer = trl.GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=dataset,
                            processing_class=tokenizer, callbacks=[Timer()])
  t0 = time.perf_counter()
  trainer.train()
  train_s = time.perf_counter() - t0
  if len(ends) != total or len(begins) != total:
    raise RuntimeError(f"TRL ran {len(ends)} steps, expected {total}")
  inside = [e - b for b, e in zip(begins, ends)]
  between = [ends[i] - ends[i - 1] for i in range(1, total)]
  steady = timing_stats(inside[a.warmup:])
  return {
      "worker": "trl", "train_s": train_s, "first_step_s": inside[0], "step": steady,
      "step_to_step": timing_stats(between[a.warmup - 1:]) if a.warmup >= 1 else None,
      "response_length_mean": statistics.fmean(lengths) if lengths else None,
      "threads": torch.get_num_threads(),
      "versions": {"trl": trl.__version__, "torch": torch.__version__, "transformers": transformers.__version__},
  }


# ----------------------------------------------------------------------------- driver

def main(argv: Optional[Sequence[str]] = None) -> dict:
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--new-tokens", default="8,64", help="comma-separated response lengths")
  p.add_argument("--steps", type=int, default=5, help="timed steps per side and length")
  p.add_argument("--warmup", type=int, default=2, help="untimed steps first (the first compiles ours)")
  p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch intra-op threads")
  p.add_argument("--flags", default="default", help=f"XLA:CPU setting for ours, one of {sorted(FLAG_SETTINGS)}")
  p.add_argument("--sides", default="ours,trl", help="which sides to run (ours, trl)")
  p.add_argument("--worker", choices=("ours", "trl", "checkpoint"), help=argparse.SUPPRESS)
  p.add_argument("--checkpoint", default="", help=argparse.SUPPRESS)
  p.add_argument("--workdir", default="", help=argparse.SUPPRESS)
  a = p.parse_args(argv)
  if a.steps < 1 or a.warmup < 1:
    p.error(f"--steps={a.steps} and --warmup={a.warmup}: expected >= 1 each")
  if a.flags not in FLAG_SETTINGS:
    p.error(f"--flags={a.flags!r}: expected one of {sorted(FLAG_SETTINGS)}")
  if a.worker:
    if a.worker == "checkpoint":
      make_checkpoint(a.checkpoint)
      result = {"worker": "checkpoint", "folder": a.checkpoint}
    else:
      a.new_tokens = int(a.new_tokens)
      result = _ours_worker(a) if a.worker == "ours" else _trl_worker(a)
    emit(result)
    return result

  lengths = [int(x) for x in a.new_tokens.split(",") if x.strip()]
  sides = [s.strip() for s in a.sides.split(",") if s.strip()]
  if not lengths or any(n < 1 for n in lengths):
    p.error(f"--new-tokens={a.new_tokens!r}: expected positive integers")
  if not sides or any(s not in ("ours", "trl") for s in sides):
    p.error(f"--sides={a.sides!r}: expected a subset of ours,trl")
  load_start = load_average()
  t_start = time.perf_counter()
  results: dict = {}
  with tempfile.TemporaryDirectory(prefix="bench_rl_step_") as work:
    ckpt = os.path.join(work, "tiny_qwen2")
    made = run_worker("bench.rl_step", ["--worker", "checkpoint", "--checkpoint", ckpt], xla_flags="")
    if "error" in made:
      raise RuntimeError(f"could not build the checkpoint: {made}")
    common = ["--checkpoint", ckpt, "--workdir", work, "--steps", str(a.steps), "--warmup", str(a.warmup),
              "--threads", str(a.threads)]
    for n in lengths:
      row = {}
      for side in sides:
        flags = FLAG_SETTINGS[a.flags] if side == "ours" else ""
        r = run_worker("bench.rl_step", ["--worker", side, "--new-tokens", str(n), *common], xla_flags=flags)
        row[side] = r
        msg = r["error"] if "error" in r else f"{r['step']['median_s']:.3f} s/step"
        print(f"{side} new_tokens={n}: {msg}", file=sys.stderr)
      if all(s in row and "error" not in row[s] for s in ("ours", "trl")):
        row["speedup"] = row["trl"]["step"]["median_s"] / row["ours"]["step"]["median_s"]
        row["speedup_fastest_step"] = row["trl"]["step"]["min_s"] / row["ours"]["step"]["min_s"]
      results[str(n)] = row
  at64 = results.get("64", {}).get("speedup")
  result = {
      "benchmark": "rl_step", "prompts": PROMPTS_PER_STEP, "samples_per_prompt": SAMPLES_PER_PROMPT,
      "vocab": VOCAB, "steps": a.steps, "warmup": a.warmup, "threads": a.threads, "flags": a.flags,
      "xla_flags": FLAG_SETTINGS[a.flags], "results": results,
      "speedup_at_64": at64, "target_speedup_at_64": TARGET_SPEEDUP_AT_64,
      "target_met": None if at64 is None else at64 >= TARGET_SPEEDUP_AT_64,
  }
  return finish(result, load_start, t_start)


if __name__ == "__main__":
  main()
