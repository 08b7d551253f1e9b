"""Reward functions as plug-ins (``reward.functions``): named errors, weighted sums, guarded components, a run."""

import json
import os
import sys
import textwrap

import numpy as np
import pytest

from jaxrl_llm import configuration as C, jobs
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.tasks import RewardFailureError, RewardRunner, reward_plugins

sys.path.insert(0, os.path.dirname(__file__))
from tiny_configs import tiny_config  # noqa: E402

USER_REWARDS = textwrap.dedent('''
    """A user's reward module, outside the package."""
    import math


    def short_bonus(example, response):
      return 1.0 if len(response) <= 2 else 0.0


    def broken(example, response):
      raise RuntimeError("a bug in the user's reward")


    def not_a_number(example, response):
      return math.nan


    class Rewards:
      @staticmethod
      def has_digit(example, response):
        return float(any(ch.isdigit() for ch in response))


    THRESHOLD = 3
''')


@pytest.fixture()
def user_module(tmp_path, monkeypatch):
  """``user_rewards_<n>`` importable here and in reward worker processes (through PYTHONPATH)."""
  name = f"user_rewards_{abs(hash(str(tmp_path))) % 10**8}"
  (tmp_path / f"{name}.py").write_text(USER_REWARDS)
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p))
  return name


@pytest.mark.parametrize("value, message", [
    ((("task", "x"),), r"reward.functions\[0\]=\('task', 'x'\): the weight must be a finite number"),
    ((("task", float("inf")),), r"the weight must be a finite number"),
    ((("task",),), r"reward.functions\[0\]=\('task',\): expected a \(name, weight\) pair"),
    ((("my_rewards.fmt", 1.0),), r"the name must be 'task', an import path 'package.module:callable' or a reward "
                                 r"server's http\(s\):// URL"),
    ((("task", 1.0), ("task", 0.5)), r"reward.functions\[1\]=\('task', 0.5\): 'task' is listed twice"),
    ((("no_such_module_xyz:fn", 1.0),), r"reward.functions: 'no_such_module_xyz:fn': module 'no_such_module_xyz' "
                                         r"does not import"),
    ((("json:dumpz", 1.0),), r"'json' has no attribute 'dumpz'; did you mean"),
])
def test_bad_reward_functions_are_named_config_errors(value, message):
  c = C.base_config()
  c.reward.functions = value
  with pytest.raises(ConfigError, match=message):
    C.validate(c)


def test_a_non_callable_and_a_nested_attribute(user_module):
  with pytest.raises(ConfigError, match=rf"'{user_module}:THRESHOLD' is a int, not a callable"):
    reward_plugins.resolve(f"{user_module}:THRESHOLD")
  assert reward_plugins.resolve(f"{user_module}:Rewards.has_digit")(None, "a1") == 1.0
  labels = [c.label for c in reward_plugins.parse_components(
      ((f"{user_module}:Rewards.has_digit", 1), (f"{user_module}:short_bonus", 2), ("task", 1)))]
  assert labels == ["has_digit", "short_bonus", "task"]


def weighted(names_weights, mode="inline"):
  components = reward_plugins.parse_components(names_weights)
  return reward_plugins.WeightedRewards([
      (c, RewardRunner(reward_plugins.resolve(c.name), name=c.label, mode=mode, timeout_s=5.0, max_failure_share=0.5,
                       failure_steps=2)) for c in components])


def test_the_reward_is_the_weighted_sum_and_each_mean_is_logged(user_module):
  rewards = weighted(((f"{user_module}:short_bonus", 0.5), (f"{user_module}:Rewards.has_digit", 2.0)))
  got = rewards.score([(None, "7"), (None, "long text"), (None, "x")])
  np.testing.assert_allclose(got, [0.5 + 2.0, 0.0, 0.5])
  assert rewards.step_metrics() == pytest.approx({"reward/short_bonus/mean": 2 / 3, "reward/has_digit/mean": 1 / 3})
  assert rewards.metrics["reward/short_bonus/calls"] == 3 and rewards.metrics["reward/has_digit/calls"] == 3


def test_a_failing_component_scores_zero_is_counted_and_then_stops_the_run(user_module):
  rewards = weighted(((f"{user_module}:short_bonus", 1.0), (f"{user_module}:not_a_number", 1.0),
                      (f"{user_module}:broken", 1.0)))
  np.testing.assert_allclose(rewards.score([(None, "1"), (None, "123")]), [1.0, 0.0])  # the others score 0
  assert rewards.metrics["reward/not_a_number/nonfinite"] == 2 and rewards.metrics["reward/broken/failures"] == 2
  rewards.end_step()
  rewards.score([(None, "1")])
  with pytest.raises(RewardFailureError, match=r"Reward 'not_a_number' failed on more than"):
    rewards.end_step()


