"""Data curation for RL prompts: pass rates, retirement, prioritised and curriculum sampling,
and dynamic sampling (DAPO's informative-group filter). Host-side NumPy, no JAX.

Modules, one job each:

  config      :class:`CurationConfig`, the ``config.data`` settings (default, meaning, check).
  tracker     :class:`PassRateTracker`: per-prompt success over a window of recent attempts.
  pool        :class:`PrioritizedPool`: prompts drawn ∝ (1 - pass rate) + floor.
  curriculum  :class:`Curriculum`: difficulty ceilings (``task.difficulty``) that rise with success.
  source      :class:`CuratedPromptSource`: a drop-in ``PromptSource`` with ``record`` and
              ``metrics``, retirement of solved prompts, resumable JSON state.
  dynamic     :class:`InformativeGroupCollector`: over-sampling until a batch holds enough
              groups with unequal rewards.

Example::

  from jaxrl_llm.tasks import curation

  source = curation.CuratedPromptSource(task, 8, seed=0, samples_per_prompt=4,
                                        config=curation.CurationConfig(strategy="curriculum"))
  collector = curation.InformativeGroupCollector(8, 4, max_rounds=3)
  while not collector.done:
    batch = source.next_batch()
    rewards_b = score(sample(batch))
    source.record(batch, rewards_b)
    collector.add(rewards_b)

References:
  DAPO (dynamic sampling): arXiv:2503.14476. Kimi k1.5 (curriculum sampling and
  prioritised sampling ∝ 1 - s_i): arXiv:2501.12599. Skywork-OR1 (dropping prompts
  with a high pass rate): arXiv:2505.22312.
"""

from jaxrl_llm.tasks.curation.config import SCHEDULES, STRATEGIES, CurationConfig
from jaxrl_llm.tasks.curation.curriculum import Curriculum, DifficultyFn, probe_levels
from jaxrl_llm.tasks.curation.dynamic import CollectedGroups, InformativeGroupCollector, zero_variance_groups
from jaxrl_llm.tasks.curation.pool import PrioritizedPool, weighted_sample_without_replacement
from jaxrl_llm.tasks.curation.source import STATE_VERSION, CuratedPromptSource, KeyFn
from jaxrl_llm.tasks.curation.tracker import PassRateTracker, prompt_key

__all__ = [
    "STATE_VERSION", "SCHEDULES", "STRATEGIES", "CollectedGroups", "CuratedPromptSource", "CurationConfig",
    "Curriculum", "DifficultyFn", "InformativeGroupCollector", "KeyFn", "PassRateTracker", "PrioritizedPool",
    "probe_levels", "prompt_key", "weighted_sample_without_replacement", "zero_variance_groups",
]
