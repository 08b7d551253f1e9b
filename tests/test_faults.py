"""Fault injection: each fault a user hit, reproduced, ending in the documented behaviour.

This file holds the faults of the update guard, validation and the command line. The
others live next to the code they exercise; together they are the fault suite:

* a reward that hangs (even holding the GIL in C code), raises, crashes or eats memory;
  the pathological math answers: test_tasks_reward_runner.py, test_tasks_math_verify.py;
* evaluation bypassing the reward guard; a verifier failing on every call:
  test_jobs_rewards.py;
* a non-finite update; inf learning rates and temperatures: this file;
* a NaN state saved; truncated, bit-flipped, same-step and unwritable checkpoints; a
  config changed on resume; a rerun with more steps; replayed metrics:
  test_checkpoint_integrity.py;
* Ray listening beyond loopback; processes left after the driver dies: test_ray_loopback.py;
* a prompt longer than the context; bad encoding; task options from the command line:
  test_prompt_check.py, test_tasks_jsonl.py;
* tracebacks instead of usage errors: this file, test_experiments.py.
"""

import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxrl_llm import configuration
from jaxrl_llm.learner import update

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------------------- non-finite numbers


@pytest.mark.parametrize("path", ["sft.lr", "optimizer.lr", "critic.lr", "reward_model.lr", "rl.temperature"])
@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")])
def test_validation_rejects_non_finite_rates_and_temperatures(path, value):
  config = configuration.base_config()
  configuration.override(config, path, value)
  with pytest.raises(configuration.ConfigError, match=rf"{path}={value!r}: expected a finite number > 0"):
    configuration.validate(config)


def _params():
  return {"w": jnp.ones((3, 2), jnp.float32), "b": jnp.zeros((2,), jnp.float32)}


