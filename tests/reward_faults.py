"""Rewards and a task that fail on purpose, for the reward-guard tests.

A module of its own (it imports no JAX) so that reward worker processes can unpickle
these by reference without importing a test module and everything it imports.
"""

import dataclasses
import time
from fractions import Fraction

from jaxrl_llm.tasks import AdditionTask


def judge(example, response):
  """Exact-match reward that raises on "raise", holds the GIL for ever on "hang", sleeps on "sleep"."""
  if response == "raise":
    raise RuntimeError("the verifier is broken")
  if response == "hang":
    return float(Fraction("1e99999999999") > 0)  # 10^(10^11) in C code: never returns
  if response == "sleep":
    time.sleep(3600)
  return float(response.strip() == example.answer)


@dataclasses.dataclass(frozen=True)
class BrokenAdditionTask(AdditionTask):
  """The addition task with a verifier that raises on every call."""

  def reward(self, example, response):
    raise RuntimeError("the verifier is broken")
