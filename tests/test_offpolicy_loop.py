"""Off-policy control in the RL job: consistency check and skip, staleness on a real model,
the controller acting and surviving a resume, the improvement guard's rollback,
curation (no zero-advantage group trained), and the consistency-check command.

The tests drive the job through its public stages: ``job.start_source().collect(t)``
(collect), ``job.prepare(rollout)`` (score + advantages), ``job.learn(batch, metrics)``
(update), and the hooks."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import objectives as O
from jaxrl_llm import jobs
from jaxrl_llm.diagnostics import control, offpolicy, writers
from jaxrl_llm.jobs import consistency
from jaxrl_llm.learner import optim
from jaxrl_llm.tasks import PromptSource

from tiny_configs import tiny_config


def _run(tmp_path, **overrides):
  overrides = {"sft__steps": 0, "rl__prompts_per_step": 4, "rl__samples_per_prompt": 4, **overrides}
  config = tiny_config(tmp_path, **overrides)
  with config.task.kwargs.unlocked():
    config.task.kwargs.partial_credit = 0.5  # rewards that vary within groups even for an untrained model
  return jobs.RLJob(config)


def _collect(run):
  """Stages 1-3 of the job's next step: the batch it would train on and its data metrics."""
  return run.prepare(run.start_source().collect(run.progress.step))


def _learn(run, batch, data):
  metrics = run.learn(batch, data)
  run.progress.step += 1
  return metrics


def _run_rl(run):
  run.progress.phase = "rl"
  return run.train()


def _leaves_equal(a, b):
  return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


@pytest.mark.parametrize("action", ["skip", "warn"])
def test_inconsistent_behaviour_logp_raises_alert_and_skip_discards_update(tmp_path, action):
  run = _run(tmp_path, diagnostics__consistency_action=action)
  batch, data = _collect(run)
  # A sampler that disagrees with the learner: behaviour log-probabilities off by 0.5 nats.
  batch = batch.replace(behaviour_logp_bt=jnp.where(batch.response_mask_bt, batch.behaviour_logp_bt - 0.5, 0.0))
  before = run.state
  metrics = _learn(run, batch, data)
  assert metrics["consistency/kl_k3"] > 0.05 and metrics["alerts/total"] >= 1
  assert any(k.startswith("alerts/consistency") for k in metrics)
  same = _leaves_equal(run.params, before.train.params)
  assert same == (action == "skip")
  assert metrics["consistency/update_skipped"] == float(action == "skip")
  assert int(run.state.train.policy_version) == int(before.train.policy_version) + (action == "warn")
  run.save(force=True)
  assert run.progress.components["alerts"]["counts"]  # counted in the checkpointed progress


def test_staleness_and_ratio_spread_grow_with_version_lag(tmp_path):
  """Data sampled by the policy k versions old: S_k and the ratio statistics grow with k."""
  run = _run(tmp_path, optimizer__lr=3e-3, rl__samples_per_prompt=8, rl__prompts_per_step=8)
  versions = [run.params]
  for _ in range(8):
    batch, data = _collect(run)
    _learn(run, batch, data)
    versions.append(run.params)
  current = int(run.state.train.policy_version)
  assert current == 8
  prompts = [run.encode_prompt(e.prompt) for e in PromptSource(run.task, 16, seed=99).next_batch().examples]
  stats = {}
  for k in (0, 1, 2, 4, 8):
    run.sampler.update_weights(versions[current - k], current - k)
    traj = run.sampler.generate(prompts, rng=jax.random.PRNGKey(7)).trajectory
    mask = np.asarray(traj.response_mask_bt)
    seq = np.asarray(traj.prompt_mask_bt) | mask
    logp = np.asarray(run.policy_logp(run.params, traj.tokens_bt, seq))
    lag = np.where(mask, current - np.asarray(traj.policy_version_bt), 0)
    assert set(np.unique(lag[mask])) == {k}
    s = offpolicy.staleness(logp, np.asarray(traj.behaviour_logp_bt), lag, mask)
    s.update(offpolicy.consistency_stats(logp, np.asarray(traj.behaviour_logp_bt), mask))
    stats[k] = s
  tv = [stats[k]["offpolicy/staleness_tv"] for k in (0, 1, 2, 4, 8)]
  k3 = [stats[k]["consistency/kl_k3"] for k in (0, 1, 2, 4, 8)]
  spread = [stats[k]["consistency/ratio_max"] / stats[k]["consistency/ratio_min"] for k in (0, 1, 2, 4, 8)]
  assert tv[0] < 1e-5 and k3[0] < 1e-9
  assert all(a < b for a, b in zip(tv, tv[1:])), tv
  assert all(a < b for a, b in zip(k3, k3[1:])), k3
  assert spread[-1] > spread[1] > spread[0]


