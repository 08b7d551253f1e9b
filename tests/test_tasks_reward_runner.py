"""Guarded reward execution: failures, timeouts, crashes, memory and CPU limits, NaN/inf, counters,
the failure-rate stop. Every test is bounded: a hang would be cut by the runner's timeout, and the
wall-clock assertions only bound a hang (generous against machine load), they never measure speed."""

import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from fractions import Fraction

import numpy as np
import pytest

from jaxrl_llm.tasks import (Example, JsonlTask, RewardFailureError, RewardRunner, WorkerPool, WorkerStartError,
                             get_task)

EX = Example(prompt="1+1=", answer="2")
LOGGER = "jaxrl_llm.tasks.reward_runner"
HANG_BOUND_S = 30.0  # a call cut at a 1 s timeout must be over well within this, whatever the load


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
  if response == "gil":  # 10^(10^11): C code that holds the GIL and never returns
    return float(Fraction("1e99999999999") > 0)
  if response == "segv":
    os.kill(os.getpid(), signal.SIGSEGV)
  if response == "exit":
    os._exit(3)
  if response == "hog":
    return float(len(bytearray(8 << 30)))
  if response == "spin":
    while True:
      pass
  if response == "print":
    print("noise on stdout " * 10_000)
  if response.startswith("index"):
    time.sleep(0.002)
    return float(response[5:])
  return float(response == example.answer)


def pid(example, response):
  del example
  time.sleep(0.01)
  return float(os.getpid()) if response == "pid" else 0.0


def _pairs(*responses):
  return [(EX, r) for r in responses]


@pytest.fixture
def process_runner():
  runners = []

  def make(**kwargs):
    kwargs.setdefault("timeout_s", 5.0)
    runner = RewardRunner(kwargs.pop("fn", flaky), mode="process", **kwargs)
    runners.append(runner)
    return runner

  yield make
  for runner in runners:
    runner.close()


@pytest.mark.parametrize("mode", ["process", "inline"])
def test_exception_counted_logged_once_and_run_continues(mode, caplog):
  with RewardRunner(flaky, timeout_s=5.0, name="flaky", mode=mode) as runner, \
       caplog.at_level(logging.DEBUG, logger=LOGGER):
    r1 = runner.score(_pairs("2", "boom", "3", "text"))
    r2 = runner.score(_pairs("boom", "2"))
  np.testing.assert_array_equal(r1, np.array([1, 0, 0, 0], np.float32))
  np.testing.assert_array_equal(r2, np.array([0, 1], np.float32))
  assert r1.dtype == np.float32
  m = runner.metrics
  assert m["reward/flaky/failures"] == 3 and m["reward/flaky/calls"] == 6
  assert m["reward/flaky/timeouts"] == 0 and m["reward/flaky/crashes"] == 0
  errors = [r for r in caplog.records if r.levelno == logging.ERROR]
  assert len(errors) == 1  # the FIRST traceback only
  assert "ValueError: boom from the reward" in errors[0].getMessage()
  assert "Traceback" in errors[0].getMessage()


