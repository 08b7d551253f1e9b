"""The learner: train state, mesh, optimizer and the jitted SFT and RL updates.

Modules (import them by name, e.g. ``from jaxrl_llm.learner import rl_step``;
``jaxrl_llm.learner.<module>`` also works after ``import jaxrl_llm.learner``,
each module is imported on first use):

  state       ``TrainState``: one pytree holding everything an update changes.
  mesh        the ('data', 'fsdp', 'tensor') device mesh, batch shardings.
  multihost   multi-process start-up and host transfers.
  optim       the optax chain (clipping, AdamW, warm-up, schedule).
  update      gradient accumulation (micro-batches or batch-invariant atoms)
              and the guarded optimizer update.
  sft         supervised fine-tuning batches and step (warm start, RFT).
  rft         rejection-sampling fine-tuning (best of K samples -> SFT).
  rl_step     the pure, jitted RL update (objective chain, policy and critic).
  checkpoint  orbax checkpoints of the run state: finite only, verified by a
              manifest, atomically replaced, with fallback to the previous one.
  manifest    the sha256 manifest of a checkpoint folder and its check.
  builders    run config -> model, params, optimizers, objective.

The run itself (the job that drives these pieces) lives above this layer.
"""

import importlib
from typing import Any

__all__ = ["builders", "checkpoint", "manifest", "mesh", "multihost", "optim", "rft", "rl_step", "sft", "state",
           "update"]


def __getattr__(name: str) -> Any:
  """Imports a submodule listed in ``__all__`` on first attribute access (PEP 562)."""
  if name in __all__:
    return importlib.import_module(f"{__name__}.{name}")
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