def test_controller_tightens_clip_and_its_state_is_restored(tmp_path):
  run = _run(tmp_path, control__enabled=True, control__drift_target=1e-6, control__tighten=0.5,
             control__min_clip_scale=0.1, rl__steps=3, checkpoint__every=1)
  assert O.get_control(run.state.objective, control.CLIP_KEY) == 1.0
  _run_rl(run)
  assert run.controller.state.clip_scale == pytest.approx(0.125)  # three steps far above the drift target
  assert O.get_control(run.state.objective, control.CLIP_KEY) == pytest.approx(0.125)
  resumed = _run(tmp_path, control__enabled=True, control__drift_target=1e-6, control__tighten=0.5,
                 control__min_clip_scale=0.1, rl__steps=3, checkpoint__every=1)
  assert resumed.controller.get_state() == run.controller.get_state()
  assert O.get_control(resumed.state.objective, control.CLIP_KEY) == pytest.approx(0.125)
  resumed.close()


def test_zero_variance_filter_and_dynamic_sampling_train_no_zero_advantage_group(tmp_path):
  for dynamic in (False, True):
    run = _run(tmp_path / str(dynamic), rl__filter_zero_variance=True, data__dynamic_sampling=dynamic,
               rl__prompts_per_step=4, rl__samples_per_prompt=4)
    for _ in range(3):
      batch, data = _collect(run)
      adv = np.asarray(batch.advantages_bt).reshape(-1, 4, batch.advantages_bt.shape[1])
      trained = np.asarray(batch.response_mask_bt).reshape(adv.shape).any(axis=(1, 2))
      informative = np.abs(adv).max(axis=(1, 2)) > 0
      assert not np.any(trained & ~informative), "a zero-advantage group reached the loss"
      if dynamic and data["data/dynamic_padded_groups"] == 0:
        assert informative.all() and adv.shape[0] == 4  # the batch keeps its size, every group informative
      _learn(run, batch, data)
    run.close()


def test_guard_rolls_back_a_harmful_update_and_training_recovers(tmp_path):
  """A learning rate x10000 for one update wrecks the policy; the guard restores the last
  good version (parameters, optimizer and objective state), halves the learning-rate
  scale, and the next checks accept again."""
  config = tiny_config(tmp_path, task__name="sorting", sft__steps=100, sft__batch_size=32, sft__lr=1e-2,
                       model__hidden_size=64, model__intermediate_size=128, task__eval_size=16,
                       guard__enabled=True, guard__every=1, guard__eval_size=16, checkpoint__every=1000,
                       guard__z=1.0, rl__prompts_per_step=8, rl__samples_per_prompt=4, optimizer__lr=1e-4)
  with config.task.unlocked():
    config.task.kwargs = type(config.task.kwargs)({"min_length": 2, "max_length": 2, "eval_fraction": 0.3,
                                                    "partial_credit": 0.5})
  run = jobs.RLJob(config)
  run.run_warm_start(writers.MetricsWriter(str(tmp_path), 1, progress=False, tensorboard=False), run.sft_step)
  guard = run.guard_hook
  start = guard(run, 0, {})
  assert start["guard/accuracy"] >= 0.5, "the warm start must be good enough to regress from"
  good = jax.tree.map(np.asarray, run.state.good)

  def rl_step():
    batch, data = _collect(run)
    _learn(run, batch, data)
    assert guard.due(run.progress.step)  # guard.every=1
    return guard(run, run.progress.step, data)

  train = run.state.train
  run.state = run.state.replace(train=train.replace(opt_state=optim.set_lr_scale(train.opt_state, 1e4)))
  version_before = int(run.state.train.policy_version)
  harmed = rl_step()
  assert harmed["guard/rolled_back"] == 1.0 and harmed["guard/rollbacks"] == 1.0
  assert harmed["guard/accuracy"] < start["guard/accuracy"] - 0.2
  assert _leaves_equal(run.state.train.params, good[0].params)  # the good version is back
  assert _leaves_equal(run.state.train.opt_state, optim.set_lr_scale(good[0].opt_state, 0.5))
  assert optim.get_lr_scale(run.state.train.opt_state) == 0.5  # 1.0 (restored) x guard.lr_shrink
  assert int(run.state.train.policy_version) > version_before  # versions stay monotone for samplers
  for _ in range(3):
    after = rl_step()
    assert after["guard/rolled_back"] == 0.0
    assert after["guard/accuracy"] >= start["guard/accuracy"] - 0.2
  assert guard.guard.state.rollbacks_in_a_row == 0
  run.close()