def test_an_update_that_makes_the_weights_non_finite_is_skipped():
  """Finite loss and gradients, an infinite step: the new weights would be inf, so nothing changes."""
  params = _params()
  optimizer = optax.sgd(float("inf"))
  opt_state = optimizer.init(params)
  grads = jax.tree.map(jnp.ones_like, params)
  new_params, new_opt, applied, metrics = jax.jit(
      lambda p, o, g: update.guarded_apply(p, o, g, jnp.float32(1.0), optimizer))(params, opt_state, grads)
  assert not bool(applied)
  assert float(metrics["update/skipped_nonfinite"]) == 1.0
  assert np.isfinite(float(metrics["grad_norm"]))  # the gradient itself was fine
  for a, b in zip(jax.tree.leaves(new_params), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  for a, b in zip(jax.tree.leaves(new_opt), jax.tree.leaves(opt_state)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_an_optimizer_state_that_overflows_is_skipped():
  """Adam's second moment overflows float32 (g^2 = inf) while params stay finite: skipped too."""
  params = _params()
  optimizer = optax.adam(1e-3)
  opt_state = optimizer.init(params)
  grads = jax.tree.map(lambda x: jnp.full_like(x, 3e38), params)  # finite, but its square is not
  _, new_opt, applied, _ = update.guarded_apply(params, opt_state, grads, jnp.float32(1.0), optimizer)
  assert not bool(applied)
  assert all(bool(jnp.all(jnp.isfinite(x))) for x in jax.tree.leaves(new_opt))


def test_a_finite_update_is_applied():
  params = _params()
  optimizer = optax.sgd(0.5)
  new_params, _, applied, metrics = update.guarded_apply(
      params, optimizer.init(params), jax.tree.map(jnp.ones_like, params), jnp.float32(1.0), optimizer)
  assert bool(applied) and float(metrics["update/skipped_nonfinite"]) == 0.0
  np.testing.assert_allclose(np.asarray(new_params["w"]), 0.5)


# ---------------------------------------------------------------------------- usage errors


def _train(*flags):
  """Starts ``python -m launch.train`` with ``flags`` (not waited for)."""
  environment = {k: v for k, v in os.environ.items() if k != "JAXRL_VERBOSE"}
  return subprocess.Popen([sys.executable, "-m", "launch.train", *flags], cwd=ROOT, env=environment,
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# One case per path an input error takes through the command line: flag parsing, validation,
# job construction, loading the config file. (Validation's messages themselves are tested in
# process below and in test_learner_config.py.)
USAGE_CASES = {
    "unknown field": (["--config.rl.stepz=5"], ["config field 'rl.stepz' does not exist", "did you mean 'rl.steps'?"]),
    "unknown recipe": (["--config.objective.recipe=grpoo"], ["objective.recipe='grpoo'", "did you mean 'grpo'?"]),
    "mesh larger than the machine": (["--config.learner.mesh.data=64"], ["learner.mesh=", "number of devices"]),
    "missing config file": (["--config=/nonexistent/config.py"], ["/nonexistent/config.py"]),
}


def test_validation_names_the_closest_task_recipe_and_argument():
  config = configuration.base_config()
  config.task.name = "additon"
  config.objective.kwargs = {"epz": 0.2}
  with pytest.raises(configuration.ConfigError) as e:
    configuration.validate(config)
  assert "task.name='additon'" in str(e.value) and "did you mean 'addition'?" in str(e.value)
  config = configuration.base_config()
  config.objective.kwargs = {"epz": 0.2}
  with pytest.raises(configuration.ConfigError, match=r"objective.kwargs.epz=0.2: not a parameter .*did you mean 'eps'\?"):
    configuration.validate(config)


def test_a_task_that_rejects_its_arguments_or_data_is_a_config_error(tmp_path):
  from jaxrl_llm import errors, tasks  # pylint: disable=import-outside-toplevel
  with pytest.raises(errors.ConfigError, match=r"task 'addition' .*max_digits"):
    tasks.get_task("addition", max_digits=-3)
  with pytest.raises(errors.ConfigError, match=r"task 'jsonl' .*missing.jsonl"):
    tasks.get_task("jsonl", path=str(tmp_path / "missing.jsonl"))
  with pytest.raises(errors.ConfigError, match="did you mean 'sorting'"):
    tasks.get_task("sortin")


@pytest.fixture(scope="module")
def usage_runs(tmp_path_factory):
  """Every usage case run at once (each is a fresh interpreter), plus one with --verbose."""
  run_dir = str(tmp_path_factory.mktemp("usage"))
  procs = {name: _train(*flags, f"--run_dir={run_dir}/{i}") for i, (name, (flags, _)) in enumerate(USAGE_CASES.items())}
  procs["verbose"] = _train("--config.objective.recipe=grpoo", "--verbose", f"--run_dir={run_dir}/v")
  return {name: (p.wait(timeout=600), *p.communicate()) for name, p in procs.items()}


@pytest.mark.parametrize("case", list(USAGE_CASES))
def test_usage_errors_are_one_paragraph_and_exit_2(usage_runs, case):
  status, _, stderr = usage_runs[case]
  assert status == 2, stderr
  assert "Traceback" not in stderr, stderr
  lines = stderr.splitlines()
  start = next(i for i, l in enumerate(lines) if l.startswith("train.py: usage error:"))
  assert len(lines) - start <= 8, stderr  # the message, the fields it lists, the hint: nothing after
  for needle in USAGE_CASES[case][1]:
    assert needle in stderr, (needle, stderr)
  assert "--verbose" in stderr


def test_verbose_shows_the_traceback(usage_runs):
  status, _, stderr = usage_runs["verbose"]
  assert status == 2
  assert "Traceback" in stderr and "did you mean 'grpo'?" in stderr


def test_verbose_is_read_from_the_flag_or_the_environment(monkeypatch):
  from launch import cli  # pylint: disable=import-outside-toplevel
  monkeypatch.delenv("JAXRL_VERBOSE", raising=False)
  assert not cli.verbose(["train.py", "--config.rl.steps=3"])
  assert cli.verbose(["train.py", "--verbose"])
  monkeypatch.setenv("JAXRL_VERBOSE", "1")
  assert cli.verbose(["train.py"])
  monkeypatch.setenv("JAXRL_VERBOSE", "0")
  assert not cli.verbose(["train.py"])
