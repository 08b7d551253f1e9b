"""Multi-turn episodes in the RL job: the synchronous loop, and the pipeline's actors playing them."""

import json
import sys

import jax
import ml_collections
import numpy as np
import pytest

from jaxrl_llm import jobs
from jaxrl_llm.configuration import ConfigError, validate

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from tiny_configs import tiny_config  # noqa: E402


def episode_config(run_dir, **overrides):
  """The tiny RL run on one-digit products, played as "guess the number" episodes (3 turns of 4 tokens)."""
  c = tiny_config(run_dir, **overrides)
  c.task.name = "tool_multiply"
  c.task.kwargs = ml_collections.ConfigDict({"min_digits": 1, "max_digits": 1, "eval_fraction": 0.3})
  c.model.max_position_embeddings = 64
  c.env.name = "guess"
  c.env.max_turns = 3
  c.env.max_tokens = 40
  c.env.max_turn_tokens = 4
  return c


def _metrics(run_dir):
  return [json.loads(line) for line in open(run_dir / "metrics.jsonl")]


def test_pipeline_actors_play_the_synchronous_runs_episodes(tmp_path):
  """The synchronous loop plays episodes, trains and reports their turns; the pipeline's two actors (two
  chunks a step, k = 0) play the same episodes and give the same updates, bit for bit (batch-invariant
  mode; each row's turns sample with its global row id)."""
  pytest.importorskip("ray")
  common = dict(rl__steps=2, rl__prompts_per_step=8, checkpoint__every=100, export__hf=False, eval__every=100,
                model__batch_invariant=True)
  sync = jobs.RLJob(episode_config(tmp_path / "sync", **common))
  summary = sync.train()
  assert summary["rl_steps"] == 2 and "final_accuracy" in summary
  evals = [r for r in _metrics(tmp_path / "sync") if "eval/greedy_turns_mean" in r]
  assert evals and "eval/accuracy" in evals[-1]  # held-out evaluation plays episodes too
  pipe = jobs.RLJob(episode_config(tmp_path / "pipe", rollout__mode="pipeline", rollout__num_samplers=2,
                                   rollout__chunks_per_step=2, rollout__max_lag=0, rollout__actor_cpus=0.5,
                                   **common))
  try:
    pipe.train()
  finally:
    import ray
    ray.shutdown()
  s_rows = [r for r in _metrics(tmp_path / "sync") if "env/turns_mean" in r]
  p_rows = [r for r in _metrics(tmp_path / "pipe") if "env/turns_mean" in r]
  assert len(p_rows) == len(s_rows) == 2
  for r in s_rows:
    assert 1.0 <= r["env/turns_mean"] <= 3.0
    assert r["env/observation_tokens"] > 0  # the untrained model's guesses got hints back
    assert sum(r[f"env/ended_{k}"] for k in ("done", "turn_limit", "token_limit", "context_exhausted")) == 16
  for a, b in zip(s_rows, p_rows):
    for key in ("env/turns_mean", "env/observation_tokens", "env/model_tokens", "reward/mean"):
      assert a[key] == b[key], key
  for a, b in zip(jax.tree.leaves(sync.params), jax.tree.leaves(pipe.params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_environment_settings_are_checked_with_the_rest(tmp_path):
  c = episode_config(tmp_path / "bad")
  c.env.name = "no_such_env"
  c.env.max_turn_tokens = 99
  c.critic.enabled = True
  with pytest.raises(ConfigError) as err:
    validate(c)
  text = str(err.value)
  assert "env.name='no_such_env' is not a registered environment" in text
  assert "env.max_turn_tokens=99: expected at most env.max_tokens=40" in text
  c = episode_config(tmp_path / "bad2", rollout__mode="pipeline", rollout__exact_versions=True)
  with pytest.raises(ConfigError, match="rollout.exact_versions=True: expected False"):
    validate(c)
  c = episode_config(tmp_path / "bad3")
  c.env.name = "jaxrl_llm.envs.guess:NoSuchFactory"
  with pytest.raises(ConfigError, match="env.name"):
    validate(c)
