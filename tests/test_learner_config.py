"""Config loading, overrides and validation: every error names the field, the value and what was expected."""

import importlib
import os
import subprocess
import sys

import pytest

from jaxrl_llm import configuration as C
from jaxrl_llm.learner import builders

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ["grpo_addition", "ppo_addition", "cispo_scalerl", "dapo_addition", "qwen2_5_gsm8k"]


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_configs_validate_and_build_their_objective(name):
  config = importlib.import_module(f"configs.{name}").get_config()
  C.validate(config)
  builders.build_objective(config, config.rl.max_new_tokens)


def test_all_errors_reported_together_with_field_value_and_expectation():
  c = C.base_config()
  c.rl.steps = -3
  c.objective.eps_high = -0.1
  c.model.family = "gpt2"
  with pytest.raises(C.ConfigError) as e:
    C.validate(c)
  msg = str(e.value)
  assert "rl.steps=-3: expected an integer >= 0" in msg
  assert "objective.eps_high=-0.1: expected a number > 0" in msg
  assert "model.family='gpt2': expected one of ('llama', 'qwen2', 'qwen3')" in msg


def test_cross_field_checks():
  c = C.base_config()
  c.advantage.estimator = "gae"
  c.learner.micro_batches = 3
  with pytest.raises(C.ConfigError) as e:
    C.validate(c)
  assert "critic.enabled=True" in str(e.value)
  assert "learner.micro_batches=3" in str(e.value)


def test_unknown_fields_are_errors():
  c = C.base_config()
  with pytest.raises(AttributeError, match="eps_hihg"):
    c.objective.eps_hihg = 0.3
  with pytest.raises(C.ConfigError, match="'objective.eps_hihg' does not exist"):
    C.override(c, "objective.eps_hihg", 0.3)
  with pytest.raises(C.ConfigError, match="'objectiv' does not exist"):
    C.override(c, "objectiv.eps", 0.3)


def test_recipe_parameter_the_recipe_does_not_take_is_named():
  c = C.base_config()
  c.objective.recipe = "grpo"
  c.objective.eps_high = 0.28
  with pytest.raises(ValueError, match=r"objective.eps_high=0.28 is not a parameter of recipe 'grpo'"):
    builders.build_objective(c, 8)


def test_command_line_override_error_names_the_field(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "launch.train", f"--run_dir={tmp_path}",
                         "--config.objective.eps_low=-1.0"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  assert proc.returncode != 0
  assert "objective.eps_low=-1.0: expected a number > 0" in proc.stderr + proc.stdout
  assert not os.path.exists(os.path.join(tmp_path, "metrics.jsonl"))


def test_mesh_sizes_resolve_and_a_smaller_mesh_takes_the_first_devices():
  import jax
  from jaxrl_llm.learner import mesh as mesh_lib
  n = len(jax.devices())
  assert mesh_lib.resolve_mesh_shape({"data": -1, "fsdp": 1, "tensor": 1}, n) == (n, 1, 1)
  small = mesh_lib.make_mesh({"data": 1, "fsdp": 1, "tensor": 1})
  assert small.devices.size == 1 and small.devices.flat[0] == jax.devices()[0]
  with pytest.raises(ValueError, match=r"learner.mesh=.*product 16 > number of devices 8"):
    mesh_lib.resolve_mesh_shape({"data": 16}, 8)
  with pytest.raises(ValueError, match="at most one axis may be -1"):
    mesh_lib.resolve_mesh_shape({"data": -1, "fsdp": -1}, 8)
