"""Jobs: the runs ``jaxrl-train`` starts, on one shared scaffolding.

  base          Job: run folder and write probe, checkpoints with progress and host
                components, the SFT warm start, hooks, summary, plot, HF export
  resume        what a run does with its checkpoints: the config check, the extension
                of a finished run, metrics cut back, finite-only saves and outputs
  rl            RLJob: one step = collect -> score -> advantages -> update -> publish
  score         the score stage (rule reward, reward model, combination, clipping)
  advantages    the advantages stage: one pure function, samples + rewards -> RLBatch
  update        the update stage: jitted step(s) bracketed by the consistency check
  hooks         periodic hooks: controller, RFT, guard, policy version, evaluation
  evaluation    held-out greedy accuracy and pass@k
  eval_command  the ``jaxrl-eval`` command's pieces (sources, examples, figures with intervals)
  reward_model  RewardModelJob: Bradley-Terry training of a reward model
  preference_optimization  PreferenceOptimizationJob: DPO, IPO or SimPO of the policy on pairs
  consistency   the sampler-vs-learner check on a checkpoint (``jaxrl-check-consistency``)
  prompt_check  every prompt checked against the context at start-up (``data.long_prompts``)

:func:`run` picks the job from ``config.job``. A new kind of job subclasses
:class:`Job` and is added to :data:`JOBS` (see docs/architecture.md).
"""

from __future__ import annotations

from typing import Any

import ml_collections

from jaxrl_llm.jobs.base import Hook, Job, NonFiniteError, Progress
from jaxrl_llm.jobs.preference_optimization import PreferenceOptimizationJob
from jaxrl_llm.jobs.reward_model import RewardModelJob
from jaxrl_llm.jobs.rl import RLJob
from jaxrl_llm.jobs.update import RunState

# config.job -> the Job subclass that runs it.
JOBS = {"rl": RLJob, "reward_model": RewardModelJob, "dpo": PreferenceOptimizationJob}

__all__ = ["Hook", "JOBS", "Job", "NonFiniteError", "PreferenceOptimizationJob", "Progress", "RLJob", "RewardModelJob",
           "RunState", "make_job", "run"]


def make_job(config: ml_collections.ConfigDict) -> Job:
  """The configured job of ``config.job`` (validated, folders checked, resumed if a checkpoint exists)."""
  if config.job not in JOBS:
    raise ValueError(f"job={config.job!r}: expected one of {tuple(JOBS)}")
  return JOBS[config.job](config)


def run(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """Runs a whole job; returns the summary dict (also written to summary.json)."""
  return make_job(config).train()
