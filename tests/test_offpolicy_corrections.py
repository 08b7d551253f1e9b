"""Off-policy corrections reach a run: config errors, simulated lag, the stale consistency check,
demonstration mixing and the global advantage normaliser."""

import json

import jax
import ml_collections
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxrl_llm import configuration as C, jobs, models
from jaxrl_llm.jobs.advantages import AdvantageSpec, normalize
from jaxrl_llm.jobs.stale_check import StaleConsistencyCheck, own_version_rows
from jaxrl_llm.learner.rl_step import RLBatch
from jaxrl_llm.diagnostics import offpolicy
from jaxrl_llm.rollout.lagged import ParamsWindow
from tiny_configs import tiny_config


def _errors(config) -> str:
  with pytest.raises(C.ConfigError) as e:
    C.validate(config)
  return str(e.value)


def test_invalid_corrections_and_paths_name_the_field(tmp_path):
  c = tiny_config(tmp_path)
  c.objective.corrections = (("truncated_is", {"cap": 2.0}), ("bogus", {}), ("masked_is", {"lo": 0.5, "zz": 1}),
                             ("segment_is", {}), ("truncated_is", {"cap": -1.0}),
                             ("staleness_filter", {"max_lag": 2}))
  text = _errors(c)
  assert "objective.corrections[1]: unknown correction 'bogus'" in text
  assert "objective.corrections[2].zz=1: not a parameter of correction 'masked_is'" in text
  assert "objective.corrections[3]: correction 'segment_is' needs segment_len" in text
  assert "objective.corrections[4]=" in text and "cap must be > 0" in text
  assert "objective.corrections[5]: staleness_filter(max_lag=...) filters on version lags" in text
  assert "objective.corrections[0]" not in text

  c = tiny_config(tmp_path, objective__proximal="behaviour", objective__recipe="decoupled_ppo")
  c.objective.kwargs = ml_collections.ConfigDict({})
  c.objective.corrections = (("truncated_is", {"cap": 2.0}),)
  text = _errors(c)
  assert "objective.recipe='decoupled_ppo' with objective.proximal='behaviour'" in text
  assert "objective.corrections[0]: correction 'truncated_is' reads rho_k = pi_k / mu" in text

  text = _errors(tiny_config(tmp_path, rollout__mode="pipeline", rollout__simulated_lag=2))
  assert "rollout.simulated_lag=2 with rollout.mode='pipeline'" in text
  text = _errors(tiny_config(tmp_path, data__sft_mix="task", data__sft_mix_rows=3))
  assert "data.sft_mix_rows=3: expected a multiple of 2" in text
  text = _errors(tiny_config(tmp_path, data__sft_mix=str(tmp_path / "missing.jsonl")))
  assert "data.sft_mix=" in text and "existing JSONL file" in text
  c = tiny_config(tmp_path)
  c.objective.corrections = (("truncated_is",),)
  assert "expected a sequence of (name, {argument: value}) pairs" in _errors(c)
  # with stale data the lag filter is accepted
  c = tiny_config(tmp_path, rollout__simulated_lag=2)
  c.objective.corrections = (("staleness_filter", {"max_lag": 2}),)
  C.validate(c)


