"""Weights & Biases as an optional sink: an offline run logs every record, a resume continues the same run."""

import glob
import json
import os
import sys

import pytest

from jaxrl_llm import configuration as C, jobs
from jaxrl_llm.diagnostics import wandb_sink
from jaxrl_llm.errors import ConfigError

sys.path.insert(0, os.path.dirname(__file__))
from tiny_configs import tiny_config  # noqa: E402


def test_without_the_package_log_wandb_is_a_named_config_error(monkeypatch):
  real = wandb_sink.importlib.util.find_spec
  monkeypatch.setattr(wandb_sink.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name))
  c = C.base_config()
  C.validate(c)  # off by default: never needed
  c.log.wandb = True
  with pytest.raises(ConfigError, match=r"log.wandb=True: the wandb package is not installed \(pip install "
                                        r"'jaxrl_llm\[wandb\]'\)"):
    C.validate(c)


def test_an_offline_run_logs_each_record_and_a_resume_continues_the_same_wandb_run(tmp_path, monkeypatch):
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  run_dir = tmp_path / "run"
  run = jobs.RLJob(tiny_config(run_dir, rl__steps=2, checkpoint__every=1, export__hf=False, eval__every=2,
                               log__wandb=True, log__wandb_project="tests"))
  run.train()
  run_id = (run_dir / "wandb_id").read_text().strip()
  (log_file,) = glob.glob(str(run_dir / "wandb" / f"offline-run-*-{run_id}" / f"run-{run_id}.wandb"))
  data = open(log_file, "rb").read()
  records = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
  keys = {k for r in records for k, v in r.items() if k not in ("step", "time") and isinstance(v, float)}
  missing = sorted(k for k in keys if k.encode() not in data)
  assert not missing, f"metrics absent from the W&B run: {missing[:10]}"
  assert wandb_sink.STEP_KEY.encode() in data and b"grpo" in data  # the step metric and the run's config
  # resumed with more steps: the same W&B run id, appended to (resume="allow")
  more = jobs.RLJob(tiny_config(run_dir, rl__steps=3, checkpoint__every=1, export__hf=False, eval__every=2,
                                log__wandb=True, log__wandb_project="tests"))
  more.train()
  assert (run_dir / "wandb_id").read_text().strip() == run_id
  assert len(glob.glob(str(run_dir / "wandb" / f"offline-run-*-{run_id}"))) >= 1
