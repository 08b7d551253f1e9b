"""Resuming a job: the checkpoint it continues from, the config check, and a run folder that stays consistent.

What a :class:`~jaxrl_llm.jobs.base.Job` does with its checkpoints
(:mod:`jaxrl_llm.learner.checkpoint` verifies, replaces atomically and falls
back to the previous good one; this module decides what a run does with them):

* **saving**: every checkpoint carries the run config (``config.json``) and the
  number of ``metrics.jsonl`` records so far. A state with NaN or inf is never
  saved: a periodic save is skipped with a warning (the update guard decides
  when to stop), a forced one (phase end, run end) raises :class:`NonFiniteError`,
  whose message names the newest verified finite checkpoint, or says there is none;
* **resuming**: the config is compared with the checkpoint's. A changed
  architecture, task or job (``job``, ``model.*``, ``init.*``, ``task.*``) is a
  :class:`~jaxrl_llm.errors.ConfigError` naming each field with its old and new
  value. A changed step count extends (or shortens) the run: a finished run
  asked for more main steps goes back to its main phase and trains them; a
  changed ``sft.steps`` after the warm start has no effect (said once). Any
  other difference (learning rates, logging, evaluation, ...) is allowed with a
  one-line warning that lists it; ``run_dir`` is not compared;
* **starting** (:func:`start`, when training begins): ``metrics.jsonl`` is cut
  back to the records it held at the checkpoint (a fresh run starts an empty
  one); TensorBoard files are kept, and events of the replayed steps are hidden
  by a purge step; ``<run_dir>/config.json`` is (re)written with this run's config;
* **finishing**: a finished run rerun with the same steps prints that it is
  complete and leaves ``summary.json`` and ``hf_export/`` as they are
  (:func:`completed_summary`); the outputs are written only from a finite state
  that was just saved, so verified (:func:`check_final`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Optional

import ml_collections
import numpy as np
from jax.experimental import multihost_utils

from jaxrl_llm import configuration, errors
from jaxrl_llm.diagnostics import writers
from jaxrl_llm.learner import checkpoint, multihost

__all__ = ["NonFiniteError", "ResumePoint", "check_final", "compare_configs", "completed_summary", "config_record",
           "continue_from", "last_good", "load", "save", "start", "track_nonfinite", "write_json"]

log = logging.getLogger("jaxrl_llm")

FIXED_FIELDS = ("job",)
FIXED_PREFIXES = ("model.", "init.", "task.")  # what the arrays and the data stream are made of
IGNORED_FIELDS = ("run_dir",)
ABSENT = "<absent>"


class NonFiniteError(errors.RunError):
  """The run stops on non-finite values: too many skipped updates in a row, or a state with NaN or inf."""


@dataclasses.dataclass
class ResumePoint:
  """How far the run folder's records are cut back when training starts.

  Attributes:
    keep_lines: ``metrics.jsonl`` records at the checkpoint (None: not recorded).
    max_step: otherwise, records of a later step are dropped (None: keep all).
    purge_step: TensorBoard hides earlier events of steps >= this (None: nothing hidden).
  """

  keep_lines: Optional[int] = 0
  max_step: Optional[int] = None
  purge_step: Optional[int] = None


def say(line: str) -> None:
  """A one-line notice: logged as a warning and printed."""
  log.warning("%s", line)
  print(line)


def config_record(config: ml_collections.ConfigDict) -> dict:
  """The config as plain JSON data (what a checkpoint's ``config.json`` holds)."""
  return json.loads(config.to_json_best_effort(sort_keys=True))


def flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
  """``{"model": {"num_layers": 2}}`` -> ``{"model.num_layers": 2}`` (lists are values)."""
  if not isinstance(tree, dict) or not tree:
    return {prefix[:-1]: tree} if prefix else {}
  out: dict[str, Any] = {}
  for k, v in tree.items():
    out.update(flatten(v, f"{prefix}{k}."))
  return out


def compare_configs(old: dict, new: dict, step_fields: tuple[str, ...]) -> tuple[list, list, list]:
  """Differences ``(path, old, new)`` of two config records, as (fixed, step counts, others).

  A field the old record lacks (added to the schema since) counts only when its
  new value is not the default.
  """
  flat_old, flat_new = flatten(old), flatten(new)
  defaults = flatten(config_record(configuration.base_config()))
  fixed, steps, other = [], [], []
  for path in sorted(set(flat_old) | set(flat_new)):
    a, b = flat_old.get(path, ABSENT), flat_new.get(path, ABSENT)
    if a == b or path in IGNORED_FIELDS or (a == ABSENT and defaults.get(path, ABSENT) == b):
      continue
    if path in FIXED_FIELDS or path.startswith(FIXED_PREFIXES):
      fixed.append((path, a, b))
    else:
      (steps if path in step_fields else other).append((path, a, b))
  return fixed, steps, other


def describe(diffs: list) -> str:
  return ", ".join(f"{path} {a!r} -> {b!r}" for path, a, b in diffs)


def step_fields(job: Any) -> tuple[str, str]:
  """The step counts of a job: the warm start's and the main phase's (``rl.steps``, ``reward_model.steps``)."""
  return "sft.steps", f"{job.config.job}.steps"


def last_good(job: Any, hashes: bool = True) -> str:
  """The sentence naming the newest verified finite checkpoint of the run, or saying there is none."""
  ck = job.checkpointer
  step = ck.newest_good_step(hashes)
  if step is None:
    return f"There is no verified finite checkpoint in {ck.directory}: a rerun starts from the beginning."
  return f"The newest verified finite checkpoint is step {step} in {ck.directory}; a rerun resumes from it."


def track_nonfinite(job: Any, metrics: dict) -> None:
  """Counts updates skipped for a non-finite loss, gradient or new state; raises after too many in a row."""
  p = job.progress
  if float(metrics["update/skipped_nonfinite"]) > 0:
    p.skipped_updates += 1
    p.nonfinite_in_a_row += 1
    log.warning("non-finite loss, gradient or new state: update skipped (%d in a row)", p.nonfinite_in_a_row)
    limit = job.config.learner.max_nonfinite_in_a_row
    if p.nonfinite_in_a_row >= limit:
      raise NonFiniteError(
          f"{p.nonfinite_in_a_row} consecutive updates had a non-finite loss, gradient or new state "
          f"(limit learner.max_nonfinite_in_a_row={limit}); stopping. {last_good(job)}")
  else:
    p.nonfinite_in_a_row = 0


def save(job: Any, step: int, force: bool) -> None:
  """Checkpoints the job at global ``step``; a non-finite state is never written (see the module docstring)."""
  try:
    job.checkpointer.save(step, job.state, {"progress": dataclasses.asdict(job.progress)},
                          config=config_record(job.config))
  except checkpoint.NonFiniteStateError:
    message = f"The state at step {step} holds NaN or inf: checkpoint not written."
    if force:
      raise NonFiniteError(f"{message} {last_good(job)}") from None
    log.warning("%s %s", message, last_good(job, hashes=False))


def load(job: Any) -> Optional[tuple[Any, dict, int]]:
  """The newest usable checkpoint of the job whose config fits: (state, extra, step), or None."""
  c, ck = job.config, job.checkpointer
  job.resume_point = ResumePoint(purge_step=min(0, 1 - c.sft.steps))  # a fresh run: new metrics, old events hidden
  if not c.checkpoint.resume or ck.latest_step() is None:
    return None
  new = config_record(c)
  shown = 0

  def show_notes() -> None:  # the checkpoints passed over, in order, before anything said about the one used
    nonlocal shown
    for line in ck.notes[shown:]:
      say(line)
    shown = len(ck.notes)

  def check(old: Optional[dict]) -> None:
    show_notes()
    if old is None:
      say(f"The newest checkpoint in {ck.directory} holds no config (written before configs were saved): "
          "the config is not compared.")
      return
    fixed, _, other = compare_configs(old, new, step_fields(job))
    if fixed:
      raise errors.ConfigError(
          f"The config does not fit the run in {job.run_dir}: it changes fields that a resumed run cannot change: "
          f"{describe(fixed)}. Resume with the run's config (its config.json, or config.json in the newest "
          "folder of checkpoints/), or start a new run folder (--run_dir).")
    if other:
      say(f"Resuming with config changes: {describe(other)}.")

  try:
    return ck.restore(job.restorable_like(job.state), check_config=check)
  finally:
    show_notes()


def continue_from(job: Any, step: int) -> None:
  """After the progress is restored: extend a finished run asked for more steps; plan the record cut."""
  c, p = job.config, job.progress
  old = flatten(job.checkpointer.restored_config or {})
  old_sft = old.get("sft.steps", c.sft.steps)
  if p.phase == "done" and p.step < job.main_steps():
    more = job.main_steps() - p.step
    say(f"Extending the finished run: {step_fields(job)[1]} {p.step} -> {job.main_steps()}, {more} more "
        f"step{'s' if more > 1 else ''}.")
    p.phase = job.main_phase
  if p.phase != "sft" and old_sft != c.sft.steps:
    say(f"sft.steps {old_sft} -> {c.sft.steps} has no effect: the warm start of this run has ended.")
  if p.phase == "sft":
    last, following = p.sft_step - old_sft, p.sft_step + 1 - c.sft.steps
  else:
    last, following = p.step, p.step + 1
  job.resume_point = ResumePoint(keep_lines=p.metrics_lines, max_step=last, purge_step=following)
  log.warning("resumed from checkpoint step %d (%s phase)", step, p.phase)
  print(f"Resumed from {job.checkpointer.directory} at step {step} ({p.phase} phase).")


def write_json(path: str, doc: Any) -> None:
  """Writes ``doc`` to ``path`` atomically (a temporary file, then a rename)."""
  tmp = f"{path}.tmp.{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(doc, f, indent=2)
  os.replace(tmp, path)


def start(job: Any) -> Optional[int]:
  """When training begins: cut ``metrics.jsonl`` back, save the config; returns TensorBoard's purge step."""
  point = job.resume_point
  removed = writers.truncate_jsonl(os.path.join(job.out_dir, "metrics.jsonl"), point.keep_lines, point.max_step)
  if removed:
    log.warning("metrics.jsonl: %d record(s) written after the checkpoint removed", removed)
  if multihost.is_main_process():
    write_json(os.path.join(job.run_dir, "config.json"), config_record(job.config))
  has_events = os.path.isdir(os.path.join(job.out_dir, "tensorboard"))
  return point.purge_step if has_events else None


def completed_summary(job: Any) -> Optional[dict]:
  """The summary of a run that is already complete at this config's steps (None: there is work to do)."""
  path = os.path.join(job.out_dir, "summary.json")
  summary = None
  if job.progress.phase == "done" and os.path.isfile(path):
    with open(path) as f:
      summary = json.load(f)
    if (summary.get("steps"), summary.get("sft_steps")) != (job.progress.step, job.progress.sft_step):
      summary = None  # the summary of an earlier end: this one still needs its outputs
  if not multihost_utils.broadcast_one_to_all(np.int32(summary is not None)):  # process 0 decides for all
    return None
  print(f"{job.config.name}: the run in {job.run_dir} is already complete ({job.progress.step} steps); nothing to "
        f"do, its outputs are unchanged. Raise {step_fields(job)[1]} to train more steps.")
  return summary or {}


def check_final(job: Any) -> None:
  """Refuses to write the outputs from a state with NaN or inf."""
  if not checkpoint.is_finite(job.state):
    raise NonFiniteError(f"The final state holds NaN or inf: hf_export/ and summary.json are not written. "
                         f"{last_good(job)}")