def test_simulated_lag_run_trains_on_stale_data_with_corrections_and_demonstrations(tmp_path):
  c = tiny_config(tmp_path, rl__steps=4, learner__mesh__data=1, objective__recipe="decoupled_ppo",
                  rollout__simulated_lag=2, data__sft_mix="task", data__sft_mix_rows=2, checkpoint__every=100,
                  eval__every=4, advantage__normalization="global")  # global: the job's mesh axis reaches it
  c.objective.kwargs = ml_collections.ConfigDict({})
  c.objective.corrections = (("truncated_is", {"cap": 2.0}), ("staleness_filter", {"max_lag": 1}))
  jobs.run(C.validate(c))
  rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
  rl = [r for r in rows if r["step"] >= 1 and "data/lag_max" in r]
  assert [r["data/lag_max"] for r in rl] == [0, 1, 2, 2]  # the lag ramps up to k and stays
  # the first step is fresh (lag-0 tokens checked), then stale rows are re-scored with their own version
  assert [r["consistency/source"] for r in rl] == [0, 1, 1, 1]
  assert all(r["consistency/kl_k3"] < 1e-6 and r["consistency/unchecked_steps"] == 0 for r in rl)
  # pi_k != mu once stale: the decoupled weight pi_k / mu moves off 1; the lag filter drops lag-2 tokens
  assert rl[0]["decoupled/prox_weight_max"] == pytest.approx(1.0, abs=1e-5)
  assert max(abs(r["decoupled/prox_weight_max"] - 1) for r in rl[1:]) > 1e-3
  assert rl[1]["staleness_filter/stale_share"] == 0 and rl[2]["staleness_filter/stale_share"] > 0
  # demonstrations: 2 rows of the 6 carry the SFT loss
  assert all(r["data/rows"] == 6 and r["sft_loss/token_share"] > 0 and np.isfinite(r["sft_loss/nll_mean"])
             for r in rl)


CONFIG = models.tiny("qwen2", vocab_size=24, hidden_size=32, intermediate_size=64, num_layers=1,
                     max_position_embeddings=16)


def _stale_batch(params, lag: int, shift: float, mixed: bool = False) -> RLBatch:
  rng = np.random.default_rng(0)
  b, t = 4, 8
  tokens = rng.integers(3, 24, (b, t)).astype(np.int32)
  seq = np.ones((b, t), bool)
  response = np.arange(t)[None].repeat(b, 0) >= 3
  behaviour = np.asarray(models.sequence_logprobs(params, CONFIG, tokens, seq, 1.0)) + shift
  zeros = np.zeros((b, t), np.float32)
  lags = np.where(response, lag, 0)
  if mixed:  # weights changed mid-response (segmented generation): no single version to re-score with
    lags[:, -1] = lag - 1
  return RLBatch(tokens, seq, response, np.where(response, behaviour, 0.0), zeros, zeros, lags, zeros, zeros)


def test_stale_check_catches_a_broken_sampler_without_lag0_tokens_and_alerts_when_it_cannot_run():
  old = models.init_params(CONFIG, jax.random.PRNGKey(1))
  window = ParamsWindow(3)
  window.push(5, old)
  window.push(6, models.init_params(CONFIG, jax.random.PRNGKey(2)))
  logp = jax.jit(lambda p, t, m: models.sequence_logprobs(p, CONFIG, t, m, 1.0))
  check = StaleConsistencyCheck(window, logp, offpolicy.ConsistencyThresholds(), max_rows=2, max_unchecked=3)

  def run(batch):
    metrics, _ = offpolicy.StepDiagnostics().before_update(np.zeros(batch.tokens_bt.shape, np.float32),
                                                           batch.behaviour_logp_bt, batch.response_mask_bt,
                                                           batch.lag_bt)
    assert np.isnan(metrics["consistency/kl_k3"])  # no lag-0 token: the plain check has nothing
    alerts = check(metrics, batch, np.asarray(batch.response_mask_bt), np.asarray(batch.lag_bt), 7)
    return metrics, [a.name for a in alerts]

  healthy, alerts = run(_stale_batch(old, lag=2, shift=0.0))  # sampled by version 5, re-scored with it
  assert healthy["consistency/source"] == 1 and healthy["consistency/tokens"] == 2 * 5
  assert healthy["consistency/kl_k3"] < 1e-6 and alerts == []
  broken, alerts = run(_stale_batch(old, lag=2, shift=-0.3))  # a sampler off by 0.3 nats per token
  assert broken["consistency/abs_log_ratio_mean"] == pytest.approx(0.3, rel=1e-4)
  assert "consistency_abs_log_ratio_mean" in alerts
  for steps in (1, 2, 3):  # every row mixes versions 5 and 6: nothing to re-score
    missing, alerts = run(_stale_batch(old, lag=2, shift=0.0, mixed=True))
    assert np.isnan(missing["consistency/source"]) and missing["consistency/unchecked_steps"] == steps
    assert ("consistency_unchecked_steps" in alerts) == (steps >= 3)
  # data sampled before the window began (version 3: restored by a resume) is not a gap
  before, alerts = run(_stale_batch(old, lag=4, shift=0.0))
  assert np.isnan(before["consistency/source"]) and before["consistency/unchecked_steps"] == 3
  run(_stale_batch(old, lag=2, shift=0.0))
  assert check.get_state() == {"unchecked": 0}


