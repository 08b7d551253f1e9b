"""The reward guard in the jobs: evaluation scores through the runner (a raising or hanging
verifier is a counted wrong answer, not a dead or hung run), the failure-rate stop of an RL run,
the ``reward`` config section, and the score stage's checkpointed counters.

Bounded in time: hangs are cut by a 1 s reward timeout; the wall-clock bounds below only catch a
hang, generously, never measure speed."""

import time
from types import SimpleNamespace

import numpy as np
import pytest

from jaxrl_llm import configuration as C
from jaxrl_llm import jobs
from jaxrl_llm.jobs.evaluation import PolicyEvaluator
from jaxrl_llm.jobs.score import RewardStage, reward_runner
from jaxrl_llm.tasks import Example, RewardFailureError, RewardRunner, register_task, unregister_task

from reward_faults import BrokenAdditionTask, judge
from tiny_configs import tiny_config

HANG_BOUND_S = 60.0
EXAMPLES = [Example(prompt=f"{i}+1=", answer=str(i + 1)) for i in range(4)]


class ScriptedSampler:
  """A stand-in for the in-process sampler: answers from a script (the sampler is not under test).

  ``greedy[i]`` is the greedy answer to prompt ``i``; sampled answers are ``sampled[i]`` k times.
  Token ids are indices into ``texts``.
  """

  def __init__(self, greedy, sampled):
    self.texts = list(dict.fromkeys(greedy + sampled))
    self.greedy_answers, self.sampled_answers = greedy, sampled

  def generate(self, prompts, greedy=False, num_samples=1, rng=None):
    del rng
    answers = self.greedy_answers if greedy else self.sampled_answers
    ids = [[self.texts.index(answers[i])] for i in range(len(prompts)) for _ in range(num_samples)]
    return SimpleNamespace(trajectory=None, response_tokens=ids)


def _evaluator(sampler, runner):
  return PolicyEvaluator(sampler, runner, encode=lambda prompt: [0], decode=lambda ids: sampler.texts[ids[0]],
                         seed=0, pass_k=2)


@pytest.mark.parametrize("fault", ["raise", "hang", "sleep"])
def test_evaluation_with_a_failing_verifier_finishes_and_counts_it(fault):
  greedy = ["1", fault, "3", fault]  # prompts 0 and 2 right, 1 and 3 hit the fault
  sampled = [fault, "2", "3", "0"]
  with RewardRunner(judge, timeout_s=1.0, name="eval", workers=2) as runner:
    runner.score([(EXAMPLES[0], "1")])  # workers started
    started = time.monotonic()
    metrics = _evaluator(ScriptedSampler(greedy, sampled), runner)(EXAMPLES, step=0)
    assert time.monotonic() - started < HANG_BOUND_S
    assert metrics["eval/accuracy"] == 0.5 and metrics["eval/pass@2"] == 0.5
    assert metrics["eval/sample_accuracy"] == 0.5
    m = runner.metrics
    cause = "failures" if fault == "raise" else "timeouts"
    assert m[f"reward/eval/{cause}"] == 2 + 2  # two greedy answers, one prompt's two samples


def test_evaluator_needs_a_runner_not_a_task():
  with pytest.raises(TypeError, match="RewardRunner"):
    PolicyEvaluator(ScriptedSampler(["1"], ["1"]), BrokenAdditionTask(), encode=list, decode=str, seed=0, pass_k=1)


def test_reward_stage_stop_and_checkpoint_state_with_old_counters(tmp_path):
  settings = C.settings(tiny_config(tmp_path, reward__mode="inline", reward__failure_steps=2)).reward
  runner = reward_runner(judge, settings)
  stage = RewardStage(runner, decode=lambda ids: ids, group_size=1)
  for step in range(2):
    rewards, _ = stage(EXAMPLES[:3], None, ["raise", "raise", "3"])  # 2 of 3 calls fail: above 0.5
    np.testing.assert_array_equal(rewards, [0, 0, 1])
    if step == 0:
      stage.end_step()
  with pytest.raises(RewardFailureError, match="the verifier is broken"):
    stage.end_step()
  state = stage.get_state()
  assert state["runner"]["failures"] == 4 and state["runner"]["failing_steps"] == 2
  old = {"runner": {"calls": 9, "failures": 1, "timeouts": 3, "nonfinite": 0, "worker_restarts": 3, "seconds": 1.5}}
  fresh = RewardStage(reward_runner(judge, settings), decode=lambda ids: ids, group_size=1)
  fresh.set_state(old)  # a checkpoint written before the crash / memory counters existed
  m = fresh.runner_metrics()
  assert m["reward/task/timeouts"] == 3 and m["reward/task/crashes"] == 0 and m["reward/task/memory_errors"] == 0


@pytest.mark.parametrize("field,value,expected", [
    ("mode", "thread", "one of"), ("timeout_s", float("inf"), "finite"), ("workers", 0, "positive"),
    ("max_failure_share", 1.5, "[0, 1]"), ("memory_mb", -1, ">= 0")])
def test_reward_section_is_validated(tmp_path, field, value, expected):
  config = tiny_config(tmp_path, **{f"reward__{field}": value})
  with pytest.raises(ValueError, match=f"reward.{field}") as e:
    C.validate(config)
  assert expected in str(e.value)


def test_rl_run_with_a_broken_verifier_stops_after_failure_steps_and_survives_the_warm_start_eval(tmp_path):
  register_task("broken_addition", BrokenAdditionTask, overwrite=True)
  try:
    config = tiny_config(tmp_path, task__name="broken_addition", sft__steps=0, rl__steps=6, eval__every=100,
                         checkpoint__every=100, export__hf=False, reward__failure_steps=2, reward__timeout_s=2.0)
    job = jobs.RLJob(config)
    with pytest.raises(RewardFailureError) as e:
      job.train()
    message = str(e.value)
    assert "RuntimeError: the verifier is broken" in message and "Traceback" in message
    assert "reward.max_failure_share" in message and "reward.failure_steps=2" in message
    assert job.progress.step == 1  # the second RL step's scoring stopped the run
    evaluation = job.eval_rewards.metrics
    assert evaluation["reward/eval/failures"] == evaluation["reward/eval/calls"] > 0  # warm-start eval survived
    assert job.score.runner.pool._workers == []  # pylint: disable=protected-access  # closed with the job
  finally:
    unregister_task("broken_addition")
