"""Every prompt checked against the context at start-up (``data.long_prompts``; jaxrl_llm/jobs/prompt_check.py).

The rule is the sampler's: prompt ids + ``rl.max_new_tokens`` <= ``max_position_embeddings``
(and, with a warm start, prompt + reference answer + EOS <= the context). The unit tests run the
check on a stand-in job (a char tokenizer: one token per character); the job tests build a tiny
RL job and run ``launch.train``.
"""

import json
import os
import subprocess
import sys
import types

import ml_collections
import pytest

from jaxrl_llm import bridge, configuration as C, jobs
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.jobs.prompt_check import SAMPLE, check_prompts
from jaxrl_llm.reward_model.encoding import encode_prompt
from jaxrl_llm.tasks import JsonlTask, get_task

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tiny_configs import tiny_config  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONTEXT, NEW = 32, 4  # tiny_config: a prompt fits with at most 28 tokens
LONG = "please add these two numbers: 1+1="  # 34 characters


def _rows(path, questions, answers=None):
  answers = answers or [str(i) for i in range(len(questions))]
  path.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in zip(questions, answers)))
  return str(path)


def _short(n, start=0):
  return [f"{i}+{i + 1}=" for i in range(start, start + n)]


def fake_job(task, *, action="error", sft_steps=0, sft_mix="", context=CONTEXT):
  c = C.base_config()
  c.data.long_prompts, c.sft.steps, c.data.sft_mix = action, sft_steps, sft_mix
  c.task.eval_size = 2
  tok = bridge.build_char_tokenizer(task.alphabet)
  return types.SimpleNamespace(config=c, task=task, tokenizer=tok,
                               model_config=types.SimpleNamespace(max_position_embeddings=context),
                               encode_prompt=lambda prompt: encode_prompt(tok, prompt, False))


def test_a_row_too_long_is_an_error_naming_file_and_line(tmp_path):
  data = _rows(tmp_path / "data.jsonl", _short(3) + [LONG] + _short(3, 10) + [LONG + "?"])
  task = JsonlTask(path=data, verifier="exact", eval_fraction=0.0)
  with pytest.raises(ConfigError) as e:
    check_prompts(fake_job(task), NEW)
  message = str(e.value)
  assert message.startswith(f"{data}:4: its prompt has 34 tokens; with rl.max_new_tokens=4 it needs 38 > 32 "
                            "(model.max_position_embeddings)")
  assert f"2 of 8 rows do not fit (also: {data}:8)" in message
  assert "data.long_prompts='skip'" in message and "'truncate'" in message


def test_held_out_rows_are_checked_too(tmp_path):
  train = _rows(tmp_path / "train.jsonl", _short(4))
  held_out = _rows(tmp_path / "eval.jsonl", _short(1, 20) + [LONG])
  task = JsonlTask(path=train, eval_path=held_out, verifier="exact", prompt_template="Q: {prompt}")
  with pytest.raises(ConfigError, match=rf"^{held_out}:2: its prompt has 37 tokens"):  # template included
    check_prompts(fake_job(task), NEW)


def test_skip_drops_the_rows_and_counts_them(tmp_path, caplog):
  data = _rows(tmp_path / "data.jsonl", _short(5) + [LONG, LONG + "!"])
  task = JsonlTask(path=data, verifier="exact", eval_fraction=0.0)
  kept, report = check_prompts(fake_job(task, action="skip"), NEW)
  assert report == {"action": "skip", "checked": 7, "whole": True, "too_long": 2, "skipped": 2, "truncated": 0}
  assert kept.num_train == 5 and task.num_train == 7
  assert {kept.train_example(0, i).prompt for i in range(20)} == set(_short(5))
  assert "2 of 7 rows do not fit the context of 32 tokens and are skipped" in caplog.text
  ok, report = check_prompts(fake_job(kept, action="skip"), NEW)  # nothing left to skip
  assert ok is kept and report["too_long"] == 0


def test_truncate_keeps_the_last_tokens_that_fit(tmp_path):
  data = _rows(tmp_path / "data.jsonl", _short(2) + [LONG])
  task = JsonlTask(path=data, verifier="exact", eval_fraction=0.0, prompt_template="Q: {prompt}")
  job = fake_job(task, action="truncate")
  kept, report = check_prompts(job, NEW)
  assert (report["truncated"], report["skipped"]) == (1, 0)
  prompts = {e.prompt for e in kept.examples()[0]}
  shortened = (prompts - {"Q: 0+1=", "Q: 1+2="}).pop()
  assert len(job.encode_prompt(shortened)) == CONTEXT - NEW and ("Q: " + LONG).endswith(shortened)


