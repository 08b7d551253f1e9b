"""Config: one declaration per setting, overrides, validation (every error names the field, the value and what
was expected), the objective built from ``objective.recipe`` / ``objective.kwargs``."""

import importlib
import inspect
import os
import subprocess
import sys

import ml_collections
import pytest

from jaxrl_llm import configuration as C, objectives as O
from jaxrl_llm.configuration import schema
from jaxrl_llm.diagnostics import control
from jaxrl_llm.learner import builders
from jaxrl_llm.settings import config_fields, default_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = ["grpo_addition", "ppo_addition", "cispo_scalerl", "dapo_addition", "qwen2_5_gsm8k", "rm_addition",
           "ppo_rm_addition"]


def errors_of(config):
  with pytest.raises(C.ConfigError) as e:
    C.validate(config)
  return str(e.value)


@pytest.mark.parametrize("name", CONFIGS)
def test_shipped_configs_validate_and_build_their_objective(name):
  config = importlib.import_module(f"configs.{name}").get_config()
  C.validate(config)
  builders.build_objective(config)


def test_base_config_is_built_from_the_settings_dataclasses():
  """Each default is written once: the dataclass default is the config default, field for field."""
  c = C.base_config()
  seen = set()
  for part in schema.parts():
    instance = part.cls(**schema.derived_values(c).get(part.name, {}))
    for f in config_fields(part.cls):
      path = schema.field_path(part.section, f.name)
      assert path not in seen, f"{path} is declared twice"
      seen.add(path)
      value = C.get_field(c, path)
      plain = value.to_dict() if isinstance(value, ml_collections.ConfigDict) else value
      assert plain == getattr(instance, f.name) == default_of(f), path
      assert f.metadata["doc"] and f.metadata["check"] is not None or f.metadata.get("free"), path
  assert control.ControlSettings().drift_target == c.control.drift_target
  assert C.settings(c).control == control.ControlSettings()
  assert c.is_locked and not c.task.kwargs.is_locked and not c.objective.kwargs.is_locked
  assert "max_filter_rate" not in c.diagnostics and set(c.objective) == {"recipe", "kwargs", "proximal", "corrections"}


def test_typed_settings_carry_the_derived_staleness_window():
  c = C.base_config()
  c.rollout.mode = "pipeline"
  c.control.min_lag = 9
  s = C.settings(c)
  assert (s.control.max_lag, s.control.min_lag) == (4, 4)
  assert s.guard.every == 25 and s.curation.window == c.data.window and s.consistency.max_kl_k3 == 1e-3
  assert s.learner.mesh == {"data": -1, "fsdp": 1, "tensor": 1} and s.objective.kwargs == {}


def test_all_errors_reported_together_with_field_value_and_expectation():
  c = C.base_config()
  c.rl.steps = -3
  c.model.family = "gpt2"
  c.objective.kwargs.eps_high = 0.3
  c.task.kwargs.digits = 3
  c.control.tighten = 1.5
  c.data.drop_pass_rate = 2.0
  c.diagnostics.max_out_of_bounds = 2.0
  msg = errors_of(c)
  assert "rl.steps=-3: expected an integer >= 0" in msg
  assert "model.family='gpt2': expected one of ('llama', 'qwen2', 'qwen3')" in msg
  assert "objective.kwargs.eps_high=0.3: not a parameter of recipe 'grpo' (it takes: eps, kl_coef, " in msg
  assert "task.kwargs.digits=3: not a parameter of task 'addition' (it takes: min_digits, max_digits" in msg
  assert "control.tighten=1.5: expected a number in (0, 1)" in msg
  assert "data.drop_pass_rate=2.0: expected a number in [0, 1]" in msg
  assert "diagnostics.max_out_of_bounds=2.0: expected a number in [0, 1] or None" in msg


def test_cross_field_checks():
  c = C.base_config()
  c.advantage.estimator = "gae"
  c.learner.micro_batches = 3
  c.model.num_heads = 3
  c.control.min_clip_scale = 2.0
  c.guard.clip_shrink = 0.5
  msg = errors_of(c)
  for text in ("advantage.estimator='gae': expected critic.enabled=True", "learner.micro_batches=3",
               "model.num_heads=3: expected a divisor of model.hidden_size=128",
               "control.min_clip_scale=2.0: expected <= control.max_clip_scale=1.0",
               "guard.clip_shrink=0.5: expected 1.0 unless control.enabled=True"):
    assert text in msg


def test_unknown_fields_are_errors_and_free_mappings_take_new_keys():
  c = C.base_config()
  with pytest.raises(AttributeError, match="eps_hihg"):
    c.objective.eps_hihg = 0.3
  with pytest.raises(C.ConfigError, match="'objective.eps' does not exist"):
    C.override(c, "objective.eps", 0.3)
  with pytest.raises(C.ConfigError, match="'objectiv' does not exist"):
    C.override(c, "objectiv.eps", 0.3)
  C.override(c, "objective.kwargs.eps", 0.3)
  C.override(c, "task.kwargs.max_digits", 3)
  assert c.objective.kwargs.eps == 0.3 and c.task.kwargs.max_digits == 3
  C.validate(c)
  loose = ml_collections.ConfigDict(C.base_config().to_dict())
  loose.rl.stepz = 3
  assert "rl.stepz: not a config field" in errors_of(loose)


