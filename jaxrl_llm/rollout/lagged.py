"""Recent policy versions, and a synchronous source that samples from a stale one.

:class:`ParamsWindow` keeps the parameters of the last few policy versions
(references to the learner's immutable arrays: no copy is made, but each kept
version holds one parameter set in memory). Two users:

* :class:`LaggedSource` (``rollout.simulated_lag = k``, experimental): step t
  is sampled by the policy k versions older than the learner (the oldest
  version of a window of k + 1; fewer in the first k steps), in the learner's
  process, with the same keys as the synchronous loop. Staleness becomes a
  knob that can be studied deterministically, without Ray and at any k:
  ``rollout.simulated_lag=0`` is the synchronous run bit for bit. Unlike a
  PipelineRL run, nothing runs concurrently: it simulates the data a pipeline
  with lag k trains on, not its throughput.
* the stale consistency check (:mod:`jaxrl_llm.jobs.stale_check`), which
  recomputes log-probabilities of stale rows with the parameters of the
  version that sampled them.

Resuming a simulated-lag run restarts its window at the restored version (the
window's parameter sets are not in the checkpoint): the first k steps after a
resume are fresher than in the uninterrupted run. The tool is for staleness
studies, where that matters little; it is documented as experimental.
"""

from __future__ import annotations

import collections
from typing import Any, Callable, Optional

__all__ = ["ParamsWindow", "LaggedSource"]


class ParamsWindow:
  """The parameters of the newest ``size`` policy versions, oldest first.

  Args:
    size: versions kept (>= 1).
  """

  def __init__(self, size: int):
    if size < 1:
      raise ValueError(f"ParamsWindow: size must be >= 1; got {size}")
    self.size = int(size)
    self._params: collections.OrderedDict[int, Any] = collections.OrderedDict()

  def push(self, version: int, params: Any) -> None:
    """Adds ``params`` as ``version`` (newer than every kept one); drops the oldest beyond ``size``."""
    version = int(version)
    if self._params and version <= next(reversed(self._params)):
      if version in self._params:
        return
      raise ValueError(f"ParamsWindow.push: version {version} is older than the newest kept "
                       f"{next(reversed(self._params))}")
    self._params[version] = params
    while len(self._params) > self.size:
      self._params.popitem(last=False)

  def reset(self, version: int, params: Any) -> None:
    """Keeps only ``params`` as ``version`` (the start of a phase: older versions are not the policy's)."""
    self._params = collections.OrderedDict([(int(version), params)])

  def get(self, version: int) -> Optional[Any]:
    """The parameters of ``version``, or None when it is not kept."""
    return self._params.get(int(version))

  def oldest(self) -> tuple[int, Any]:
    """``(version, params)`` of the oldest kept version."""
    if not self._params:
      raise ValueError("ParamsWindow.oldest: the window is empty")
    version = next(iter(self._params))
    return version, self._params[version]

  @property
  def versions(self) -> list[int]:
    return list(self._params)

  def __contains__(self, version: int) -> bool:
    return int(version) in self._params


class LaggedSource:
  """Wraps a synchronous source so that each step samples with the oldest version of a window.

  Args:
    inner: a source that samples with ``sampler`` (:class:`~jaxrl_llm.rollout.sources.SyncSource`
      or its dynamic-sampling variant).
    sampler: the in-process sampler ``inner`` uses.
    window: a :class:`ParamsWindow` of size k + 1 holding at least the current version; its owner
      pushes every new version.
    prepare: applied to the learner's params before the sampler takes them.
  """

  def __init__(self, inner: Any, sampler: Any, window: ParamsWindow,
               prepare: Callable[[Any], Any] = lambda params: params):
    self.inner = inner
    self.sampler = sampler
    self.window = window
    self.prepare = prepare

  def collect(self, step: int) -> Any:
    version, params = self.window.oldest()
    if self.sampler.policy_version != version:
      self.sampler.update_weights(self.prepare(params), version)
    return self.inner.collect(step)

  def publish(self, params: Any, version: int) -> float:
    """Nothing to send: the owner of the window pushes each new version into it (the job does, after
    every update); the sampler takes a version once it is the window's oldest."""
    del params, version
    return 0.0

  def prompt_state(self, step: int) -> dict:
    return self.inner.prompt_state(step)

  def close(self) -> None:
    self.inner.close()