def test_the_warm_start_needs_prompt_and_answer_to_fit(tmp_path):
  data = _rows(tmp_path / "data.jsonl", _short(3), answers=["1", "3" * 24, "5"])  # row 2: 4 + 24 + EOS = 29 tokens
  task = JsonlTask(path=data, verifier="exact", eval_fraction=0.0)
  check_prompts(fake_job(task, sft_steps=0), NEW)  # no warm start: the answer is never trained on
  check_prompts(fake_job(task, sft_steps=3, context=29), NEW)  # 4 + 24 + EOS = 29 fits
  with pytest.raises(ConfigError, match=rf"{data}:2: its prompt \(4 tokens\) \+ reference answer \(24\) \+ EOS = 29 "):
    check_prompts(fake_job(task, sft_steps=3, context=28), NEW)
  with pytest.raises(ConfigError, match=rf"{data}:2: .*reference answer"):
    check_prompts(fake_job(task, sft_mix="task", context=28), NEW)  # demonstrations of the task's answers
  with pytest.raises(ConfigError, match="truncate' cannot make it fit"):  # the answer alone leaves no room
    check_prompts(fake_job(task, action="truncate", sft_steps=3, context=20), NEW)
  with pytest.raises(ConfigError, match=rf"{data}:2: .*reference answer"):  # a reward-model job's warm start
    check_prompts(fake_job(task, sft_steps=3, context=28), None)
  _, report = check_prompts(fake_job(task, sft_steps=0, context=28), None)  # it samples nothing
  assert report["too_long"] == report["checked"] == 0


def test_a_generated_task_is_checked_on_a_sample_and_named(tmp_path):
  task = get_task("addition", max_digits=9)
  _, report = check_prompts(fake_job(task, context=64), NEW)
  assert report == {"action": "error", "checked": SAMPLE + 2, "whole": False, "too_long": 0, "skipped": 0,
                    "truncated": 0}
  with pytest.raises(ConfigError, match=r"^task 'addition' (train|held-out) example \d+ \('.*'\): its prompt has \d+ "):
    check_prompts(fake_job(task, context=16), NEW)
  with pytest.raises(ConfigError, match="data.long_prompts='skip' applies to dataset tasks"):
    check_prompts(fake_job(task, action="skip", context=16), NEW)


# ----------------------------------------------------------------------------- the job and the command line

def _jsonl_config(run_dir, data, **overrides):
  c = tiny_config(run_dir, task__name="jsonl", **overrides)
  c.task.kwargs = ml_collections.ConfigDict({"path": str(data), "verifier": "exact", "eval_fraction": 0.25})
  c.task.eval_size = 2
  return c


def test_the_job_stops_at_start_up_before_any_step(tmp_path):
  data = _rows(tmp_path / "data.jsonl", _short(12) + [LONG])
  run = tmp_path / "run"
  with pytest.raises(ConfigError, match=rf"^{data}:13: its prompt has 34 tokens"):
    jobs.RLJob(_jsonl_config(run, data))
  assert not (run / "metrics.jsonl").exists()
  assert not (run / "checkpoints").exists() or not os.listdir(run / "checkpoints")


def test_skip_trains_and_counts_the_rows_in_the_summary(tmp_path):
  data = _rows(tmp_path / "data.jsonl", _short(12) + [LONG])
  summary = jobs.RLJob(_jsonl_config(tmp_path / "run", data, data__long_prompts="skip", sft__steps=1,
                                     rl__steps=1)).train()
  assert summary["rl_steps"] == 1
  assert summary["long_prompts"] == {"action": "skip", "checked": 13, "whole": True, "too_long": 1, "skipped": 1,
                                     "truncated": 0}
  assert json.load(open(tmp_path / "run" / "summary.json"))["long_prompts"]["skipped"] == 1


def test_launch_train_names_the_row_and_exits_2_without_a_traceback(tmp_path):
  """``jaxrl-train`` with the jsonl task from the command line: the too-long held-out row (the prompt
  template counted) stops the run at start-up."""
  train = _rows(tmp_path / "train.jsonl", _short(8))
  held_out = _rows(tmp_path / "eval.jsonl", _short(2, 30) + ["what is 1+1?"])
  run = tmp_path / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get(
      "PYTHONPATH")])))
  proc = subprocess.run([sys.executable, "-m", "launch.train", f"--run_dir={run}", "--config.task.name=jsonl",
                         "--config.task.kwargs={}", f"--config.task.kwargs.path={train}",
                         f"--config.task.kwargs.eval_path={held_out}", "--config.task.kwargs.verifier=exact",
                         "--config.task.kwargs.prompt_template=Please answer this question: {prompt}",
                         "--config.task.eval_size=2", "--config.model.max_position_embeddings=40",
                         "--config.rl.max_new_tokens=4", "--config.log.progress=false"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
  err = proc.stderr
  assert proc.returncode == 2, err[-3000:]
  n = len("Please answer this question: what is 1+1?")  # one token per character
  assert f"{held_out}:3: its prompt has {n} tokens; with rl.max_new_tokens=4 it needs {n + 4} > 40" in err, err[-3000:]
  assert "Traceback" not in err and not (run / "metrics.jsonl").exists()
