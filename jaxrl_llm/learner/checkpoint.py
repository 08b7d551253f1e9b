"""Verified checkpoints of the whole run state: a checksum manifest written last, fallback, atomic replace.

A checkpoint of global step ``s`` is the folder ``<directory>/<s>/``: ``state/``
(the TrainState pytree, orbax's standard handler, restored straight into the
shardings of the current state), ``extra/`` (JSON host state: progress,
iterator positions, controllers, counters), ``config.json`` (the run config,
compared on resume by :mod:`jaxrl_llm.jobs.resume`) and, written last,
``manifest.json`` (size and sha256 of every file: :mod:`jaxrl_llm.learner.manifest`).

Saving: the folder is probed for writability (an unwritable one fails at once,
naming it); the state must be finite (one jitted reduction; else
:class:`NonFiniteStateError` and nothing is written); orbax writes
``.pending-<s>`` (via its own temporary folder); process 0 adds the config and
the manifest and publishes by rename. A checkpoint already at ``s`` is replaced
with no moment holding neither: ``<s>`` -> ``.old-<s>``, ``.pending-<s>`` ->
``<s>``, delete ``.old-<s>`` (a crash between the renames is repaired on the
next restore or save). The newest ``keep`` are kept; steps ahead of the one just
saved (an abandoned timeline, e.g. ``checkpoint.resume=False``) go to ``quarantine/``.

Restoring (no step given), newest first: a checkpoint whose files do not match
its manifest (sizes; sha256 when ``verify``), or whose arrays are not finite, is
moved to ``quarantine/<s>`` and the previous one is tried, one line each in
:attr:`Checkpointer.notes`. One without a manifest (written before manifests) is
accepted unverified, with a note, if it loads and is finite; one that does not
load is skipped and left in place. None usable: a :class:`CheckpointError`
naming the folder. With several processes, process 0 verifies and chooses.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from jaxrl_llm.errors import RunError
from jaxrl_llm.learner.manifest import MANIFEST, verify_folder, write_manifest
from jaxrl_llm.learner.update import all_finite

__all__ = ["CheckpointError", "Checkpointer", "NonFiniteStateError", "UnwritableError", "check_writable", "is_finite"]

CONFIG = "config.json"
QUARANTINE = "quarantine"


class CheckpointError(RunError):
  """No usable checkpoint, or a checkpoint that does not fit the state of this run."""


class UnwritableError(OSError, RunError):
  """A folder of the run cannot be written (raised before anything is written to it)."""


class NonFiniteStateError(CheckpointError):
  """The state to save holds NaN or inf: it is not written."""


def check_writable(path: str, what: str) -> None:
  """Fails early, naming the folder, if ``path`` cannot be created or written."""
  try:
    os.makedirs(path, exist_ok=True)
    probe = os.path.join(path, f".write_probe.{os.getpid()}")  # several learner processes may probe at once
    with open(probe, "w") as f:
      f.write("ok")
    os.remove(probe)
  except OSError as e:
    raise UnwritableError(f"{what} {path!r} is not writable: {e.strerror or e}") from None


_finite = jax.jit(all_finite)


def is_finite(tree: Any) -> bool:
  """Whether every floating array of ``tree`` is finite (one jitted reduction, on device)."""
  leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
  return True if not leaves else bool(_finite(leaves))


def _fit_optional(like: Any, disk: Any) -> Any:
  """``like`` with None wherever the saved tree holds None (an optional part not present when it was saved,
  e.g. the reference policy of a checkpoint taken during the warm start)."""
  if disk is None:
    return None
  if isinstance(disk, dict) and dataclasses.is_dataclass(like):
    return dataclasses.replace(like, **{f.name: _fit_optional(getattr(like, f.name), disk[f.name])
                           for f in dataclasses.fields(like) if f.name in disk})
  if isinstance(disk, dict) and isinstance(like, dict):
    return {k: _fit_optional(v, disk[k]) if k in disk else v for k, v in like.items()}
  return like


def _saved_tree(path: str) -> Any:
  try:
    return ocp.StandardCheckpointHandler().metadata(epath.Path(path) / "state").tree
  except Exception:  # pylint: disable=broad-except
    return ...  # unknown: the restore itself reports what does not fit


def _one_line(e: BaseException, limit: int = 300) -> str:
  text = " ".join(line.strip() for line in str(e).splitlines()[:6] if line.strip())
  return f"{type(e).__name__}: {text[:limit]}"


class Checkpointer:
  """Saves and restores ``(TrainState, extra JSON, config)`` under one folder, verified by manifests.

  Args:
    directory: the checkpoint folder (created; must be writable).
    keep: checkpoints kept (the newest).
    save_every: :meth:`should_save` is true every this many steps.
    verify: check sha256 of every file on restore (sizes are always checked).
  """

  def __init__(self, directory: str, keep: int = 3, save_every: int = 50, verify: bool = True):
    if keep < 1:
      raise ValueError(f"checkpoint.keep={keep}: expected >= 1")
    if save_every < 1:
      raise ValueError(f"checkpoint.every={save_every}: expected >= 1")
    directory = os.path.abspath(directory)
    check_writable(directory, "checkpoint folder")
    self.directory = directory
    self.keep = keep
    self.save_every = save_every
    self.verify = verify
    self.notes: list[str] = []  # one line per checkpoint passed over by the last restore
    self._passed: list[str] = []
    self.restored_config: Optional[dict] = None  # the config saved with the last restored checkpoint
    self._ckptr = ocp.Checkpointer(ocp.CompositeCheckpointHandler())
    self._syncs = 0
    self._cleaned = False

  # ------------------------------------------------------------------ folders

  def _path(self, step: int) -> str:
    return os.path.join(self.directory, str(step))

  def all_steps(self) -> list[int]:
    """Published checkpoint steps, oldest first (not verified)."""
    return sorted(int(n) for n in os.listdir(self.directory) if n.isdigit() and os.path.isdir(self._path(int(n))))

  def latest_step(self) -> Optional[int]:
    steps = self.all_steps() + self._recoverable()
    return max(steps) if steps else None

  def should_save(self, step: int) -> bool:
    return step > 0 and step % self.save_every == 0

  def _sync(self) -> None:
    self._syncs += 1
    ocp.multihost.sync_global_processes(f"jaxrl_llm_checkpoint_{self._syncs}")

  def _recoverable(self) -> list[int]:
    """Steps whose folder is missing but whose replacement left a complete copy behind."""
    names = set(os.listdir(self.directory))
    steps = set()
    for kind, name in ((k, n) for n in names for k in (".old-", ".pending-") if n.startswith(k)):
      step = name[len(kind):]
      if step.isdigit() and step not in names and (kind == ".old-" or MANIFEST in os.listdir(
          os.path.join(self.directory, name))):
        steps.add(int(step))
    return sorted(steps)

  def _recover(self, remove_temporary: bool) -> None:
    """Repairs a replacement cut between its two renames; then drops leftovers (process 0)."""
    for step in self._recoverable():
      pending, old = (os.path.join(self.directory, f"{p}-{step}") for p in (".pending", ".old"))
      if os.path.exists(os.path.join(pending, MANIFEST)):  # complete: the newer of the two
        os.rename(pending, self._path(step))
      elif os.path.isdir(old):
        os.rename(old, self._path(step))
    if remove_temporary:
      for name in os.listdir(self.directory):
        if name.startswith((".old-", ".pending-")) or ".orbax-checkpoint-tmp" in name:
          shutil.rmtree(os.path.join(self.directory, name), ignore_errors=True)

  def quarantine(self, step: int, reason: str) -> str:
    """Moves checkpoint ``step`` to ``quarantine/`` (process 0); returns where it went, or why it stayed."""
    if jax.process_index() != 0:
      return os.path.join(self.directory, QUARANTINE)
    target = os.path.join(self.directory, QUARANTINE, str(step))
    n = 1
    while os.path.exists(target):
      target, n = os.path.join(self.directory, QUARANTINE, f"{step}.{n}"), n + 1
    try:
      os.makedirs(os.path.dirname(target), exist_ok=True)
      os.rename(self._path(step), target)
      with open(target + ".reason.txt", "w") as f:
        f.write(reason + "\n")
      return target
    except OSError as e:
      return f"left in place ({e.strerror or e})"

  # ------------------------------------------------------------------ save

  def save(self, step: int, state: Any, extra: dict, config: Optional[dict] = None) -> None:
    """Saves synchronously, verified and atomically; a checkpoint already at ``step`` is replaced.

    Raises:
      OSError: the folder is not writable (probed first, naming it).
      NonFiniteStateError: ``state`` holds NaN or inf (nothing is written).
    """
    check_writable(self.directory, "checkpoint folder")
    if not is_finite(state):
      raise NonFiniteStateError(f"the state at step {step} holds NaN or inf; checkpoint not written")
    primary = jax.process_index() == 0
    if primary and not self._cleaned:
      self._recover(remove_temporary=True)
      self._cleaned = True
    pending = os.path.join(self.directory, f".pending-{step}")
    self._ckptr.save(pending, args=ocp.args.Composite(state=ocp.args.StandardSave(state),
                                                      extra=ocp.args.JsonSave(extra)), force=True)
    if primary:
      digest = None
      if config is not None:
        text = json.dumps(config, indent=1, sort_keys=True)
        digest = hashlib.sha256(text.encode()).hexdigest()
        with open(os.path.join(pending, CONFIG), "w") as f:
          f.write(text)
      write_manifest(pending, step, digest)
      final = self._path(step)
      if os.path.exists(final):
        old = os.path.join(self.directory, f".old-{step}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(pending, final)
        shutil.rmtree(old, ignore_errors=True)
      else:
        os.rename(pending, final)
      self._prune(step)
    self._sync()

  def _prune(self, saved: int) -> None:
    steps = self.all_steps()
    for s in steps:
      if s > saved:
        self.quarantine(s, f"ahead of step {saved}, saved later by a run that did not resume from it")
    older = [s for s in steps if s < saved]
    for s in older[:max(0, len(older) - (self.keep - 1))]:
      shutil.rmtree(self._path(s), ignore_errors=True)

  # ------------------------------------------------------------------ restore

  def read_config(self, step: int) -> Optional[dict]:
    """The config saved with checkpoint ``step`` (None before configs were saved)."""
    path = os.path.join(self._path(step), CONFIG)
    if not os.path.exists(path):
      return None
    with open(path) as f:
      return json.load(f)

  def newest_good_step(self, hashes: bool = True) -> Optional[int]:
    """The newest checkpoint whose manifest verifies (so saved finite); None when there is none."""
    for step in reversed(self.all_steps()):
      if verify_folder(self._path(step), step, hashes)[0] == "ok":
        return step
    return None

  def _choose(self, skip: set[int]) -> tuple[int, str]:
    """Process 0 verifies newest first (quarantining the bad); every process gets its choice."""
    choice, status = -1, ""
    if jax.process_index() == 0:
      self._recover(remove_temporary=False)
      for step in reversed(self.all_steps()):
        if step in skip:
          continue
        status, reason = verify_folder(self._path(step), step, self.verify)
        if status != "bad":
          choice = step
          break
        skip.add(step)
        self._pass_over(step, f"fails verification ({reason})")
    choice = int(multihost_utils.broadcast_one_to_all(np.int32(choice)))
    if choice >= 0 and jax.process_index() != 0:
      status = "ok" if os.path.exists(os.path.join(self._path(choice), MANIFEST)) else "legacy"
    return choice, status

  def _pass_over(self, step: int, why: str, move: bool = True) -> None:
    where = self.quarantine(step, why) if move else "left in place"
    where = where if where.startswith("left") else f"moved to {where}"
    self._passed.append(f"step {step} {why}: {where}")
    self.notes.append(f"Checkpoint step {step} in {self.directory} {why}: {where}; trying the previous one.")

  def restore(self, state_like: Any, step: Optional[int] = None,
              check_config: Optional[Callable[[Optional[dict]], None]] = None) -> tuple[Any, dict, int]:
    """Restores the newest usable (or the given) checkpoint into the shardings of ``state_like``.

    Args:
      state_like: a TrainState (or run state) with the target structure and
        shardings (values are ignored); typically the freshly initialised state.
      step: which step (verified, no fallback); default the newest usable one.
      check_config: called with the checkpoint's saved config (None if it has
        none) before its arrays are read; raises to refuse it.

    Returns:
      (state, extra, step); :attr:`notes` lists the checkpoints passed over,
      :attr:`restored_config` the config saved with the one restored.

    Raises:
      FileNotFoundError: no checkpoint at all.
      CheckpointError: none usable (one paragraph naming the folder), or the
        chosen one does not fit ``state_like``.
    """
    self.notes, self._passed = [], []
    if self.latest_step() is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    skip: set[int] = set()
    while True:
      if step is None:
        chosen, status = self._choose(skip)
      else:
        status, reason = verify_folder(self._path(step), step, self.verify)
        if status == "bad":
          raise CheckpointError(f"checkpoint step {step} in {self.directory} fails verification ({reason})")
        chosen = step
      if chosen < 0:
        moved = all(" moved to " in p for p in self._passed)
        raise CheckpointError(
            f"No usable checkpoint in {self.directory}: {'; '.join(self._passed)}. " +
            ("A rerun starts the run from the beginning (the unusable checkpoints stay in quarantine/), or put a "
             "good checkpoint folder back." if moved else "Resume with the config they were saved with, or move "
             "them out of the folder to start the run from the beginning."))
      config = self.read_config(chosen)
      if check_config is not None:
        check_config(config)
      disk = _saved_tree(self._path(chosen))
      abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct,
                              state_like if disk is ... else _fit_optional(state_like, disk))
      try:
        restored = self._ckptr.restore(self._path(chosen), args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), extra=ocp.args.JsonRestore()))
      except Exception as e:  # pylint: disable=broad-except
        if (status == "ok" and self.verify) or step is not None:  # every byte as written: a mismatch
          raise CheckpointError(
              f"checkpoint step {chosen} in {self.directory} is intact but does not fit the state this config "
              f"builds ({_one_line(e)}); resume with the config it was saved with (its config.json), or start a "
              "new run folder.") from None
        self._pass_over(chosen, f"cannot be loaded ({_one_line(e)})", move=False)
        skip.add(chosen)
        continue
      if not is_finite(restored["state"]):
        if step is not None:
          raise CheckpointError(f"checkpoint step {chosen} in {self.directory} holds NaN or inf")
        skip.add(chosen)
        self._pass_over(chosen, "holds NaN or inf")
        self._sync()
        continue
      if status == "legacy":
        self.notes.append(f"Checkpoint step {chosen} in {self.directory} has no manifest (written before "
                          "checkpoints were verified): loaded unverified; its arrays are finite.")
      self.restored_config = config
      return restored["state"], dict(restored["extra"] or {}), chosen

  def close(self) -> None:
    self._ckptr.close()