def test_objective_kwargs_are_checked_against_the_recipe():
  c = C.base_config()
  c.objective.recipe = "dapo"
  c.objective.kwargs.eps = 0.2
  assert "objective.kwargs.eps=0.2: not a parameter of recipe 'dapo' (it takes: eps_low, eps_high, dual_c)" in errors_of(c)
  with pytest.raises(ValueError, match=r"objective.kwargs.eps=0.2: not a parameter of recipe 'dapo'"):
    builders.build_objective(c)
  c.objective.kwargs = ml_collections.ConfigDict({"eps_high": -1.0})
  assert "recipe 'dapo' rejects them: " in errors_of(c)
  c.objective.kwargs = ml_collections.ConfigDict({"kl_estimator": "k9", "kl_coef": 0.0})
  c.objective.recipe = "grpo"
  assert "unknown kl_estimator 'k9'" in errors_of(c)
  c.objective.recipe = "ppo"
  c.objective.kwargs = ml_collections.ConfigDict({"value_coef": 0.5})
  assert "objective.kwargs.value_coef=0.5: expected None or unset with critic.enabled=False" in errors_of(c)


def test_the_recipe_signature_is_the_default():
  """A config without kwargs gets exactly ``recipe(name)``: grpo keeps its KL term (0.04) and needs a reference."""
  c = C.base_config()
  assert c.objective.recipe == "grpo" and not c.objective.kwargs
  call = builders.recipe_call(c)
  assert call.arguments == {} and call.kl_coef == inspect.signature(O.recipes.grpo).parameters["kl_coef"].default
  assert call.kl_coef == 0.04 and builders.needs_reference_policy(c)
  default_job = importlib.import_module("configs.grpo_addition").get_config()
  assert builders.recipe_call(default_job).arguments == {"kl_coef": 0.0}
  assert not builders.needs_reference_policy(default_job)


def test_run_provided_values_are_keyed_by_parameter_name():
  c = C.base_config()
  c.objective.recipe = "dr_grpo"
  c.rl.max_new_tokens = 7
  assert builders.recipe_call(c).arguments == {"max_response_len": 7.0}
  c.objective.kwargs.max_response_len = 12.0
  assert builders.recipe_call(c).arguments == {"max_response_len": 12.0}
  ppo = C.base_config()
  ppo.objective.recipe = "ppo"
  assert builders.recipe_call(ppo).values["value_coef"] is None
  ppo.critic.enabled, ppo.advantage.estimator = True, "gae"
  assert builders.recipe_call(ppo).arguments == {} and builders.recipe_call(ppo).values["value_coef"] == 0.5
  assert set(builders.RUN_VALUES) == {"max_response_len", "value_coef"}


def test_reference_policy_follows_the_effective_kl_coefficient():
  c = C.base_config()
  for recipe, kwargs, expected in [("grpo", {}, True), ("grpo", {"kl_coef": 0.0}, False),
                                   ("grpo", {"kl_coef": 0.01}, True), ("dapo", {}, False), ("cispo", {}, False)]:
    c.objective.recipe = recipe
    c.objective.kwargs = ml_collections.ConfigDict(kwargs)
    assert builders.needs_reference_policy(c) is expected, (recipe, kwargs)
    assert builders.objective_kl_coef(c) == (0.04 if expected and not kwargs else kwargs.get("kl_coef", 0.0))
  c.advantage.kl_reward_coef = 0.05  # the KL penalty in the reward needs the reference too
  assert builders.needs_reference_policy(c)


def test_control_makes_the_recipe_hyper_parameters_controlled():
  c = C.base_config()
  c.control.enabled, c.control.kl_target = True, 0.02
  C.validate(c)  # grpo's default kl_coef 0.04 satisfies the adaptive KL coefficient
  hypers = builders.controlled_hypers(builders.recipe_call(c), kl=True)
  assert set(hypers) == {"eps", "kl_coef"} and hypers["kl_coef"].base == 0.04
  state = builders.build_objective(c).init(None)
  assert set(O.control_keys(state)) == {control.CLIP_KEY, control.KL_KEY}
  c.objective.kwargs.kl_coef = 0.0
  assert "control.kl_target=0.02: expected a recipe with kl_coef > 0" in errors_of(c)


def test_command_line_overrides_reach_the_kwargs_and_errors_name_the_field(tmp_path):
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  proc = subprocess.run([sys.executable, "-m", "launch.train", f"--run_dir={tmp_path}",
                         "--config.objective.kwargs.eps_low=-1.0", "--config.rl.steps=-1"],
                        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
  out = proc.stderr + proc.stdout
  assert proc.returncode != 0
  assert "objective.kwargs.eps_low=-1.0: not a parameter of recipe 'grpo'" in out
  assert "rl.steps=-1: expected an integer >= 0" in out
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