def test_on_policy_ratios_are_exactly_one_in_the_loop_and_from_a_sampler_actor(tmp_path):
  """Batch-invariant mode: the loop's pre-update check sees ratios of exactly 1, and so does
  the consistency check of the restored checkpoint against a Ray sampler actor."""
  kw = dict(model__batch_invariant=True, learner__grad_atoms=4, learner__mesh__data=1, rl__steps=1,
            checkpoint__every=1)
  run = _run(tmp_path, **kw)
  _run_rl(run)
  metrics = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")][-1]
  assert metrics["consistency/ratio_max"] == 1.0 and metrics["consistency/ratio_min"] == 1.0
  assert metrics["consistency/kl_k3"] == 0.0 and metrics["consistency/ess_rate"] == 1.0
  assert metrics["offpolicy/staleness_tv"] == 0.0 and metrics["consistency/update_skipped"] == 0.0
  assert not any(k.startswith("alerts/consistency") for k in metrics)
  assert metrics["offpolicy/drift_tv"] > 0.0  # the update moved the policy
  restored = _run(tmp_path, **kw)
  assert int(restored.state.train.policy_version) == 1
  report = consistency.check(restored, num_prompts=4, sampler="actor")
  assert report["policy_version"] == 1 and report["rows"] == 16 and report["tokens"] > 0
  # the actor's sampler and this process's learner agree bit for bit in batch-invariant mode
  assert report["stats"]["consistency/ratio_min"] == 1.0 == report["stats"]["consistency/ratio_max"]
  assert report["alerts"] == []
  with pytest.raises(ValueError, match="sampler='vllm'"):
    consistency.check(restored, num_prompts=4, sampler="vllm")
  restored.close()


def test_check_consistency_command(tmp_path):
  tiny = ["--config.model.hidden_size=32", "--config.model.intermediate_size=64", "--config.model.num_layers=1",
          "--config.model.num_heads=2", "--config.model.num_kv_heads=1", "--config.task.eval_size=8",
          "--prompts=4", f"--run_dir={tmp_path}"]
  out = subprocess.run([sys.executable, "launch/check_consistency.py", *tiny], capture_output=True, text=True,
                       timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  report = json.loads(out.stdout.strip().splitlines()[-1])
  assert abs(report["stats"]["consistency/ratio_max"] - 1.0) < 1e-4 and report["alerts"] == []
  assert "OK: sampler and learner agree" in out.stdout
  bad = subprocess.run([sys.executable, "launch/check_consistency.py", *tiny, "--config.rl.temperature=-1"],
                       capture_output=True, text=True, timeout=600)
  assert bad.returncode != 0 and "rl.temperature=-1" in bad.stderr


def test_controller_narrows_the_pipeline_staleness_window(tmp_path):
  """What holds for every interleaving of the learner and the sampler actor: the window moves
  by the controller's rule on the staleness each step measured (stale data narrows it one
  version, fresh data widens it one), stays within [0, rollout.max_lag], and once it is
  closed the next step trains on fresh data only (in-flight stale chunks are re-sampled)."""
  run = _run(tmp_path, rollout__mode="pipeline", rollout__num_samplers=1, rollout__max_lag=2, rl__steps=6,
             control__enabled=True, control__staleness_target=1e-6, control__drift_target=1.0,
             optimizer__lr=3e-3, checkpoint__every=1000)
  _run_rl(run)
  records = [r for r in (json.loads(l) for l in open(tmp_path / "metrics.jsonl")) if "control/max_lag" in r]
  assert len(records) == 6
  tolerance = run.controller.settings.tolerance
  window = 2
  for i, r in enumerate(records):
    stale = r["offpolicy/staleness_tv"] > 1e-6 * tolerance
    fresh = r["offpolicy/staleness_tv"] < 1e-6 / tolerance
    expected = max(window - 1, 0) if stale else min(window + 1, 2) if fresh else window
    assert r["control/max_lag"] == expected, (i, records)
    assert (r["data/lag_max"] >= 1) == stale, (i, r["data/lag_max"], r["offpolicy/staleness_tv"])
    if window == 0:
      assert r["data/lag_max"] == 0.0, (i, records)  # the step after the window closed
    window = int(r["control/max_lag"])


def test_gae_path_reports_advantage_substitution_error_and_drift(tmp_path):
  run = _run(tmp_path, objective__recipe="ppo", advantage__estimator="gae", critic__enabled=True,
             advantage__lam=0.95, rl__filter_zero_variance=False)
  batch, data = _collect(run)
  assert np.isfinite(data["offpolicy/adv_substitution_mse"]) and data["offpolicy/adv_substitution_mse"] > 0
  metrics = _learn(run, batch, data)
  assert metrics["offpolicy/adv_drift"] > 0  # the critic moved, so recomputed advantages differ
  assert np.isfinite(metrics["offpolicy/drift_tv"])