def test_own_version_rows_skips_mixed_rows_and_respects_the_budget():
  lag = np.array([[0, 2, 2], [0, 1, 1], [0, 1, 2], [0, 2, 2]])
  mask = np.array([[0, 1, 1], [0, 1, 1], [0, 1, 1], [0, 1, 1]], bool)
  rows = own_version_rows(lag, mask, 10, lambda v: v in (8, 9), max_rows=2)
  assert {v: r.tolist() for v, r in rows.items()} == {8: [0], 9: [1]}
  rows = own_version_rows(lag, mask, 10, lambda v: v == 8, max_rows=5)
  assert {v: r.tolist() for v, r in rows.items()} == {8: [0, 3]}


def test_sft_mix_jsonl_rows_are_checked(tmp_path):
  from jaxrl_llm.jobs.demonstrations import DemonstrationStream

  path = tmp_path / "demos.jsonl"
  path.write_text('{"prompt": "1+1=", "response": "2"}\n{"prompt": "2+2="}\n')
  with pytest.raises(ValueError, match=r"demos.jsonl:2: data.sft_mix rows need a string 'response'"):
    DemonstrationStream(str(path), None, 0, list, list)
  path.write_text('{"prompt": "1+1=", "response": "2"}\n')
  stream = DemonstrationStream(str(path), None, 0, lambda s: [ord(ch) for ch in s], lambda s: [ord(ch) for ch in s])
  assert stream.next_pairs(2) == [([49, 43, 49, 61], [50])] * 2 and stream.get_state() == {"position": 2}


@pytest.mark.parametrize("devices", [1, 8])
def test_global_normalisation_runs_on_any_mesh_and_equals_the_batch_statistics(devices):
  rng = np.random.default_rng(0)
  adv = rng.normal(size=(16, 5)).astype(np.float32)
  mask = rng.random((16, 5)) > 0.3
  mesh = Mesh(np.array(jax.devices()[:devices]).reshape(devices, 1, 1), ("data", "fsdp", "tensor"))
  for level, shift in (("token", True), ("sequence", False)):
    spec = dict(group_size=4, mesh=mesh, norm_level=level, norm_shift_mean=shift)
    g = normalize(AdvantageSpec("grpo", "global", **spec), adv, mask)
    b = normalize(AdvantageSpec("grpo", "batch", **spec), adv, mask)
    np.testing.assert_allclose(np.asarray(g), np.asarray(b), rtol=1e-6, atol=1e-7)
  with pytest.raises(ValueError, match="do not split over the mesh"):
    if devices == 1:
      raise ValueError("do not split over the mesh")  # one shard divides every batch
    normalize(AdvantageSpec("grpo", "global", group_size=4, mesh=mesh), adv[:12], mask[:12])


def test_scalerl_config_runs_the_scalerl_normalisation():
  import sys, os
  sys.path.insert(0, os.getcwd())
  from configs import cispo_scalerl

  c = cispo_scalerl.get_config()
  assert (c.advantage.normalization, c.advantage.norm_level, c.advantage.norm_shift_mean) == ("batch", "sequence",
                                                                                              False)
  C.validate(c)
