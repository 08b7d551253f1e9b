"""Experiments: a config, a hyper-parameter sweep, and its runs' jobs, launched locally or by XManager.

  from jaxrl_llm import experiments
  exp = experiments.Experiment(name="eps_sweep", config="configs/grpo_addition.py",
                               sweep=[{"objective.kwargs.eps": 0.1}, {"objective.kwargs.eps": 0.2}])
  experiments.run_local(exp)           # processes on this machine; no XManager needed
  experiments.launch_xm(exp)           # the same definition through XManager ([xm] extra)

See ``docs/experiments.md``.
"""

from jaxrl_llm.experiments.definition import (Addresses, Experiment, JobSpec, WorkUnit, addresses_for,
                                              apply_overrides, learner_jobs, load_config)
from jaxrl_llm.experiments.planning import check_experiment, check_layout, plan
from jaxrl_llm.experiments.local import WorkUnitResult, run_experiment as run_local, run_jobs
from jaxrl_llm.experiments.xm_backend import launch as launch_xm

__all__ = [
    "Addresses", "Experiment", "JobSpec", "WorkUnit", "WorkUnitResult", "addresses_for", "apply_overrides",
    "check_experiment", "check_layout", "launch_xm", "learner_jobs", "load_config", "plan", "run_jobs", "run_local",
]
