"""Multi-host learner: 2 processes x 4 CPU devices give the bits of 1 process x 8 devices.

The tiny batch-invariant config of ``test_determinism`` (SFT warm start + GRPO
steps) on a ``data=2 x fsdp=4`` mesh: FSDP inside each process, data parallelism
across the two. The 2-process run is ``launch.train`` started by
``launch.local_multihost`` (gloo collectives over 127.0.0.1); the 1-process x 8
device run is the ``fsdp`` variant of ``test_determinism`` (same config, same mesh).
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_determinism import (REPO, VARIANTS, assert_same_arrays, assert_same_records, cache_env,  # noqa: E402,F401
                              compile_cache, exported_params, stable_records, variant_runs, write_config)

MESH = ["--config.learner.mesh.data=2", "--config.learner.mesh.fsdp=4", "--config.export.hf=true"]


def test_two_processes_of_four_devices_match_one_process_of_eight(tmp_path, compile_cache, variant_runs):
  assert VARIANTS["fsdp"] == {"learner.mesh.data": 2, "learner.mesh.fsdp": 4}  # the reference: 1 process x 8
  config = write_config(tmp_path)
  two = subprocess.run([sys.executable, "-m", "launch.local_multihost", "--num_processes=2", "--devices_per_process=4",
                        "--timeout_s=600", "--", f"--config={config}", f"--run_dir={tmp_path / 'two'}", *MESH],
                       cwd=REPO, env=cache_env(compile_cache), capture_output=True, text=True, timeout=700)
  logs = "".join(open(tmp_path / "two" / "logs" / f"learner_{i}.log").read()[-3000:] for i in range(2)
                 if (tmp_path / "two" / "logs" / f"learner_{i}.log").exists())
  assert two.returncode == 0, two.stdout[-2000:] + logs
  assert "learner_0: exit code 0" in two.stdout and "learner_1: exit code 0" in two.stdout
  # process 0 wrote the run's files; process 1 its own metrics under process_1/
  assert (tmp_path / "two" / "curves.png").is_file() and (tmp_path / "two" / "summary.json").is_file()
  assert (tmp_path / "two" / "process_1" / "metrics.jsonl").is_file()
  assert not (tmp_path / "two" / "process_1" / "hf_export").exists()
  assert_same_arrays(exported_params(tmp_path / "two" / "hf_export"), dict(np.load(variant_runs / "fsdp.npz")),
                     "parameters of 2 processes x 4 devices vs 1 process x 8 devices")
  want = stable_records(variant_runs / "fsdp" / "metrics.jsonl")
  assert len([r for r in want if r["step"] > 0]) == 8
  assert_same_records(stable_records(tmp_path / "two" / "metrics.jsonl"), want, "metrics of process 0")
  assert_same_records(stable_records(tmp_path / "two" / "process_1" / "metrics.jsonl"), want, "metrics of process 1")


def test_initialize_names_what_is_missing(monkeypatch):
  from jaxrl_llm.learner import multihost

  for var in (multihost.ENV_COORDINATOR, multihost.ENV_NUM_PROCESSES, multihost.ENV_PROCESS_ID):
    monkeypatch.delenv(var, raising=False)
  assert multihost.initialize() is False  # one process: nothing to join
  with pytest.raises(ValueError, match="num_processes=2 needs a coordinator address"):
    multihost.initialize(num_processes=2, process_id=0)
  monkeypatch.setenv(multihost.ENV_COORDINATOR, "127.0.0.1:1")
  monkeypatch.setenv(multihost.ENV_NUM_PROCESSES, "2")
  with pytest.raises(ValueError, match=r"process_id=None: expected an integer in \[0, 2\)"):
    multihost.initialize()
  with pytest.raises(ValueError, match=r"process_id=2: expected an integer in \[0, 2\)"):
    multihost.initialize(process_id=2)


def test_pipeline_mode_with_several_processes_is_refused_by_name():
  from jaxrl_llm.experiments import definition

  jobs = definition.learner_jobs(["--config=c.py"], processes=2, devices_per_process=4, coordinator="127.0.0.1:5")
  assert [j.name for j in jobs] == ["learner_0", "learner_1"]
  assert jobs[1].args[-3:] == ("--num_processes=2", "--process_id=1", "--coordinator_address=127.0.0.1:5")
  assert jobs[0].env["XLA_FLAGS"] == "--xla_force_host_platform_device_count=4"
  with pytest.raises(ValueError, match="2 learner processes need a coordinator address"):
    definition.learner_jobs([], processes=2)
