"""The collect stage's source of samples, made from the config, and the pipeline's checkpoint slot.

``rollout.mode`` and ``data.dynamic_sampling`` choose the source
(:mod:`jaxrl_llm.rollout.sources`):

* ``"sync"``: :class:`~jaxrl_llm.rollout.sources.SyncSource` (the in-process
  JAX sampler), or :class:`~jaxrl_llm.rollout.sources.DynamicSamplingSource`
  (DAPO's extra rounds); with ``rollout.simulated_lag = k`` wrapped in a
  :class:`~jaxrl_llm.rollout.lagged.LaggedSource` that samples with the policy
  k versions old;
* ``"pipeline"``: a Ray sampler pool behind a
  :class:`~jaxrl_llm.rollout.sources.PipelineSource` (PipelineRL within
  ``rollout.max_lag`` versions; ``rollout.exact_versions`` for a deterministic
  schedule).

A pipeline's state (work dispatched ahead of the learner, sampled chunks not
yet trained on) is checkpointed through :class:`SourceFactory`'s
``get_state``/``set_state`` (the job registers it as the "pipeline" slot). The
source is made at the first RL step after a restore, so a restored state is
held until then and handed to the new source.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from jaxrl_llm.learner import multihost
from jaxrl_llm.rollout import sources
from jaxrl_llm.rollout.lagged import LaggedSource, ParamsWindow
from jaxrl_llm.sampling.vllm_engine import VllmEngineConfig
from jaxrl_llm.tasks import curation

__all__ = ["SourceFactory", "vllm_engine_config"]


def vllm_engine_config(config: Any) -> VllmEngineConfig:
  """The vLLM engine of each sampler actor from ``sampler.vllm.*`` and ``rollout.weight_transport``."""
  v, r = config.sampler.vllm, config.rollout
  return VllmEngineConfig(
      tensor_parallel_size=v.tensor_parallel_size, dtype=None if v.dtype == "auto" else v.dtype,
      gpu_memory_utilization=v.gpu_memory_utilization, enforce_eager=v.enforce_eager,
      enable_prefix_caching=v.enable_prefix_caching, max_model_len=v.max_model_len or None,
      seed=config.seed if v.seed < 0 else v.seed, transport=r.weight_transport,
      bucket_bytes=r.weight_bucket_mb * 2**20)


class SourceFactory:
  """Makes the RL phase's :class:`~jaxrl_llm.rollout.sources.RolloutSource` from the config.

  Args:
    config: the run config.
    model_config, sampler_config, tokenizer: the policy's (the pool's actors build samplers from them).
    prompts: the prompt stream.
    encode_prompt: prompt text -> ids.
    score: the reward stage (dynamic sampling scores its rounds itself).
    versions: the window of recent parameter versions (simulated lag).
    run_dir: the run folder (a vLLM pool's initial HF export goes there).
    episodes: the multi-turn episode runner (``config.env``), or None for single-turn rows.
    episode_builder: a picklable ``() -> EpisodeRunner`` for the pipeline's sampler actors.
  """

  def __init__(self, config: Any, *, model_config: Any, sampler_config: Any, tokenizer: Any, prompts: Any,
               encode_prompt: Callable[[str], list[int]], score: Any, versions: ParamsWindow, run_dir: str,
               episodes: Any = None, episode_builder: Any = None):
    self.config = config
    self.episodes, self.episode_builder = episodes, episode_builder
    self.model_config, self.sampler_config, self.tokenizer = model_config, sampler_config, tokenizer
    self.prompts, self.encode_prompt, self.score = prompts, encode_prompt, score
    self.versions = versions
    self.run_dir = run_dir
    self.source: Any = None
    self.held: Optional[dict] = None  # a restored pipeline state, until the source exists

  def make(self, params: Any, version: int, step: int, sampler: Any, max_lag: int) -> sources.RolloutSource:
    """The source for an RL phase starting at ``step`` with ``params`` of ``version``.

    Args:
      params: the learner's parameters.
      version: their policy version.
      step: the RL step the phase (re)starts at.
      sampler: the in-process sampler (synchronous modes).
      max_lag: the pipeline's staleness window (the controller's, when it runs).
    """
    c = self.config
    if c.rollout.mode == "pipeline":
      self.source = self._pipeline(params, version, step, max_lag)
    else:
      self.source = self._synchronous(sampler)
      if c.rollout.simulated_lag:
        self.source = LaggedSource(self.source, sampler, self.versions, prepare=multihost.local_copy)
    return self.source

  def _synchronous(self, sampler: Any) -> sources.RolloutSource:
    c = self.config
    if self.episodes is not None:
      from jaxrl_llm.jobs.episodes import EpisodeSource  # pylint: disable=import-outside-toplevel
      return EpisodeSource(sampler, self.prompts, self.episodes, c.seed, c.rl.samples_per_prompt,
                           prepare=multihost.local_copy)
    if c.data.dynamic_sampling:
      return sources.DynamicSamplingSource(
          sampler, self.prompts, self.encode_prompt, c.seed, score=self.score, groups=c.rl.prompts_per_step,
          group_size=c.rl.samples_per_prompt, max_rounds=c.data.max_rounds,
          collector_factory=curation.InformativeGroupCollector, pad_id=self.model_config.pad_token_id,
          prepare=multihost.local_copy)
    return sources.SyncSource(sampler, self.prompts, self.encode_prompt, c.seed, prepare=multihost.local_copy)

  def _pipeline(self, params: Any, version: int, step: int, max_lag: int) -> sources.PipelineSource:
    c = self.config
    pool = sources.start_sampler_pool(
        model_config=self.model_config, sampler_config=self.sampler_config, tokenizer=self.tokenizer,
        params=params, version=version, num_samplers=c.rollout.num_samplers, kind=c.sampler.kind,
        segment_tokens=c.rollout.segment_tokens, address=c.rollout.address, actor_cpus=c.rollout.actor_cpus,
        export_dir=sources.hf_export_dir(self.run_dir),
        keep_versions=c.rollout.max_lag + 1 if c.rollout.exact_versions else 1, platform=c.sampler.platform,
        engine=vllm_engine_config(c), local_gpus=c.rollout.local_gpus, actor_gpus=c.rollout.actor_gpus,
        episodes=self.episode_builder if self.episodes is not None else None)
    source = sources.PipelineSource(pool, self.prompts, self.encode_prompt, c.seed, start_step=step,
                                    base_version=version, group_size=c.rl.samples_per_prompt, max_lag=max_lag,
                                    chunks_per_step=c.rollout.chunks_per_step or c.rollout.num_samplers,
                                    pad_id=self.model_config.pad_token_id, exact_versions=c.rollout.exact_versions,
                                    episodes=self.episodes is not None)
    if self.held is not None:  # resumed: the checkpoint's sampled, untrained chunks
      try:
        source.set_state(self.held)
      except Exception:
        source.close()
        raise
      self.held = None
    return source

  # ------------------------------------------------------------------ checkpoint slot "pipeline"

  def get_state(self) -> Optional[dict]:
    """The pipeline's dispatched, sampled and untrained work (the source drains first), or None
    outside pipeline mode; before the source exists, the restored state still waiting for it."""
    if self.source is None:
      return self.held
    return self.source.get_state() if isinstance(self.source, sources.PipelineSource) else None

  def set_state(self, state: Optional[dict]) -> None:
    # Handed to the source made at the first RL step after the restore; the source also draws the
    # restored steps' prompts again, so the stream continues after the last dispatched step.
    self.held = state