@pytest.mark.parametrize("mode", ["process", "inline"])
def test_nonfinite_replaced_and_counted(mode, caplog):
  with RewardRunner(flaky, timeout_s=5.0, name="nf", mode=mode) as runner, \
       caplog.at_level(logging.WARNING, logger=LOGGER):
    rewards = runner.score(_pairs("nan", "2", "inf"))
  np.testing.assert_array_equal(rewards, np.array([0, 1, 0], np.float32))
  assert runner.metrics["reward/nf/nonfinite"] == 2
  assert runner.metrics["reward/nf/failures"] == 0
  assert any("non-finite" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


def test_inline_timeout_detected_after_the_call():
  runner = RewardRunner(flaky, timeout_s=0.2, name="inl", mode="inline")
  rewards = runner.score(_pairs("sleep0.3", "2"))
  np.testing.assert_array_equal(rewards, np.array([0, 1], np.float32))
  assert runner.metrics["reward/inl/timeouts"] == 1


def test_call_holding_the_gil_is_cut_at_the_timeout_and_later_calls_score(process_runner, caplog):
  runner = process_runner(timeout_s=1.0, name="gil")
  runner.score(_pairs("2"))  # workers started: start-up is not what is bounded below
  started = time.monotonic()
  with caplog.at_level(logging.WARNING, logger=LOGGER):
    rewards = runner.score(_pairs("2", "gil", "2", "sleep1000", "2"))
  assert time.monotonic() - started < HANG_BOUND_S
  np.testing.assert_array_equal(rewards, np.array([1, 0, 1, 0, 1], np.float32))
  m = runner.metrics
  assert m["reward/gil/timeouts"] == 2 and m["reward/gil/worker_restarts"] == 2
  assert m["reward/gil/failures"] == 0
  assert any("timed out" in r.getMessage() for r in caplog.records)
  np.testing.assert_array_equal(runner.score(_pairs("2", "3")), [1, 0])  # the replacements work


def test_crashing_worker_is_replaced(process_runner, caplog):
  runner = process_runner(name="crash")
  with caplog.at_level(logging.ERROR, logger=LOGGER):
    rewards = runner.score(_pairs("2", "segv", "2", "exit", "2"))
  np.testing.assert_array_equal(rewards, np.array([1, 0, 1, 0, 1], np.float32))
  m = runner.metrics
  assert m["reward/crash/crashes"] == 2 and m["reward/crash/worker_restarts"] == 2
  assert m["reward/crash/failures"] == 0
  first = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
  assert len(first) == 1 and "SIGSEGV" in first[0]
  # cheap calls are queued in the workers: those queued behind the crash are re-sent, not lost
  rewards = runner.score(_pairs(*["2"] * 100, "exit", *["2"] * 99, "segv", "2"))
  np.testing.assert_array_equal(rewards, [1] * 100 + [0] + [1] * 99 + [0, 1])
  assert runner.metrics["reward/crash/crashes"] == 4


def test_queues_are_deep_for_cheap_calls_and_one_call_for_slow_ones():
  with WorkerPool(flaky, workers=2) as pool:
    assert pool._queue_limit() == 1  # pylint: disable=protected-access  # nothing measured yet
    pool.map([(EX, "2")] * 200, 5.0)
    assert pool._queue_limit() > 1  # pylint: disable=protected-access
    pool.map([(EX, "sleep0.05")] * 30, 5.0)
    assert pool._queue_limit() == 1  # pylint: disable=protected-access


def test_memory_hog_hits_the_memory_limit_and_scores_zero(process_runner):
  runner = process_runner(name="mem", memory_mb=1024)  # a worker needs ~250 MiB of address space
  rewards = runner.score(_pairs("2", "hog", "2"))
  np.testing.assert_array_equal(rewards, np.array([1, 0, 1], np.float32))
  m = runner.metrics
  assert m["reward/mem/memory_errors"] == 1 and m["reward/mem/worker_restarts"] == 1
  assert m["reward/mem/crashes"] == 0 and m["reward/mem/failures"] == 0


def test_cpu_limit_kills_a_spinning_call_even_with_a_long_timeout(process_runner):
  runner = process_runner(name="cpu", timeout_s=600.0, cpu_seconds=1)
  started = time.monotonic()
  rewards = runner.score(_pairs("2", "spin", "2"))
  assert time.monotonic() - started < HANG_BOUND_S
  np.testing.assert_array_equal(rewards, np.array([1, 0, 1], np.float32))
  assert runner.metrics["reward/cpu/timeouts"] == 1 and runner.metrics["reward/cpu/worker_restarts"] == 1


def test_batch_is_spread_over_workers_and_keeps_input_order(process_runner):
  runner = process_runner(name="order", workers=3)
  responses = [f"index{j}" for j in range(60)]
  np.testing.assert_array_equal(runner.score(_pairs(*responses)), np.arange(60, dtype=np.float32))
  pids = process_runner(fn=pid, name="pids", workers=2)
  deadline = time.monotonic() + HANG_BOUND_S
  workers = pids.pool._workers  # pylint: disable=protected-access
  pids.score(_pairs("pid"))  # starts the workers
  while not all(w.ready for w in workers) and time.monotonic() < deadline:
    pids.score(_pairs("pid"))  # until both have started: then the first dispatch gives each a call
  assert len(set(pids.score(_pairs(*["pid"] * 40)).tolist())) == 2


def test_print_in_the_reward_does_not_corrupt_the_protocol(process_runner):
  runner = process_runner(name="print")
  np.testing.assert_array_equal(runner.score(_pairs("print", "2", "print")), [0, 1, 0])
  assert runner.metrics["reward/print/failures"] == 0


def test_close_stops_the_workers_and_a_later_score_starts_new_ones(process_runner):
  runner = process_runner(name="close")
  runner.score(_pairs("2"))
  procs = [w.proc for w in runner.pool._workers]  # pylint: disable=protected-access
  runner.close()
  assert all(p.poll() is not None for p in procs)
  np.testing.assert_array_equal(runner.score(_pairs("2")), [1])


def _gsm8k_task(tmp_path):
  rows = [json.dumps({"question": f"Tom has {i} apples and buys {i + 1} more. How many?",
                      "answer": f"{i} + {i + 1} = {2 * i + 1}\n#### {2 * i + 1}"}) for i in range(50)]
  path = tmp_path / "gsm.jsonl"
  path.write_text("\n".join(rows) + "\n", encoding="utf-8")
  return JsonlTask(path=str(path))


def test_real_tasks_score_in_worker_processes(tmp_path):
  tasks = [get_task("addition"), get_task("sorting"), get_task("countdown"), _gsm8k_task(tmp_path)]
  for task in tasks:
    examples = [next(task.train_prompts(seed=s)) for s in range(3)]
    pairs = [(e, task.sft_target(e)) for e in examples] + [(e, "no idea") for e in examples]
    with RewardRunner(task.reward, timeout_s=5.0, name="task") as runner:
      np.testing.assert_array_equal(runner.score(pairs), [1, 1, 1, 0, 0, 0], err_msg=type(task).__name__)
      assert runner.metrics["reward/task/failures"] == 0


def test_pathological_math_answers_are_wrong_answers_within_the_timeout(tmp_path):
  task = _gsm8k_task(tmp_path)
  ex = next(task.train_prompts(seed=0))
  answers = ["#### 1e99999999999", "#### 1e400000", "#### " + "7" * 5000, "#### 1e30000000"]
  with RewardRunner(task.reward, timeout_s=5.0, name="math") as runner:
    runner.score([(ex, task.sft_target(ex))])  # workers started
    started = time.monotonic()
    rewards = runner.score([(ex, a) for a in answers] + [(ex, task.sft_target(ex))])
    assert time.monotonic() - started < HANG_BOUND_S
    np.testing.assert_array_equal(rewards, [0, 0, 0, 0, 1])
    m = runner.metrics
    assert (m["reward/math/failures"], m["reward/math/timeouts"], m["reward/math/crashes"]) == (0, 0, 0)


def test_failure_rate_stop_raises_with_the_first_traceback_after_n_steps():
  runner = RewardRunner(flaky, timeout_s=5.0, name="broken", mode="inline", max_failure_share=0.5,
                        failure_steps=3)
  for _ in range(2):
    runner.score(_pairs("boom", "boom", "2"))
    runner.end_step()
  assert runner.metrics["reward/broken/failing_steps"] == 2
  runner.score(_pairs("boom", "nan", "2"))
  with pytest.raises(RewardFailureError) as e:
    runner.end_step()
  message = str(e.value)
  assert "ValueError: boom from the reward" in message and "Traceback" in message
  assert "reward.max_failure_share=0.5" in message and "reward.failure_steps=3" in message
  assert "3 consecutive steps" in message


def test_failure_rate_stop_does_not_trip_at_or_below_the_share_and_a_good_step_resets_it():
  runner = RewardRunner(flaky, timeout_s=5.0, name="some", mode="inline", max_failure_share=0.5,
                        failure_steps=2)
  for _ in range(10):  # exactly half fail: not more than the share
    runner.score(_pairs("boom", "2"))
    runner.end_step()
  for _ in range(5):  # failing, good, failing, ...: never two in a row
    runner.score(_pairs("boom", "boom", "2"))
    runner.end_step()
    runner.score(_pairs("2"))
    runner.end_step()
  runner.end_step()  # a step without calls is not a failing step
  assert runner.metrics["reward/some/failing_steps"] == 0
  never = RewardRunner(flaky, timeout_s=5.0, name="never", mode="inline", max_failure_share=1.0, failure_steps=1)
  never.score(_pairs("boom"))
  never.end_step()


def test_state_round_trip_and_checkpoints_without_the_new_counters():
  runner = RewardRunner(flaky, timeout_s=5.0, name="st", mode="inline", failure_steps=5)
  runner.score(_pairs("boom", "nan", "2"))
  runner.end_step()
  state = json.loads(json.dumps(runner.get_state()))  # saved as JSON with the run's progress
  restored = RewardRunner(flaky, timeout_s=5.0, name="st", mode="inline", failure_steps=5)
  restored.set_state(state)
  assert restored.metrics == runner.metrics and restored.first_error == runner.first_error
  old = {"calls": 7, "failures": 1, "timeouts": 2, "nonfinite": 0, "worker_restarts": 2, "seconds": 0.5}
  older = RewardRunner(flaky, timeout_s=5.0, name="old", mode="inline")
  older.set_state(old)
  assert older.metrics["reward/old/timeouts"] == 2 and older.metrics["reward/old/crashes"] == 0


def test_sharing_runner_uses_the_same_workers_with_its_own_counters(process_runner):
  train = process_runner(name="task")
  evaluation = train.sharing("eval")
  assert evaluation.pool is train.pool
  train.score(_pairs("2", "boom"))
  evaluation.score(_pairs("boom", "boom", "segv"))
  assert train.metrics["reward/task/failures"] == 1
  assert evaluation.metrics["reward/eval/failures"] == 2 and evaluation.metrics["reward/eval/crashes"] == 1
  assert train.metrics["reward/task/worker_restarts"] == 0
  evaluation.close()  # not the owner: the workers keep running
  np.testing.assert_array_equal(train.score(_pairs("2")), [1])


def test_worker_that_cannot_load_the_function_is_a_start_error():
  with RewardRunner(flaky, timeout_s=5.0, name="small", memory_mb=64) as runner:
    with pytest.raises(WorkerStartError, match="reward.memory_mb"):
      runner.score(_pairs("2"))


def test_many_cheap_calls_inline_are_fast():
  task = get_task("addition")
  ex = task.make_example(23, 58)
  # A deadline no call can reach however loaded the machine is: with 1 s, one of the 20,000 calls was once
  # cut (scored 0) on a busy 2-core CI machine. What this test checks is that inline calls are cheap.
  runner = RewardRunner(task.reward, timeout_s=HANG_BOUND_S, name="fast", mode="inline")
  started = time.monotonic()
  rewards = runner.score([(ex, "81")] * 20_000)
  assert time.monotonic() - started < HANG_BOUND_S
  assert rewards.shape == (20_000,) and rewards.sum() == 20_000


def test_bad_arguments():
  with pytest.raises(ValueError, match="timeout_s"):
    RewardRunner(flaky, timeout_s=0)
  with pytest.raises(ValueError, match="timeout_s"):
    RewardRunner(flaky, timeout_s=math.inf)
  with pytest.raises(ValueError, match="mode"):
    RewardRunner(flaky, mode="thread")
  with pytest.raises(ValueError, match="max_failure_share"):
    RewardRunner(flaky, max_failure_share=1.5)
  with pytest.raises(TypeError, match="callable"):
    RewardRunner(42)
  with pytest.raises(TypeError, match="picklable"):
    RewardRunner(lambda e, r: 1.0, mode="process")
  with pytest.raises(ValueError, match=r"pairs\[1\]"):
    RewardRunner(flaky, mode="inline").score([(EX, "2"), "2"])
  with pytest.raises(ValueError, match="workers"):
    WorkerPool(flaky, workers=0)


def test_the_worker_imports_no_jax():
  out = subprocess.run([sys.executable, "-X", "importtime", "-m", "jaxrl_llm.tasks.worker_main"],
                       stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120, check=True)
  modules = {line.rsplit("|", 1)[-1].strip() for line in out.stderr.splitlines() if "|" in line}
  assert "jaxrl_llm.tasks" in modules and not {m for m in modules if m.split(".")[0] in ("jax", "jaxlib")}


_ORPHAN_PARENT = """
import sys
sys.path.insert(0, {tests!r})
from reward_faults import judge
from jaxrl_llm.tasks import Example, RewardRunner
runner = RewardRunner(judge, timeout_s=3600.0, workers=2)
ex = Example(prompt="1+1=", answer="2")
runner.score([(ex, "2")] * 4)
print(" ".join(str(w.proc.pid) for w in runner.pool._workers), flush=True)
runner.score([(ex, "sleep")])  # a worker busy in a call, the other idle, when this process is killed
"""


def _alive(pid: int) -> bool:
  try:
    with open(f"/proc/{pid}/stat") as f:
      return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
  except FileNotFoundError:
    return False


def test_workers_exit_when_their_parent_process_is_killed():
  script = _ORPHAN_PARENT.format(tests=os.path.dirname(os.path.abspath(__file__)))
  parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
  try:
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2
    time.sleep(0.5)  # the "sleep" call reaches its worker (not needed for the outcome: idle workers exit too)
  finally:
    parent.kill()
    parent.wait()
  deadline = time.monotonic() + HANG_BOUND_S
  while any(_alive(p) for p in pids) and time.monotonic() < deadline:
    time.sleep(0.1)
  assert not any(_alive(p) for p in pids)
