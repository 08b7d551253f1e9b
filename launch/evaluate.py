"""``jaxrl-eval``: greedy accuracy and pass@k of a policy, with 95 % intervals and every answer.

``--source`` is a run folder (its newest verified checkpoint), a checkpoint step
folder (``runs/x/checkpoints/300``) or a Hugging Face folder (``runs/x/hf_export``);
the examples are the run's held-out split exactly as training evaluates it, another
task's (``--task``), or a file of prompts and answers (``--data``, read as the
``jsonl`` task reads it, with its field flags). The figures: greedy accuracy
(Wilson interval), unbiased pass@k for each ``--k`` from ``--samples`` samples per
example (Chen et al. 2021, arXiv:2107.03374; normal-approximation interval over
examples) and the sample accuracy; docs/evaluation.md. Every answer goes to a JSONL
file (``--output``, default ``<run>/eval/<name>.jsonl``).

  jaxrl-eval --source=runs/grpo_addition                      # the run's held-out accuracy, reproduced
  jaxrl-eval --source=runs/grpo_addition/checkpoints/300 --k=1,4,8 --samples=16
  jaxrl-eval --source=runs/x/hf_export --data=test.jsonl --prompt_field=q --answer_field=a --verifier=exact

The last line printed is one JSON object with every figure. A source that is none of
the three kinds, or a bad flag, is a usage error (exit status 2).
"""

from __future__ import annotations

import json

from absl import flags, logging
from ml_collections import config_flags

from launch import cli

_SOURCE = flags.DEFINE_string("source", None, "Run folder, checkpoint step folder (<run>/checkpoints/<step>) or "
                              "Hugging Face folder to evaluate.")
_CONFIG = config_flags.DEFINE_config_file("config", None, "A configs/*.py file (default: the run's own config.json).",
                                          lock_config=False, accept_new_attributes=True)
_TASK = flags.DEFINE_string("task", "", "A registered task whose held-out split to evaluate on (default: the run's "
                            "task and split, as training evaluates).")
_DATA = flags.DEFINE_string("data", "", "A JSONL / parquet / JSON file or datasets folder of prompts and answers.")
_PROMPT_FIELD = flags.DEFINE_string("prompt_field", "question", "--data: the field holding the prompt.")
_ANSWER_FIELD = flags.DEFINE_string("answer_field", "answer", "--data: the field holding the reference answer.")
_TEMPLATE = flags.DEFINE_string("prompt_template", "{prompt}", "--data: format string of the prompt, with {prompt}.")
_VERIFIER = flags.DEFINE_enum("verifier", "math", ["math", "exact"], "--data: math (final answer, numeric) or "
                              "exact (stripped text equal).")
_LIMIT = flags.DEFINE_integer("limit", 0, "Evaluate the first N examples only (0: all).")
_K = flags.DEFINE_list("k", ["1", "4", "8"], "The k of pass@k (empty: greedy only).")
_SAMPLES = flags.DEFINE_integer("samples", 0, "Samples per example, n >= max k (0: max k).")
_BATCH = flags.DEFINE_integer("batch_size", 0, "Examples per batch (0: task.eval_size, the training loop's batch, "
                              "which reproduces its figures exactly).")
_STEP_KEY = flags.DEFINE_integer("step_key", None, "Global step whose sampling key the samples use (default: the "
                                 "checkpoint's step, as training's evaluation at that step).")
_OUTPUT = flags.DEFINE_string("output", "", "Per-example JSONL (default: <run>/eval/<name>.jsonl).")
_PROGRESS = flags.DEFINE_bool("progress", True, "Show a progress bar over batches.")


def main(argv):
  del argv
  from jaxrl_llm.errors import ConfigError
  from jaxrl_llm.jobs import eval_command
  logging.set_verbosity(logging.WARNING)
  with cli.user_errors():
    if not _SOURCE.value:
      raise ConfigError(f"--source is required: {eval_command.EXPECTED}")
    config = cli.load_config(_CONFIG) if _CONFIG.value is not None else None
    try:
      ks = tuple(int(k) for k in _K.value)
    except ValueError:
      raise ConfigError(f"--k={','.join(_K.value)}: expected integers, e.g. --k=1,4,8") from None
    fields = {"prompt_field": _PROMPT_FIELD.value, "answer_field": _ANSWER_FIELD.value,
              "prompt_template": _TEMPLATE.value, "verifier": _VERIFIER.value}
    figures = eval_command.evaluate(eval_command.EvalRequest(
        source=_SOURCE.value, config=config, task=_TASK.value, data=_DATA.value, fields=fields, limit=_LIMIT.value,
        ks=ks, samples=_SAMPLES.value, batch_size=_BATCH.value, step_key=_STEP_KEY.value, output=_OUTPUT.value,
        progress=_PROGRESS.value))
  ci = {k: v for k, v in figures.items() if k.endswith("_ci95")}
  print(f"{figures['evaluated']} ({figures['examples']} examples, {figures['samples_per_example']} samples each) "
        f"from {figures['kind']} {figures['source']}")
  for key, value in figures.items():
    if key in ("accuracy", "sample_accuracy") or key.startswith("pass@") and not key.endswith("_ci95"):
      lo, hi = ci[f"{key}_ci95"]
      print(f"  {key:16s} {value:.4f}  95% CI [{lo:.4f}, {hi:.4f}]")
  print(f"  per-example answers: {figures['output']}")
  print(json.dumps(figures))


def run():
  """Console-script entry point."""
  cli.run(main)


if __name__ == "__main__":
  run()
