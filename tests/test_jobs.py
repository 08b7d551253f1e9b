"""The jobs layer: the advantages stage as a pure function, the shared Job scaffolding
(hooks with checkpointed state, one NonFiniteError, job dispatch), quiet runs (no warning
when nothing is wrong), and the worked examples of docs/architecture.md."""

import json
import logging
import pathlib
import re

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import advantages as A, jobs, tasks
from jaxrl_llm.jobs.advantages import AdvantageInputs, AdvantageSpec, compute_advantages
from jaxrl_llm.types import Trajectory

from tiny_configs import tiny_config

ARCHITECTURE = pathlib.Path(__file__).resolve().parents[1] / "docs" / "architecture.md"


def _doc_blocks():
  return re.findall(r"```python\n(.*?)```", ARCHITECTURE.read_text(), re.S)


def _trajectory(rows, width=6, prompt=2, versions=None):
  """B rows of ``prompt`` prompt tokens and a response of ``width - prompt`` tokens (numpy)."""
  tokens = np.arange(rows * width, dtype=np.int32).reshape(rows, width) % 7 + 3
  prompt_mask = np.zeros((rows, width), bool)
  prompt_mask[:, :prompt] = True
  response = ~prompt_mask
  return Trajectory(tokens_bt=tokens, prompt_mask_bt=prompt_mask, response_mask_bt=response, observation_mask_bt=np.zeros_like(response),
                    behaviour_logp_bt=np.where(response, -0.5, 0.0).astype(np.float32),
                    policy_version_bt=np.full((rows, width), 3 if versions is None else versions, np.int32),
                    group_id_b=np.repeat(np.arange(rows // 2), 2).astype(np.int32), rewards_b=np.zeros(rows, np.float32),
                    finished_b=np.ones(rows, bool))


def test_group_advantages_stage_filters_zero_variance_groups_and_measures_lag():
  rewards = np.array([1.0, 0.0, 0.5, 0.5, 0.0, 1.0, 1.0, 1.0], np.float32)  # groups of 2: two are zero-variance
  traj = _trajectory(8)
  spec = AdvantageSpec(estimator="grpo", group_size=2, filter_zero_variance=True, row_granule=2)
  out = compute_advantages(spec, AdvantageInputs(traj, rewards, learner_version=5))
  batch = out.batch
  expected = A.group_advantages(rewards, 2, estimator="grpo").advantages_b
  # informative groups 0 and 2 come first; the bucket is a power of two of the granule (4 rows)
  assert batch.tokens_bt.shape == (4, 6) and out.metrics["data/rows_trained"] == 4.0
  np.testing.assert_array_equal(np.asarray(batch.tokens_bt), traj.tokens_bt[[0, 1, 4, 5]])
  np.testing.assert_allclose(np.asarray(batch.advantages_bt)[:, -1], np.asarray(expected)[[0, 1, 4, 5]])
  assert out.metrics["data/zero_variance_groups"] == 0.5
  assert out.metrics["data/lag_max"] == 2.0 and out.metrics["data/lag_mean"] == 2.0  # version 5 - sampled at 3
  assert out.metrics["reward/mean"] == pytest.approx(rewards.mean())
  assert np.all(np.asarray(batch.ref_logp_bt) == 0) and out.rewards_bt is None and out.kl_coef is None


def test_gae_advantages_stage_uses_the_critic_and_reports_the_substitution_error():
  rewards = np.array([1.0, 0.0, 1.0, 0.0], np.float32)
  traj = _trajectory(4)
  values = jnp.full(traj.tokens_bt.shape, 0.5, jnp.float32)
  spec = AdvantageSpec(estimator="gae", group_size=2, gamma=1.0, lam=1.0)
  out = compute_advantages(spec, AdvantageInputs(traj, rewards, learner_version=3, old_values_bt=values))
  # lambda = 1: A_t = R - V_t = r - 0.5 on every response token, returns = r
  response = traj.response_mask_bt
  np.testing.assert_allclose(np.asarray(out.batch.advantages_bt)[response], np.repeat(rewards - 0.5, 4))
  np.testing.assert_allclose(np.asarray(out.batch.returns_bt)[response], np.repeat(rewards, 4))
  assert out.metrics["offpolicy/adv_substitution_mse"] == pytest.approx(0.25)
  assert out.metrics["data/lag_max"] == 0.0 and out.rewards_bt is not None


def test_hook_runs_when_due_and_its_state_is_checkpointed(tmp_path):
  namespace = {}
  exec(compile(_doc_blocks()[2], str(ARCHITECTURE), "exec"), namespace)  # the worked example's hook
  best_reward = namespace["BestReward"]
  config = tiny_config(tmp_path, sft__steps=0, rl__steps=2, export__hf=False, eval__every=100)
  job = jobs.RLJob(config)
  hook = best_reward()
  job.add_hook(hook)
  summary = job.train()
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  best = [r["reward/best"] for r in records if "reward/best" in r]
  assert len(best) == 2 and best[1] == max(r["reward/mean"] for r in records if "reward/mean" in r)
  assert summary["rl_steps"] == 2
  resumed = jobs.RLJob(tiny_config(tmp_path, sft__steps=0, rl__steps=2, export__hf=False, eval__every=100))
  again = best_reward()
  resumed.add_hook(again)  # registered after construction: restored on the next resume
  assert resumed.progress.components["best_reward"] == {"best": hook.best}
  with pytest.raises(ValueError, match="registered twice"):
    resumed.add_hook(best_reward())
  resumed.close()


def test_every_job_stops_on_the_same_nonfinite_error(tmp_path):
  from tiny_configs import tiny_rm_config
  import jax
  for job in (jobs.RLJob(tiny_config(tmp_path / "rl", learner__max_nonfinite_in_a_row=1, sft__steps=2)),
              jobs.make_job(tiny_rm_config(tmp_path / "rm", learner__max_nonfinite_in_a_row=1, sft__steps=2,
                                           sft__batch_size=8))):
    job.set_train_state(job.train_state.replace(params=jax.tree.map(lambda x: x * jnp.nan, job.train_state.params)))
    with pytest.raises(jobs.NonFiniteError, match="1 consecutive updates had a non-finite"):
      job.run_warm_start(_NullWriter(), job.sft_step)
    job.close()
  with pytest.raises(Exception, match="job='ranking'"):
    jobs.make_job(tiny_config(tmp_path / "x", job="ranking"))


class _NullWriter:
  def write(self, step, metrics):
    return metrics


def test_a_healthy_run_with_the_zero_variance_filter_logs_no_warning(tmp_path, caplog):
  """The filter dropping solved groups is a metric, not an alert: a run where most groups
  are zero-variance (an untrained model on exact rewards) prints nothing."""
  config = tiny_config(tmp_path, sft__steps=0, rl__steps=3, rl__filter_zero_variance=True, export__hf=False,
                       eval__every=100, checkpoint__every=100)
  with caplog.at_level(logging.WARNING, logger="jaxrl_llm"):
    summary = jobs.run(config)
  records = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  rates = [r["data/filter_rate"] for r in records if "data/filter_rate" in r]
  assert len(rates) == 3 and max(rates) > 0.5  # most groups were filtered ...
  assert [r.getMessage() for r in caplog.records if r.name == "jaxrl_llm"] == []  # ... and nothing was printed
  assert summary["alerts"] == {}


def test_worked_examples_of_the_architecture_page_run():
  blocks = _doc_blocks()
  assert len(blocks) == 3, "docs/architecture.md: a recipe parameter, a task and a hook"
  try:
    for block in blocks:
      exec(compile(block, str(ARCHITECTURE), "exec"), {})  # each block asserts its own results
  finally:  # the task example registers "reverse": other tests (docs/config.md) see the built-in tasks only
    if "reverse" in tasks.list_tasks():
      tasks.unregister_task("reverse")
