"""The chaos benchmark's reward: addition that hangs or raises on a share of training calls.

Its own module (not ``bench/chaos.py``, which runs as ``__main__``) so that the reward
worker processes can import the class when they unpickle the task.
"""

from __future__ import annotations

import dataclasses
import random
import time

from jaxrl_llm.tasks import register_task
from jaxrl_llm.tasks.addition import AdditionTask


@dataclasses.dataclass(frozen=True)
class FaultyAdditionTask(AdditionTask):
  """Addition whose reward hangs on ``hang_rate`` and raises on ``raise_rate`` of training calls.

  Held-out examples (``is_eval``) are always scored normally. The draws use the reward
  worker process's own random state: which calls fail differs from run to run.
  """

  hang_rate: float = 0.0
  raise_rate: float = 0.0

  def reward(self, example, response: str) -> float:
    if not self.is_eval(example):
      u = random.random()
      if u < self.hang_rate:
        while True:  # a hang: only killing the process ends it
          time.sleep(3600)
      if u < self.hang_rate + self.raise_rate:
        raise RuntimeError("injected reward fault")
    return super().reward(example, response)


register_task("faulty_addition", FaultyAdditionTask)
