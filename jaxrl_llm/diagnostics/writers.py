"""Metric sinks: JSONL log, TensorBoard event files, a terminal progress bar (and W&B: wandb_sink.py).

``MetricsWriter`` fans one ``write(step, metrics)`` call out to every sink. Values
are converted to Python floats once (a single device-to-host transfer per step).
Non-finite values are written as strings ("nan", "inf") in JSONL so the file
stays valid JSON.

A resumed run continues the same files: :func:`truncate_jsonl` first cuts
``metrics.jsonl`` back to what it held at the checkpoint (``JsonlWriter.lines``
counts its lines, saved with each checkpoint), so replayed steps appear once;
TensorBoard event files are not rewritten: a ``purge_step`` makes TensorBoard
hide the events of the replayed steps.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any, Mapping, Optional

import numpy as np


def to_python(metrics: Mapping[str, Any]) -> dict[str, float]:
  """Flattens a metrics mapping into ``{name: float}`` (device arrays fetched once)."""
  import jax
  host = jax.device_get(dict(metrics))
  out = {}
  for k, v in host.items():
    arr = np.asarray(v)
    if arr.size == 1:
      out[k] = float(arr.reshape(()))
  return out


def _json_safe(v: float) -> Any:
  return v if math.isfinite(v) else str(v)


def _count_lines(path: str) -> int:
  if not os.path.exists(path):
    return 0
  with open(path, "rb") as f:
    return sum(1 for line in f if line.strip())


class JsonlWriter:
  """Appends one JSON record per line; ``lines`` counts the records the file holds."""

  def __init__(self, path: str):
    self.lines = _count_lines(path)
    self._f = open(path, "a", buffering=1)

  def write(self, step: int, metrics: Mapping[str, float]) -> None:
    rec = {"step": step, "time": time.time(), **{k: _json_safe(v) for k, v in metrics.items()}}
    self._f.write(json.dumps(rec) + "\n")
    self.lines += 1

  def close(self) -> None:
    self._f.close()


class TensorBoardWriter:
  """Scalars as TensorBoard events; ``purge_step`` hides earlier events of steps >= it (a resume)."""

  def __init__(self, logdir: str, purge_step: Optional[int] = None):
    from tensorboardX import SummaryWriter
    self._w = SummaryWriter(logdir=logdir, flush_secs=10, purge_step=purge_step)

  def write(self, step: int, metrics: Mapping[str, float]) -> None:
    for k, v in metrics.items():
      if math.isfinite(v):  # undefined metrics (NaN: no tokens to measure) stay in the JSONL only
        self._w.add_scalar(k, v, step)

  def close(self) -> None:
    self._w.flush()
    self._w.close()


class ProgressBar:
  """A rich progress bar whose description shows the headline metrics."""

  HEADLINE = ("reward/mean", "eval/accuracy", "throughput/tokens_per_s", "loss", "offpolicy/drift_tv",
              "offpolicy/staleness_tv", "consistency/ess_rate", "guard/rollbacks")

  def __init__(self, total: int, description: str, enabled: bool = True):
    self._enabled = enabled
    self._latest: dict[str, float] = {}
    if not enabled:
      return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
    self._progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), TextColumn("{task.fields[info]}"), transient=False)
    self._progress.start()
    self._task = self._progress.add_task(description, total=total, info="")

  def update(self, step: int, metrics: Mapping[str, float]) -> None:
    self._latest.update({k: v for k, v in metrics.items() if k in self.HEADLINE})
    if not self._enabled:
      return
    info = "  ".join(f"{k.split('/')[-1]}={v:.3g}" for k, v in self._latest.items())
    self._progress.update(self._task, completed=step, info=info)

  def close(self) -> None:
    if self._enabled:
      self._progress.stop()


class MetricsWriter:
  """JSONL + TensorBoard (+ any ``extra_sinks``, e.g. W&B) + progress bar behind one ``write`` call."""

  def __init__(self, run_dir: str, total_steps: int, description: str = "train",
               progress: bool = True, tensorboard: bool = True, jsonl_name: str = "metrics.jsonl",
               purge_step: Optional[int] = None, extra_sinks: tuple = ()):
    os.makedirs(run_dir, exist_ok=True)
    self.jsonl_path = os.path.join(run_dir, jsonl_name)
    self.tb_dir = os.path.join(run_dir, "tensorboard")
    self._jsonl = JsonlWriter(self.jsonl_path)
    self._sinks: list[Any] = [self._jsonl]
    if tensorboard:
      self._sinks.append(TensorBoardWriter(self.tb_dir, purge_step))
    self._sinks.extend(extra_sinks)  # more sinks with write(step, metrics) / close() (W&B: wandb_sink.py)
    self._bar = ProgressBar(total_steps, description, enabled=progress)

  @property
  def lines(self) -> int:
    """Records in the JSONL file so far (saved with a checkpoint, the length a resume cuts back to)."""
    return self._jsonl.lines

  def write(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
    values = to_python(metrics)
    for s in self._sinks:
      s.write(step, values)
    self._bar.update(step, values)
    return values

  def close(self) -> None:
    self._bar.close()
    for s in self._sinks:
      s.close()


def read_jsonl(path: str) -> list[dict]:
  with open(path) as f:
    return [json.loads(line) for line in f if line.strip()]


def truncate_jsonl(path: str, keep_lines: Optional[int] = None, max_step: Optional[int] = None) -> int:
  """Cuts a JSONL metrics file back to a checkpoint; returns the number of lines removed.

  Keeps the first ``keep_lines`` records when given (the count saved with the
  checkpoint: exact, whatever the steps), else the records whose ``step`` is at
  most ``max_step``. Torn or unreadable lines (a killed writer) are dropped.
  The file is replaced atomically.
  """
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    lines = [line for line in f if line.strip()]
  kept = []
  for line in lines:
    if keep_lines is not None and len(kept) >= keep_lines:
      break
    try:
      rec = json.loads(line)
    except ValueError:
      continue
    if keep_lines is not None or max_step is None or rec.get("step", 0) <= max_step:
      kept.append(line if line.endswith("\n") else line + "\n")
  if len(kept) == len(lines):
    return 0
  tmp = path + ".tmp"
  with open(tmp, "w") as f:
    f.writelines(kept)
  os.replace(tmp, path)
  return len(lines) - len(kept)


def plot_curves(records: list[dict], out_png: str, keys: Optional[list[str]] = None, title: str = "") -> str:
  """PNG of each key against step (left column) and wall-clock seconds (right).

  Args:
    records: JSONL records with ``step`` and ``time``.
    out_png: output path.
    keys: metric names (default: reward/mean and eval/accuracy).
  """
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  keys = keys or ["reward/mean", "eval/accuracy"]
  t0 = min((r["time"] for r in records), default=0.0)
  fig, axes = plt.subplots(len(keys), 2, figsize=(10, 3 * len(keys)), squeeze=False)
  for row, key in enumerate(keys):
    pts = [(r["step"], r["time"] - t0, r[key]) for r in records if isinstance(r.get(key), (int, float))]
    for col, (idx, label) in enumerate(((0, "step"), (1, "wall-clock seconds"))):
      ax = axes[row][col]
      if pts:
        ax.plot([p[idx] for p in pts], [p[2] for p in pts], marker="." if len(pts) < 50 else None)
      ax.set_xlabel(label)
      ax.set_ylabel(key)
      ax.grid(alpha=0.3)
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(out_png, dpi=100)
  plt.close(fig)
  return out_png
