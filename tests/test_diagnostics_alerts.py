"""Alerts and the AlertReporter: first occurrence with its cause, rate-limited repeats, counts that
survive a resume. Deterministic: everything is a function of the (step, alerts) calls."""

import json
import math
import pickle

import pytest

from jaxrl_llm.diagnostics import Alert, AlertReporter, alert_if

KL = Alert("consistency_kl_k3", "consistency/kl_k3", 0.0042, 1e-3, ">", "sampler and learner disagree")
ESS = Alert("consistency_ess_rate", "consistency/ess_rate", 0.3, 0.5, "<")


def run(reporter, schedule, start=0, stop=None):
  """Feeds ``schedule[step]`` (a list of alerts) for steps [start, stop); returns {step: lines}."""
  stop = len(schedule) if stop is None else stop
  return {step: lines for step in range(start, stop) if (lines := reporter.report(step, schedule[step]))}


def test_alert_is_its_message_and_carries_its_fields():
  assert KL == "consistency/kl_k3 = 0.0042 > maximum 0.001 (sampler and learner disagree)"
  assert (KL.name, KL.metric, KL.value, KL.threshold, KL.relation) == (
      "consistency_kl_k3", "consistency/kl_k3", 0.0042, 1e-3, ">")
  assert ESS.message == "consistency/ess_rate = 0.3 < minimum 0.5"
  back = pickle.loads(pickle.dumps(KL))
  assert back == KL and back.hint == KL.hint and json.dumps([KL]) == json.dumps([str(KL)])
  with pytest.raises(ValueError, match="relation must be"):
    Alert("x", "x", 1.0, 0.0, ">=")


def test_alert_if_is_strict_and_ignores_nan_and_disabled_limits():
  assert alert_if({"m/x": 2.0}, "m/x", 1.0, ">", "why")[0].name == "m_x"
  assert alert_if({"m/x": 1.0}, "m/x", 1.0, ">") == []
  assert alert_if({"m/x": 0.5}, "m/x", 1.0, "<")[0].relation == "<"
  assert alert_if({"m/x": math.nan}, "m/x", 1.0, ">") == []
  assert alert_if({"m/x": 9.0}, "m/x", None, ">") == []


def test_first_occurrence_names_metric_value_threshold_and_cause():
  reporter = AlertReporter(every=50)
  assert reporter.report(0, []) == []
  (line,) = reporter.report(3, [KL])
  assert line == ("step 3: alert consistency_kl_k3: consistency/kl_k3 = 0.0042 > maximum 0.001; "
                  "likely cause: sampler and learner disagree; see docs/off_policy.md (Troubleshooting)")
  (line,) = reporter.report(4, [ESS])  # a new alert is reported at once; one without a hint says so
  assert line.startswith("step 4: alert consistency_ess_rate: consistency/ess_rate = 0.3 < minimum 0.5; see ")
  assert reporter.counts == {"consistency_kl_k3": 1, "consistency_ess_rate": 1}


def test_repeats_are_counted_and_summarised_once_every_n_steps():
  reporter = AlertReporter(every=50)
  schedule = [[KL] for _ in range(120)]
  lines = run(reporter, schedule)
  assert sorted(lines) == [0, 50, 100]
  assert lines[50] == ["step 50: alert consistency_kl_k3 raised 50 more times since step 1 (51 in all; "
                       "last: consistency/kl_k3 = 0.0042 > maximum 0.001)"]
  assert lines[100][0].startswith("step 100: alert consistency_kl_k3 raised 50 more times since step 51 (101 in all")
  assert reporter.flush(119) == ["step 119: alert consistency_kl_k3 raised 19 more times since step 101 "
                                 "(120 in all; last: consistency/kl_k3 = 0.0042 > maximum 0.001)"]
  assert reporter.flush(119) == [] and reporter.counts == {"consistency_kl_k3": 120}
  assert reporter.metrics() == {"alerts/consistency_kl_k3": 120.0, "alerts/total": 120.0}


def test_summary_falls_due_when_the_alert_has_stopped_and_names_are_independent():
  reporter = AlertReporter(every=10)
  schedule = [[] for _ in range(40)]
  for step in (2, 5, 6):
    schedule[step] = [KL]
  for step in (7, 30):
    schedule[step] = [ESS]
  lines = run(reporter, schedule)
  assert {s: len(v) for s, v in lines.items()} == {2: 1, 7: 1, 12: 1, 30: 1}
  assert lines[12] == ["step 12: alert consistency_kl_k3 raised 2 more times since step 5 (3 in all; "
                       "last: consistency/kl_k3 = 0.0042 > maximum 0.001)"]
  assert lines[30][0].startswith("step 30: alert consistency_ess_rate raised 1 more time since step 30")
  assert reporter.metrics() == {"alerts/consistency_ess_rate": 2.0, "alerts/consistency_kl_k3": 3.0,
                                "alerts/total": 5.0}


def test_state_survives_a_resume():
  schedule = [[KL] if step % 3 else [KL, ESS] for step in range(100)]
  whole = AlertReporter(every=25)
  want = run(whole, schedule)
  first = AlertReporter(every=25)
  got = run(first, schedule, stop=40)
  resumed = AlertReporter(every=25)
  resumed.load_state_dict(json.loads(json.dumps(first.state_dict())))
  got.update(run(resumed, schedule, start=40))
  assert got == want and resumed.counts == whole.counts
  assert resumed.flush(99) == whole.flush(99)


def test_bare_counts_resume_reports_the_next_occurrence_with_its_cause():
  reporter = AlertReporter(every=50)
  reporter.load_state_dict({"counts": {"consistency_kl_k3": 7}})
  (line,) = reporter.report(10, [KL])
  assert line.startswith("step 10: alert consistency_kl_k3: ") and "likely cause" in line
  assert reporter.counts == {"consistency_kl_k3": 8}


@pytest.mark.parametrize("state", [
    None, {}, {"counts": {"x": -1}}, {"counts": {"x": True}}, {"counts": {}, "last_line": {"x": "a"}},
    {"counts": {"x": 2}, "last_line": {}, "pending": {"x": {"times": 1, "since": 3, "last": ""}}},
    {"counts": {"x": 2}, "last_line": {"x": 1}, "pending": {"x": {"times": 1}}},
])
def test_bad_state_raises_and_changes_nothing(state):
  reporter = AlertReporter()
  reporter.report(0, [KL])
  with pytest.raises(ValueError, match="load_state_dict"):
    reporter.load_state_dict(state)
  assert reporter.counts == {"consistency_kl_k3": 1}


@pytest.mark.parametrize("every", [0, -1, 2.5, True])
def test_bad_interval_raises(every):
  with pytest.raises(ValueError, match="every must be an int >= 1"):
    AlertReporter(every=every)
