"""Runs that repeat bit for bit: repeats, micro-batch counts, data-parallel sizes, FSDP, SIGKILL + resume.

All runs use one tiny batch-invariant config (``TINY_CONFIG``: a 1-layer decoder of
width 32 on 1-digit addition, a short SFT warm start then GRPO), written to a file
so that in-process runs and ``launch.train`` subprocesses build the same config.
The persistent compilation cache of ``conftest.py`` lets runs with the same mesh
reuse each other's programs, in this session and the next ones (compiling the
batch-invariant step dominates the time).

The mesh and micro-batch variants run in two worker processes (this file run as a
script), so that JAX there sees 8 CPU devices and the compilation cache, and the
pytest process is left alone. The SIGKILL test kills its run at a fixed point (a
checkpoint about to be written), not after a delay.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

TINY_CONFIG = '''
"""Tiny batch-invariant run of the determinism tests."""
import ml_collections
from jaxrl_llm.configuration import base_config


def get_config():
  c = base_config()
  c.name = "determinism"
  c.seed = 3
  c.model.hidden_size = 32
  c.model.intermediate_size = 64
  c.model.num_layers = 1
  c.model.num_heads = 2
  c.model.num_kv_heads = 1
  c.model.max_position_embeddings = 32
  c.model.batch_invariant = True
  c.task.kwargs = ml_collections.ConfigDict(
      {"max_digits": 1, "eval_fraction": 0.3, "partial_credit": 0.5, "format_reward": 0.3})
  c.task.eval_size = 8
  c.sft.steps = 2
  c.sft.batch_size = 8
  c.rl.steps = 8
  c.rl.prompts_per_step = 8
  c.rl.samples_per_prompt = 2
  c.rl.max_new_tokens = 3
  c.optimizer.lr = 3e-3
  c.learner.mesh = ml_collections.ConfigDict({"data": 1, "fsdp": 1, "tensor": 1})
  c.eval.every = 100
  c.eval.pass_k = 2
  c.checkpoint.every = 100
  c.log.progress = False
  c.log.tensorboard = False
  c.export.hf = False
  return c
'''

# Metrics that measure wall-clock time, not the computation.
VOLATILE = ("time", "reward/task/seconds", "reward/eval/seconds")
VOLATILE_PREFIXES = ("time/", "throughput/")


def write_config(folder) -> str:
  path = os.path.join(str(folder), "tiny_invariant.py")
  with open(path, "w") as f:
    f.write(TINY_CONFIG)
  return path


def stable_records(path: str, tolerate_torn_line: bool = False) -> list[dict]:
  """metrics.jsonl records without the wall-clock fields.

  With ``tolerate_torn_line``, one line that does not parse (a write cut by SIGKILL) is skipped.
  """
  out, torn = [], 0
  with open(path) as f:
    for line in f:
      try:
        r = json.loads(line)
      except json.JSONDecodeError:
        torn += 1
        assert tolerate_torn_line and torn == 1, f"{path}: unreadable line {line[:200]!r}"
        continue
      out.append({k: v for k, v in r.items() if k not in VOLATILE and not k.startswith(VOLATILE_PREFIXES)})
  return out


def bits(a: np.ndarray) -> np.ndarray:
  a = np.ascontiguousarray(a)
  return a.view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def assert_same_arrays(a: dict, b: dict, what: str) -> None:
  assert sorted(a) == sorted(b), what
  for k in a:
    assert a[k].shape == b[k].shape, f"{what}: {k}"
    assert np.array_equal(bits(a[k]), bits(b[k])), f"{what}: {k} differs in its bits"


def assert_same_records(a: list[dict], b: list[dict], what: str) -> None:
  assert len(a) == len(b), what
  for ra, rb in zip(a, b):
    assert ra.keys() == rb.keys(), f"{what}: step {ra.get('step')} keys"
    for k in ra:
      assert repr(ra[k]) == repr(rb[k]), f"{what}: step {ra['step']} {k}: {ra[k]!r} != {rb[k]!r}"


def cache_env(cache_dir: str, **extra: str) -> dict:
  env = dict(os.environ)
  env.update({"JAX_COMPILATION_CACHE_DIR": str(cache_dir), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
              "JAX_PLATFORMS": "cpu", "PYTHONPATH": os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))})
  env.update(extra)
  return env


_SESSION: dict = {}  # session fixtures shared with the modules that import them


@pytest.fixture(scope="session")
def compile_cache(tmp_path_factory):
  """The persistent compilation cache of every subprocess of the determinism/multi-host/experiment tests.

  The user-level cache of ``conftest.py`` (shared across sessions); a session folder when it is off.
  """
  if "cache" not in _SESSION:
    _SESSION["cache"] = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(tmp_path_factory.mktemp("jax_cache"))
  return _SESSION["cache"]


# ----------------------------------------------------------------------------- unit


def test_running_tree_is_the_reduce_tree():
  import jax.numpy as jnp

  from jaxrl_llm import reduce
  from jaxrl_llm.learner import update

  rng = np.random.default_rng(0)
  x = (rng.normal(size=(8, 5)) * np.exp(rng.normal(size=(8, 5)) * 4)).astype(np.float32)
  for size in (1, 2, 4, 8):
    stack = [jnp.zeros(5, jnp.float32) for _ in range(size.bit_length())]
    for i in range(size):
      stack = update._tree_push(stack, jnp.int32(i), jnp.asarray(x[i]))
    np.testing.assert_array_equal(bits(np.asarray(stack[-1])), bits(np.asarray(reduce.tree_sum(x[:size]))))


def test_atom_layout_errors_name_the_field():
  from jaxrl_llm import configuration as C
  from jaxrl_llm.learner import mesh as mesh_lib

  mesh = mesh_lib.make_mesh({"data": 8})
  with pytest.raises(ValueError, match=r"learner.grad_atoms=4: expected a multiple of the mesh's batch shards"):
    mesh_lib.check_grad_atoms(mesh, 4)
  with pytest.raises(ValueError, match="learner.grad_atoms=6: expected a power of two"):
    mesh_lib.check_grad_atoms(mesh, 6)
  c = C.base_config()
  c.model.batch_invariant = True
  c.rl.prompts_per_step, c.rl.samples_per_prompt = 4, 2
  c.learner.micro_batches = 2
  c.learner.grad_atoms = 8
  with pytest.raises(C.ConfigError, match=r"learner.grad_atoms=8: expected a divisor of rl.prompts_per_step=4"):
    C.validate(c)
  c.rl.prompts_per_step = 8
  C.validate(c)
  c.learner.grad_atoms = 12
  with pytest.raises(C.ConfigError, match="learner.grad_atoms=12: expected a power of two"):
    C.validate(c)


# ----------------------------------------------------------------------------- whole runs

VARIANTS = {
    "base": {"learner.mesh.data": 1},
    "dp2": {"learner.mesh.data": 2},
    "dp4": {"learner.mesh.data": 4},
    "dp8": {"learner.mesh.data": 8},
    "fsdp": {"learner.mesh.data": 2, "learner.mesh.fsdp": 4},
    "repeat": {"learner.mesh.data": 1},
    "micro2": {"learner.mesh.data": 1, "learner.micro_batches": 2},
    "micro4": {"learner.mesh.data": 1, "learner.micro_batches": 4},
}


def _worker(config_path: str, out_dir: str, names: list[str]) -> None:
  """Runs each variant in this process; writes <out>/<name>/ (metrics.jsonl) and <name>.npz."""
  import jax

  from jaxrl_llm.experiments import apply_overrides, load_config
  from jaxrl_llm import jobs
  from jaxrl_llm.learner import multihost

  for name in names:
    start = time.monotonic()
    config = apply_overrides(load_config(config_path), dict(VARIANTS[name], run_dir=os.path.join(out_dir, name)))
    run = jobs.RLJob(config)
    run.train()
    flat = jax.tree_util.tree_flatten_with_path(multihost.to_host(run.params))[0]
    np.savez(os.path.join(out_dir, f"{name}.npz"), **{jax.tree_util.keystr(p): v for p, v in flat})
    print(f"variant {name} done in {time.monotonic() - start:.1f} s", flush=True)


# Two workers side by side (compiling dominates and uses one core each); the variants that reuse
# the base run's programs follow it in the same worker.
WORKERS = (("base", "repeat", "micro2", "micro4", "dp2"), ("dp4", "dp8", "fsdp"))


@pytest.fixture(scope="session")
def variant_runs(tmp_path_factory, compile_cache):
  """Runs every variant of VARIANTS once per session; returns the folder of their outputs."""
  if "variants" in _SESSION:
    return _SESSION["variants"]
  out = tmp_path_factory.mktemp("variants")
  config = write_config(out)
  env = cache_env(compile_cache, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  procs = [subprocess.Popen([sys.executable, __file__, config, str(out), *names], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for names in WORKERS]
  outputs = [p.communicate(timeout=1200) for p in procs]
  for p, (stdout, stderr) in zip(procs, outputs):
    assert p.returncode == 0, stdout[-3000:] + stderr[-6000:]
  _SESSION["variants"] = out
  return out


def test_invariant_runs_are_bitwise_equal_across_repeats_micro_batches_and_meshes(variant_runs):
  tmp_path = variant_runs
  names = list(VARIANTS)
  base_params = dict(np.load(tmp_path / "base.npz"))
  base_records = stable_records(tmp_path / "base" / "metrics.jsonl")
  rl = [r for r in base_records if r["step"] > 0 and "grad_norm" in r]
  assert len(rl) == 8 and any(r["grad_norm"] > 0 for r in rl), "the RL steps must move the policy"
  assert any(r.get("reward/std", 0) > 0 for r in rl)
  failures = []
  for name in names[1:]:
    try:
      assert_same_arrays(dict(np.load(tmp_path / f"{name}.npz")), base_params, f"parameters of {name} vs base")
      assert_same_records(stable_records(tmp_path / name / "metrics.jsonl"), base_records, f"metrics of {name}")
    except AssertionError as e:
      failures.append(str(e).splitlines()[0])
  assert not failures, failures


# ----------------------------------------------------------------------------- SIGKILL + resume


def _train_args(config: str, run_dir) -> list[str]:
  return [f"--config={config}", f"--run_dir={run_dir}", "--config.checkpoint.every=2", "--config.export.hf=true"]


# ``launch.train`` that SIGKILLs itself when it is about to write the checkpoint of global step
# KILL_AT: the kill falls at one chosen point of the run, whatever the machine's load (a watcher that
# polls the checkpoint folder can miss the window, or find a run that has already ended).
KILL_AT = 6
KILLING_TRAIN = f'''
"""launch.train, killed by SIGKILL when the checkpoint of step {KILL_AT} is due (the test's fault injection)."""
import os
import signal

from jaxrl_llm.learner import checkpoint

_save = checkpoint.Checkpointer.save


def save(self, step, *args, **kwargs):
  if step == {KILL_AT}:
    os.kill(os.getpid(), signal.SIGKILL)
  return _save(self, step, *args, **kwargs)


checkpoint.Checkpointer.save = save
from launch import train  # noqa: E402

train.run()
'''


def exported_params(folder) -> dict:
  """An ``hf_export`` folder read back into the Flax layout, keyed like the variants' .npz files."""
  import jax

  from jaxrl_llm import bridge
  flat = jax.tree_util.tree_flatten_with_path(bridge.load_hf_params(str(folder)))[0]
  return {jax.tree_util.keystr(p): np.asarray(v) for p, v in flat}


def test_sigkill_mid_training_then_resume_matches_an_uninterrupted_run(tmp_path, compile_cache, variant_runs):
  """``launch.train`` killed with SIGKILL two RL steps after a mid-RL checkpoint, then rerun (it
  resumes); the uninterrupted reference is the ``base`` variant (same config, same mesh)."""
  config = write_config(tmp_path)
  # 8 devices as in the other runs (the flags are part of the compilation-cache key); the mesh uses one
  env = cache_env(compile_cache, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  run_dir = tmp_path / "killed"
  killing = tmp_path / "killing_train.py"
  killing.write_text(KILLING_TRAIN)
  killed = subprocess.run([sys.executable, str(killing), *_train_args(config, run_dir)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-4000:]
  # SFT takes global steps 1-2: the checkpoints of steps 2 and 4 are complete, the one of step 6 never started
  assert sorted(int(d) for d in os.listdir(run_dir / "checkpoints") if d.isdigit()) == [2, 4]

  resumed = subprocess.run([sys.executable, "-m", "launch.train", *_train_args(config, run_dir)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-4000:]
  assert "Resumed from" in resumed.stdout
  restart_step = int(resumed.stdout.split("Resumed from", 1)[1].split("at step ", 1)[1].split()[0]) - 2
  assert restart_step == 2

  want = {r["step"]: r for r in stable_records(variant_runs / "base" / "metrics.jsonl") if r["step"] > 0}
  # the resume cut the killed run's lines past its checkpoint (RL steps 3-4) out of metrics.jsonl: each
  # step is there once, the steps after the checkpoint as the resumed process wrote them
  records = [r for r in stable_records(run_dir / "metrics.jsonl") if r["step"] > 0]
  assert [r["step"] for r in records] == sorted(want), [r["step"] for r in records]
  got = {r["step"]: r for r in records}
  compared = [s for s in want if s > restart_step]
  assert compared == [3, 4, 5, 6, 7, 8], (restart_step, sorted(want))
  for s in compared:
    assert_same_records([got[s]], [want[s]], f"RL step {s} after a SIGKILL at RL step {restart_step}")
  assert_same_arrays(exported_params(run_dir / "hf_export"), dict(np.load(variant_runs / "base.npz")),
                     "final parameters of the resumed run")


# Pipeline mode: Ray sampler actors k = 2 versions ahead, each RL step sampled by exactly the version k
# steps older (rollout.exact_versions), so the run does not depend on timing and can be compared bit for bit.
PIPELINE_ARGS = ["--config.rollout.mode=pipeline", "--config.rollout.exact_versions=true", "--config.rollout.max_lag=2",
                 "--config.rollout.num_samplers=1", "--config.rollout.actor_cpus=0.5", "--config.rl.steps=6"]
# wall-clock and per-process counters (the pool is new in a resumed process; the feeder's counters are checkpointed)
PIPELINE_VOLATILE = ("pipeline/wait_s", "pipeline/sampler_busy_s")


def pipeline_records(path, tolerate_torn_line: bool = False) -> dict[int, dict]:
  records = stable_records(path, tolerate_torn_line)
  return {r["step"]: {k: v for k, v in r.items() if k not in PIPELINE_VOLATILE and not k.startswith("pool/")}
          for r in records if r["step"] > 0}


def test_pipeline_sigkill_then_resume_matches_an_uninterrupted_run(tmp_path, compile_cache):
  """The pipeline's queued, in-flight and sampled-but-untrained work is in the checkpoint: ``launch.train``
  in pipeline mode killed with SIGKILL after a mid-RL checkpoint, then rerun, resumes with the sampled
  chunks of the steps ahead restored (nothing sampled twice) and ends with the uninterrupted run's
  parameters, bit for bit."""
  config = write_config(tmp_path)
  env = cache_env(compile_cache, XLA_FLAGS="--xla_force_host_platform_device_count=8")
  ref_dir, run_dir = tmp_path / "uninterrupted", tmp_path / "killed"
  killing = tmp_path / "killing_train.py"
  killing.write_text(KILLING_TRAIN)
  # the uninterrupted run and the one to be killed side by side (each on its own local Ray cluster)
  ref = subprocess.Popen([sys.executable, "-m", "launch.train", *_train_args(config, ref_dir), *PIPELINE_ARGS],
                         cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
  killed = subprocess.run([sys.executable, str(killing), *_train_args(config, run_dir), *PIPELINE_ARGS], cwd=REPO,
                          env=env, capture_output=True, text=True, timeout=600)
  ref_out, ref_err = ref.communicate(timeout=600)
  assert ref.returncode == 0, ref_out[-2000:] + ref_err[-4000:]
  assert killed.returncode == -signal.SIGKILL, killed.stderr[-4000:]
  assert sorted(int(d) for d in os.listdir(run_dir / "checkpoints") if d.isdigit()) == [2, 4]

  resumed = subprocess.run([sys.executable, "-m", "launch.train", *_train_args(config, run_dir), *PIPELINE_ARGS],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert resumed.returncode == 0, resumed.stderr[-4000:]
  assert "Resumed from" in resumed.stdout and "at step 4 (rl phase)" in resumed.stdout, resumed.stdout[-2000:]
  # RL steps 0-1 trained; steps 2-3 (k = 2 ahead) were sampled before the checkpoint and come back from it
  assert ("Pipeline resumed: 2 sampled chunks of RL steps 2-3 restored from the checkpoint (not sampled again); "
          "dispatching from RL step 4.") in resumed.stdout, resumed.stdout[-2000:]

  want = pipeline_records(ref_dir / "metrics.jsonl")
  got = pipeline_records(run_dir / "metrics.jsonl", tolerate_torn_line=True)
  assert sorted(want) == [1, 2, 3, 4, 5, 6] and max(r["data/lag_max"] for r in want.values()) == 2
  for s in (3, 4, 5, 6):
    if s <= 2 + 2:
      # The stale consistency check re-scores stale rows with the learner's parameters of their own version,
      # kept in a window that is not in the checkpoint: for the k steps restored from it (sampled by
      # versions older than the resumed one) it reports "unchecked" (jobs/stale_check.py). Training is
      # unaffected; every other metric is compared.
      for r in (got[s], want[s]):
        for k in [k for k in r if k.startswith("consistency/")]:
          del r[k]
    assert_same_records([got[s]], [want[s]], f"RL step {s} after a SIGKILL and a resume at RL step 2")
  # nothing re-sampled: the resumed process's pool ran only the work submitted after the checkpoint
  # (the feeder's count goes on from the checkpoint's, and equals the uninterrupted run's: 1 item per step)
  # the resume cut metrics.jsonl back to the checkpoint (RL step 2): each step once, no torn line
  lines = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
  assert [r["step"] for r in lines if r["step"] > 0] == [1, 2, 3, 4, 5, 6]
  resumed_lines = [r for r in lines if r["step"] > 2]  # the resumed process's records
  submitted_at_checkpoint = want[2]["pipeline/submitted"]
  assert submitted_at_checkpoint == 4  # steps 0..3
  for r in resumed_lines:
    assert r["pool/dispatched"] <= r["pipeline/submitted"] - submitted_at_checkpoint, r
  assert_same_arrays(exported_params(run_dir / "hf_export"), exported_params(ref_dir / "hf_export"),
                     "final parameters of the resumed pipeline run")


if __name__ == "__main__":
  _worker(sys.argv[1], sys.argv[2], sys.argv[3:])
