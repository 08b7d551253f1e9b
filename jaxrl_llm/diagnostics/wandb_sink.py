"""Weights & Biases as an optional metrics sink (``log.wandb=True``; extra ``[wandb]``).

:class:`WandbWriter` is one more sink of :class:`~jaxrl_llm.diagnostics.writers.MetricsWriter`,
next to the JSONL file and TensorBoard: every record goes to all of them. Nothing else in the
package imports ``wandb``; a run without ``log.wandb`` never needs it.

* The run's step is logged as ``trainer/step`` and every metric is plotted against it
  (``wandb.define_metric("*", step_metric="trainer/step")``): the warm start's steps are
  negative (-sft.steps .. -1) and RL starts at 0, which W&B's own ``_step`` could not take.
* The W&B run id is kept in ``<run_dir>/wandb_id``; a resumed run continues the same W&B run
  (``resume="allow"``). W&B cannot hide the steps a resume replays (TensorBoard's
  ``purge_step`` does): they appear twice there, and ``metrics.jsonl`` stays the reference.
* Offline: ``WANDB_MODE=offline`` writes ``<run_dir>/wandb/offline-run-*`` without a network;
  ``wandb sync`` uploads it later. Non-finite values are left out, as for TensorBoard.

Reference: W&B's Python API, https://docs.wandb.ai/ref/python/ (``init``, ``log``,
``define_metric``, ``finish``).
"""

from __future__ import annotations

import importlib.util
import math
import os
import uuid
from typing import Any, Mapping, Optional

from jaxrl_llm.errors import ConfigError

STEP_KEY = "trainer/step"
INSTALL = "pip install 'jaxrl_llm[wandb]'"


def check_available() -> None:
  """Raises ConfigError naming ``log.wandb`` when the ``wandb`` package is not installed."""
  if importlib.util.find_spec("wandb") is None:
    raise ConfigError(f"log.wandb=True: the wandb package is not installed ({INSTALL}); or set log.wandb=False")


class WandbWriter:
  """Logs each record to a W&B run.

  Args:
    run_dir: the run folder (W&B's ``dir``; the run id file lives there).
    project, entity, name: the W&B run's project, entity ("" = the default) and display name.
    config: the run config as a plain dict (W&B's ``config``).
  """

  def __init__(self, run_dir: str, *, project: str, entity: str = "", name: str = "",
               config: Optional[Mapping[str, Any]] = None):
    check_available()
    import wandb  # pylint: disable=import-outside-toplevel
    self._wandb = wandb
    id_path = os.path.join(run_dir, "wandb_id")
    if os.path.exists(id_path):
      with open(id_path, encoding="utf-8") as f:
        run_id = f.read().strip()
    else:
      run_id = uuid.uuid4().hex[:16]
      with open(id_path, "w", encoding="utf-8") as f:
        f.write(run_id + "\n")
    self.run = wandb.init(project=project, entity=entity or None, name=name or None, dir=run_dir, id=run_id,
                          resume="allow", config=dict(config or {}), reinit="finish_previous")
    self.run.define_metric(STEP_KEY)
    self.run.define_metric("*", step_metric=STEP_KEY)

  def write(self, step: int, metrics: Mapping[str, float]) -> None:
    values = {k: v for k, v in metrics.items() if math.isfinite(v)}
    if values:
      self.run.log({**values, STEP_KEY: int(step)})

  def close(self) -> None:
    self.run.finish()


__all__ = ["INSTALL", "STEP_KEY", "WandbWriter", "check_available"]
