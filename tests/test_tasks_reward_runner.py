"""Guarded reward execution: failures, timeouts, NaN/inf, counters, process isolation."""

import logging
import math
import time

import numpy as np
import pytest

from jaxrl_llm.tasks import Example, RewardRunner, get_task

EX = Example(prompt="1+1=", answer="2")
LOGGER = "jaxrl_llm.tasks.reward_runner"


def flaky(example, response):
  """Module-level (picklable) reward whose behaviour is chosen by the response text."""
  if response.startswith("sleep"):
    time.sleep(float(response[5:]))
  if response == "boom":
    raise ValueError("boom from the reward")
  if response == "nan":
    return math.nan
  if response == "inf":
    return -math.inf
  if response == "text":
    return "not a number"
  return float(response == example.answer)


def _pairs(*responses):
  return [(EX, r) for r in responses]


@pytest.mark.parametrize("mode", ["thread", "inline"])
def test_exception_counted_logged_once_and_run_continues(mode, caplog):
  runner = RewardRunner(flaky, timeout_s=5.0, name="flaky", mode=mode)
  with caplog.at_level(logging.DEBUG, logger=LOGGER):
    r1 = runner.score(_pairs("2", "boom", "3", "text"))
    r2 = runner.score(_pairs("boom", "2"))
  np.testing.assert_array_equal(r1, np.array([1, 0, 0, 0], np.float32))
  np.testing.assert_array_equal(r2, np.array([0, 1], np.float32))
  assert r1.dtype == np.float32
  m = runner.metrics
  assert m["reward/flaky/failures"] == 3 and m["reward/flaky/calls"] == 6
  assert m["reward/flaky/timeouts"] == 0
  errors = [r for r in caplog.records if r.levelno == logging.ERROR]
  assert len(errors) == 1  # the FIRST traceback only
  assert "ValueError: boom from the reward" in errors[0].getMessage()
  assert "Traceback" in errors[0].getMessage()


@pytest.mark.parametrize("mode", ["thread", "inline"])
def test_nonfinite_replaced_and_counted(mode, caplog):
  runner = RewardRunner(flaky, timeout_s=5.0, name="nf", mode=mode)
  with caplog.at_level(logging.WARNING, logger=LOGGER):
    rewards = runner.score(_pairs("nan", "2", "inf"))
  np.testing.assert_array_equal(rewards, np.array([0, 1, 0], np.float32))
  assert runner.metrics["reward/nf/nonfinite"] == 2
  assert runner.metrics["reward/nf/failures"] == 0
  assert any("non-finite" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_thread_timeout_is_per_call_and_run_continues(caplog):
  runner = RewardRunner(flaky, timeout_s=0.2, name="slow")
  started = time.monotonic()
  with caplog.at_level(logging.WARNING, logger=LOGGER):
    rewards = runner.score(_pairs("2", "sleep1.0", "2", "sleep0.05", "2"))
  elapsed = time.monotonic() - started
  np.testing.assert_array_equal(rewards, np.array([1, 0, 1, 0, 1], np.float32))
  # The hung call is abandoned at its deadline, not waited for.
  assert elapsed < 0.9, elapsed
  m = runner.metrics
  assert m["reward/slow/timeouts"] == 1 and m["reward/slow/failures"] == 0
  assert m["reward/slow/worker_restarts"] == 1
  assert any("timed out" in r.getMessage() for r in caplog.records)


def test_inline_timeout_detected_after_the_call():
  runner = RewardRunner(flaky, timeout_s=0.2, name="inl", mode="inline")
  rewards = runner.score(_pairs("sleep0.3", "2"))
  np.testing.assert_array_equal(rewards, np.array([0, 1], np.float32))
  assert runner.metrics["reward/inl/timeouts"] == 1


def test_process_mode_kills_hung_call_and_restarts():
  with RewardRunner(flaky, timeout_s=0.2, name="proc", mode="process") as runner:
    started = time.monotonic()
    rewards = runner.score(_pairs("2", "sleep30", "boom", "nan", "2"))
    np.testing.assert_array_equal(rewards, np.array([1, 0, 0, 0, 1], np.float32))
    m = runner.metrics
    counts = [m[f"reward/proc/{k}"] for k in ("timeouts", "failures", "nonfinite")]
    assert counts == [1, 1, 1]
    assert m["reward/proc/worker_restarts"] == 1
    assert time.monotonic() - started < 25  # the 30 s call was killed
    task = get_task("addition")
    task_runner = RewardRunner(task.reward, timeout_s=5.0, mode="process", name="task")
    ex = task.make_example(23, 58)
    with task_runner:
      np.testing.assert_array_equal(task_runner.score([(ex, "81"), (ex, "80")]), [1, 0])


def test_thread_mode_escalates_to_process_when_threads_hang():
  runner = RewardRunner(flaky, timeout_s=0.1, name="esc", max_hung_threads=1)
  with runner:
    rewards = runner.score(_pairs("sleep0.5", "2", "sleep30", "2"))
    np.testing.assert_array_equal(rewards, np.array([0, 1, 0, 1], np.float32))
    assert runner.mode == "process"
    assert runner.metrics["reward/esc/timeouts"] == 2


def test_many_cheap_calls_are_fast():
  task = get_task("addition")
  ex = task.make_example(23, 58)
  runner = RewardRunner(task.reward, timeout_s=1.0, name="fast")
  started = time.monotonic()
  rewards = runner.score([(ex, "81")] * 20_000)
  assert time.monotonic() - started < 5.0
  assert rewards.shape == (20_000,) and rewards.sum() == 20_000


def test_bad_arguments():
  with pytest.raises(ValueError, match="timeout_s"):
    RewardRunner(flaky, timeout_s=0)
  with pytest.raises(ValueError, match="mode"):
    RewardRunner(flaky, mode="fork")
  with pytest.raises(TypeError, match="callable"):
    RewardRunner(42)
  with pytest.raises(TypeError, match="picklable"):
    RewardRunner(lambda e, r: 1.0, mode="process")
  with pytest.raises(ValueError, match=r"pairs\[1\]"):
    RewardRunner(flaky).score([(EX, "2"), "2"])
