"""Orbax checkpoints of the whole run state, with automatic resume.

A checkpoint at step ``s`` holds two items:

* ``state``: the :class:`~jaxrl_llm.learner.state.TrainState` pytree (params,
  optimizer state, step, RNG, policy version, critic) saved with orbax's
  standard handler, restored straight into the current shardings;
* ``extra``: a JSON document of host-side state: data-iterator positions,
  controller states (adaptive KL, adaptive clipping), curation statistics,
  counters and anything else the loop registers.

Only the last ``keep`` checkpoints are kept. Writes are atomic (orbax writes to
a temporary folder and renames), so a run killed mid-save resumes from the
previous complete checkpoint.
"""

from __future__ import annotations

import os
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp


def check_writable(path: str, what: str) -> None:
  """Fails early, naming the folder, if ``path`` cannot be created or written."""
  try:
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, f".write_probe.{os.getpid()}")  # several learner processes may probe at once
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise OSError(f"{what} {path!r} is not writable: {e.strerror or e}") from e


class Checkpointer:
  """Saves and restores ``(TrainState, extra JSON)`` pairs under one folder."""

  def __init__(self, directory: str, keep: int = 3, save_every: int = 50):
    if keep < 1:
      raise ValueError(f"checkpoint.keep={keep}: expected >= 1")
    if save_every < 1:
      raise ValueError(f"checkpoint.every={save_every}: expected >= 1")
    directory = os.path.abspath(directory)
    check_writable(directory, "checkpoint folder")
    self.directory = directory
    self.save_every = save_every
    self._manager = ocp.CheckpointManager(
        directory,
        # Synchronous saves (the next step may donate the state's buffers); with async ones our own
        # wait after each save is counted by orbax against the next save and logged as a warning.
        options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True, enable_async_checkpointing=False),
        item_names=("state", "extra"),
    )

  def latest_step(self) -> Optional[int]:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def should_save(self, step: int) -> bool:
    return step > 0 and step % self.save_every == 0

  def save(self, step: int, state: Any, extra: dict, force: bool = True) -> None:
    """Saves synchronously (the next step may donate the state's buffers).

    A checkpoint already at ``step`` (e.g. the periodic one, when the phase
    then changes at the same step) is replaced.
    """
    if step in self._manager.all_steps():
      self._manager.delete(step)
    self._manager.save(
        step,
        args=ocp.args.Composite(state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(extra)),
        force=force,
    )
    self._manager.wait_until_finished()

  def restore(self, state_like: Any, step: Optional[int] = None) -> tuple[Any, dict, int]:
    """Restores the latest (or given) step into the shardings of ``state_like``.

    Args:
      state_like: a TrainState with the target structure and shardings (values
        are ignored); typically the freshly initialised state.
      step: which step; default the latest.

    Returns:
      (state, extra, step).
    """
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, state_like)
    restored = self._manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), extra=ocp.args.JsonRestore()))
    return restored["state"], dict(restored["extra"] or {}), step

  def close(self) -> None:
    self._manager.wait_until_finished()
    self._manager.close()