def test_a_user_reward_module_trains_end_to_end_in_worker_processes(tmp_path, user_module):
  run = jobs.RLJob(tiny_config(tmp_path / "run", rl__steps=2, checkpoint__every=100, export__hf=False,
                               eval__every=100,
                               reward__functions=((f"{user_module}:short_bonus", 0.25), ("task", 1.0))))
  run.train()
  records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  rl = [r for r in records if "reward/short_bonus/mean" in r]
  assert len(rl) == 2
  for r in rl:  # the step's reward is the weighted sum of the two components' means
    assert r["reward/mean"] == pytest.approx(0.25 * r["reward/short_bonus/mean"] + r["reward/task/mean"], abs=1e-6)
    assert r["reward/short_bonus/failures"] == 0 and r["reward/short_bonus/calls"] > 0
  summary = json.load(open(tmp_path / "run" / "summary.json"))
  assert summary["rewards"]["reward/short_bonus/calls"] == rl[-1]["reward/short_bonus/calls"]


# ------------------------------------------------------------------------------ a reward server on 127.0.0.1


class RewardServer:
  """A reward server started by the test: 1.0 for a response that holds a digit; ``stop()`` kills it."""

  def __init__(self, answer=None):
    import http.server
    import threading

    self.batches = []
    server = self

    class Handler(http.server.BaseHTTPRequestHandler):
      def do_POST(self):  # noqa: N802 (http.server's name)
        items = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["items"]
        server.batches.append(len(items))
        rewards = [float(any(ch.isdigit() for ch in it["response"])) for it in items]
        body = json.dumps(answer(rewards) if answer else {"rewards": rewards}).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

      def log_message(self, *args):
        pass

    self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
    self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
    self.thread.start()

  def stop(self):
    self.httpd.shutdown()
    self.httpd.server_close()


def test_a_reward_server_scores_batches_and_a_malformed_answer_is_counted():
  from jaxrl_llm.tasks.remote_reward import RemoteReward, RemoteRewardRunner
  server = RewardServer()
  try:
    runner = RemoteRewardRunner(RemoteReward(server.url, timeout_s=5, retries=0), name="remote")
    np.testing.assert_array_equal(runner.score([(None, "a1"), (None, "b"), (None, "7")]), [1.0, 0.0, 1.0])
    assert server.batches == [3]  # one request per batch
  finally:
    server.stop()
  short = RewardServer(answer=lambda rewards: {"rewards": rewards[:-1]})
  try:
    runner = RemoteRewardRunner(RemoteReward(short.url, timeout_s=5, retries=1, backoff_s=0.0), name="remote")
    np.testing.assert_array_equal(runner.score([(None, "1"), (None, "2")]), [0.0, 0.0])
    assert runner.failures == 2 and short.batches == [2, 2]  # retried once, then counted
  finally:
    short.stop()


def test_a_reward_server_serves_a_run_and_its_outage_is_counted_and_survived(tmp_path):
  server = RewardServer()

  class KillServer:  # a job hook: the server goes away after RL step 1
    name = "kill_reward_server"

    def due(self, step):
      return step == 1

    def __call__(self, job, step, metrics):
      server.stop()
      return {}

  run = jobs.RLJob(tiny_config(tmp_path / "run", rl__steps=3, checkpoint__every=100, export__hf=False, eval__every=100,
                               reward__functions=((server.url, 0.5), ("task", 1.0)), reward__remote_retries=1,
                               reward__failure_steps=5))
  run.add_hook(KillServer())
  run.train()  # the outage does not stop the run (it would after reward.failure_steps failing steps)
  records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
  rl = [r for r in records if "reward/remote/mean" in r]
  assert len(rl) == 3
  assert rl[0]["reward/remote/failures"] == 0 and server.batches  # served while it was up
  calls_per_step = rl[0]["reward/remote/calls"]
  assert rl[-1]["reward/remote/failures"] + rl[-1].get("reward/remote/timeouts", 0) >= calls_per_step  # counted
  assert rl[-1]["reward/remote/mean"] == 0.0 and rl[-1]["reward/task/calls"] == 3 * calls_per_step
