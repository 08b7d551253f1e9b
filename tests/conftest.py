"""Test-session setup: eight CPU devices, and a persistent XLA compilation cache.

Both must be in place before JAX is first imported, so they live here, in the
environment: the subprocesses that tests start (``launch.train``, the
multi-host and experiment runs, the determinism workers) inherit them.

Compiling dominates the suite's time. The cache keeps every compiled program
(``min_compile_time_secs=0``) under the user cache folder, so a second session
on the same machine, and the subprocesses of one session, reuse them. Set
``JAXRL_TEST_XLA_CACHE`` to another folder, or to ``off`` to compile everything.
A cache entry is keyed by the program, the compile options, the XLA flags and
the jax/jaxlib versions, so a stale entry is never used. (JAX writes entries from
process 0 only, and on the CPU process 1 of a multi-process run keys its
programs differently: that process always compiles.)
"""

import os

_FLAG = "--xla_force_host_platform_device_count=8"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):
  os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def xla_cache_dir() -> str | None:
  """The persistent compilation cache folder of the tests, or None when switched off."""
  chosen = os.environ.get("JAXRL_TEST_XLA_CACHE", "")
  if chosen.lower() in ("off", "0", "none", "false"):
    return None
  if chosen:
    return os.path.abspath(os.path.expanduser(chosen))
  root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
  return os.path.join(root, "jaxrl_llm", "xla")


XLA_CACHE = xla_cache_dir()
if XLA_CACHE:
  os.makedirs(XLA_CACHE, exist_ok=True)
  os.environ.update({"JAX_COMPILATION_CACHE_DIR": XLA_CACHE, "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
                     "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"})
  import jax  # pylint: disable=wrong-import-position

  # a plugin may have imported jax before this file: the environment alone would then come too late
  jax.config.update("jax_compilation_cache_dir", XLA_CACHE)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

import pytest  # noqa: E402  pylint: disable=wrong-import-position
from hypothesis import settings as hypothesis_settings  # noqa: E402  pylint: disable=wrong-import-position

# Property tests draw the same examples on every run (no example database, no clock deadline), so a
# test's outcome never depends on an earlier run, on the order of runs or on the machine's load.
hypothesis_settings.register_profile("jaxrl_llm", derandomize=True, database=None, deadline=None)
hypothesis_settings.load_profile("jaxrl_llm")

# Under ``pytest -n 2`` (pytest-xdist, ``--dist loadgroup``) each test file runs in one worker, so
# its module fixtures (models, sampler results, compiled programs) are built once, not once per
# worker. Some files share a group: the whole-run tests share session fixtures (the determinism
# variants that the multi-host test compares against) and start subprocesses of their own, and the
# Ray tests each start a local Ray cluster sized to the machine (test_gpu_check.py's one pipeline run
# and the pipeline-resume test start theirs on the other worker).
XDIST_GROUPS = {
    "test_determinism.py": "runs", "test_multihost.py": "runs",
    "test_rollout_pool.py": "ray", "test_offpolicy_loop.py": "ray", "test_ray_loopback.py": "ray",
    "test_placement.py": "ray",
}
# Single long tests that get a group of their own, so that a free worker can take them while the
# rest of their file's group runs on the other one.
OWN_GROUP = {"test_pipeline_sigkill_then_resume_matches_an_uninterrupted_run": "pipeline_resume"}
# The longest files start first (a worker takes the next group when it is free; with
# --no-loadscope-reorder the groups keep this order), so that none of them is left for the end
# while the other worker idles.
LONG_FIRST = ("test_learner_e2e.py", "test_determinism.py", "test_multihost.py", "test_offpolicy_loop.py",
              "test_rollout_pool.py", "test_experiments.py", "test_gpu_check.py", "test_jobs.py",
              "test_learner_run.py", "test_offpolicy_corrections.py", "test_checkpoint_integrity.py",
              "test_jobs_rewards.py",
              "test_tasks_reward_runner.py", "test_prompt_check.py", "test_faults.py",
              "test_reward_model_train.py", "test_objectives_invariance.py")


def pytest_collection_modifyitems(config, items):
  del config
  for item in items:
    name = item.path.name
    group = OWN_GROUP.get(item.originalname) or XDIST_GROUPS.get(name, name)
    item.add_marker(pytest.mark.xdist_group(group))
  rank = {name: i for i, name in enumerate(LONG_FIRST)}
  items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FIRST)))  # stable: file order kept otherwise
