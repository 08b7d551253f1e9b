"""Where an RL step's samples come from: the ``RolloutSource`` protocol and its three sources.

The RL job asks its source for the samples of step ``t`` (``collect(t)``),
trains on them, then hands the new weights back (``publish``). What happens in
between is the source's business:

* :class:`SyncSource` samples in the learner's process, between updates, with
  the current weights (``rollout.mode="sync"``);
* :class:`DynamicSamplingSource` is the synchronous source with DAPO's dynamic
  sampling (Yu et al., arXiv:2503.14476): rounds of prompts are sampled and
  scored until the step has ``rl.prompts_per_step`` groups whose rewards differ
  (``data.dynamic_sampling``);
* :class:`PipelineSource` runs Ray sampler actors up to ``rollout.max_lag``
  policy versions ahead of the learner (PipelineRL, Piché et al.,
  arXiv:2509.19128; see :mod:`jaxrl_llm.rollout.pipeline`).

Every source draws its prompts from a prompt stream (``PromptSource`` or a
curated one) in step order, and samples step ``t`` with :func:`sampling_key`
``(seed, t)``, so a resumed run and the pipeline with k = 0 sample what the
uninterrupted synchronous run would.

Dimensions: G prompts per step, n samples per prompt, B = G * n rows.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from typing import Any, Callable, Optional, Protocol, Sequence

import jax
import numpy as np

from jaxrl_llm.types import Trajectory, concat_trajectories

__all__ = ["Rollout", "RolloutSource", "SyncSource", "DynamicSamplingSource", "PipelineSource", "sampling_key",
           "start_sampler_pool"]

log = logging.getLogger("jaxrl_llm")

# ``score(examples, trajectory, response_tokens) -> (rewards float32 [B], metrics)``.
ScoreFn = Callable[[Sequence[Any], Trajectory, Sequence[Sequence[int]]], tuple[np.ndarray, dict]]


@dataclasses.dataclass
class Rollout:
  """The samples of one RL step.

  Attributes:
    examples: the G task examples, in row order (row i answers ``examples[i // n]``).
    trajectory: B rows (numpy Trajectory; behaviour log-probabilities and the
      policy version of every token recorded at sampling time).
    response_tokens: per row, the sampled ids (EOS included when sampled).
    sample_seconds: seconds spent sampling (the longest chunk in the pipeline).
    rewards: float32 [B] when the source already scored the rows (dynamic
      sampling scores every round), else None.
    reward_metrics: the scorer's metrics when ``rewards`` is set.
    metrics: the source's own metrics (``time/wait_s``, ``pipeline/*``, ``data/dynamic_*``).
  """

  examples: list
  trajectory: Trajectory
  response_tokens: list
  sample_seconds: float
  rewards: Optional[np.ndarray] = None
  reward_metrics: dict = dataclasses.field(default_factory=dict)
  metrics: dict = dataclasses.field(default_factory=dict)


class RolloutSource(Protocol):
  """What the RL job needs from a source of samples."""

  def collect(self, step: int) -> Rollout:
    """The samples of RL step ``step`` (0-based, counted over the whole run)."""

  def publish(self, params: Any, version: int) -> float:
    """Makes ``params`` (policy ``version``) the weights of future samples; returns seconds spent."""

  def prompt_state(self, step: int) -> dict:
    """The prompt stream's state to checkpoint once step ``step`` is trained (resume point)."""

  def close(self) -> None:
    """Releases actors and threads."""


def sampling_key(seed: int, step: int) -> jax.Array:
  """The sampling key of RL step ``step``: a function of (seed, step) only."""
  return jax.random.fold_in(jax.random.PRNGKey(seed), step)


class SyncSource:
  """Samples each step in the learner's process with the in-process sampler.

  Args:
    sampler: a :class:`jaxrl_llm.sampling.Sampler` (generate / update_weights / policy_version).
    prompts: the prompt stream (``next_batch()``, ``get_state()``).
    encode: prompt text -> token ids (chat template applied when configured).
    seed: the run's seed (for :func:`sampling_key`).
    prepare: applied to the learner's params before the sampler takes them
      (e.g. a whole local copy of mesh-sharded arrays).
  """

  def __init__(self, sampler: Any, prompts: Any, encode: Callable[[str], list[int]], seed: int,
               prepare: Callable[[Any], Any] = lambda params: params):
    self.sampler = sampler
    self.prompts = prompts
    self.encode = encode
    self.seed = seed
    self.prepare = prepare

  def collect(self, step: int) -> Rollout:
    pb = self.prompts.next_batch()
    t0 = time.perf_counter()
    result = self.sampler.generate([self.encode(e.prompt) for e in pb.examples], rng=sampling_key(self.seed, step))
    seconds = time.perf_counter() - t0
    return Rollout(list(pb.examples), result.trajectory, list(result.response_tokens), seconds,
                   metrics={"time/wait_s": seconds})

  def publish(self, params: Any, version: int) -> float:
    t0 = time.perf_counter()
    if self.sampler.policy_version != version:
      self.sampler.update_weights(self.prepare(params), version)
    return time.perf_counter() - t0

  def prompt_state(self, step: int) -> dict:
    return self.prompts.get_state()

  def close(self) -> None:
    pass


class DynamicSamplingSource(SyncSource):
  """Synchronous sampling in rounds until ``G`` groups with unequal rewards are collected.

  Round r of step t samples ``G`` fresh prompts with ``fold_in(sampling_key(t), r)``
  (round 0: the key itself), so the rounds are a function of (seed, step). After
  ``max_rounds`` rounds zero-variance groups pad the batch (counted in
  ``data/dynamic_padded_groups``).

  Args:
    score: scores one round (and records pass rates with a curated prompt stream).
    groups: G, the groups the step needs.
    group_size: n samples per prompt.
    max_rounds: sampling rounds at most.
    collector_factory: ``(G, n, max_rounds) -> collector`` with ``add(rewards)``,
      ``done`` and ``result()`` (:class:`jaxrl_llm.tasks.curation.InformativeGroupCollector`).
  """

  def __init__(self, sampler: Any, prompts: Any, encode: Callable[[str], list[int]], seed: int, *,
               score: ScoreFn, groups: int, group_size: int, max_rounds: int, collector_factory: Callable[..., Any],
               pad_id: int, prepare: Callable[[Any], Any] = lambda params: params):
    super().__init__(sampler, prompts, encode, seed, prepare)
    self.score = score
    self.groups, self.group_size, self.max_rounds = groups, group_size, max_rounds
    self.collector_factory = collector_factory
    self.pad_id = pad_id

  def collect(self, step: int) -> Rollout:
    n = self.group_size
    collector = self.collector_factory(self.groups, n, max_rounds=self.max_rounds)
    trajectories, responses, examples, rewards, reward_metrics = [], [], [], [], {}
    t0 = time.perf_counter()
    key = sampling_key(self.seed, step)
    while not collector.done:
      pb = self.prompts.next_batch()
      rng = key if not trajectories else jax.random.fold_in(key, len(trajectories))
      result = self.sampler.generate([self.encode(e.prompt) for e in pb.examples], rng=rng)
      round_rewards, reward_metrics = self.score(pb.examples, result.trajectory.trimmed(multiple=8),
                                                 result.response_tokens)
      trajectories.append(result.trajectory)
      responses += list(result.response_tokens)
      examples += list(pb.examples)
      rewards.append(round_rewards)
      collector.add(round_rewards)
    out = collector.result()
    rows = np.asarray(out.rows_b)
    seconds = time.perf_counter() - t0
    return Rollout([examples[int(r) // n] for r in rows[::n]],
                   concat_trajectories(trajectories, self.pad_id).take(rows), [responses[int(r)] for r in rows],
                   seconds, rewards=np.concatenate(rewards)[rows], reward_metrics=reward_metrics,
                   metrics={"time/wait_s": seconds, **out.metrics()})


def start_sampler_pool(*, model_config: Any, sampler_config: Any, tokenizer: Any, params: Any, version: int,
                       num_samplers: int, kind: str = "jax", segment_tokens: int = 0, address: str = "",
                       actor_cpus: float = 1.0, export_dir: str = "",
                       latest_version: Optional[Callable[[], int]] = None, keep_versions: int = 1,
                       platform: str = "cpu", engine: Any = None, local_gpus: str = "auto",
                       actor_gpus: float = -1.0, episodes: Any = None) -> Any:
  """Starts a :class:`~jaxrl_llm.rollout.SamplerPool` whose chunks are validated against this run.

  Every chunk is checked (:func:`~jaxrl_llm.rollout.validate_chunk`) against the
  tokenizer/model fingerprint, the vocabulary and the newest published version.
  ``kind="vllm"`` engines start from a Hugging Face folder of ``params``
  written to ``export_dir``. ``keep_versions``: weight versions each actor
  keeps for exact-version items (``rollout.max_lag + 1`` with
  ``rollout.exact_versions``). ``platform``: where JAX sampler actors run; ``engine``:
  the vLLM engines' :class:`~jaxrl_llm.sampling.vllm_engine.VllmEngineConfig`;
  ``local_gpus``: the GPUs a local cluster offers (see :class:`~jaxrl_llm.rollout.SamplerPool`);
  ``actor_gpus``: ``rollout.actor_gpus``; ``episodes``: a picklable ``() -> EpisodeRunner`` when the
  actors play multi-turn episodes (``SamplerSpec.episodes``).
  Each actor's placement and engine arguments are logged once the actors are up and kept as
  ``pool.placement`` (the run's summary.json reports them).
  """
  from jaxrl_llm import bridge, rollout  # Ray is imported only when a pool starts

  fingerprint = bridge.make_fingerprint(tokenizer, model_config)
  model_path = ""
  if kind == "vllm":
    model_path = str(bridge.export_hf_checkpoint(params, model_config, export_dir, tokenizer=tokenizer))
  spec = rollout.SamplerSpec(model_config=model_config, sampler_config=sampler_config,
                             fingerprint=fingerprint.to_dict(), kind=kind, segment_tokens=segment_tokens,
                             model_path=model_path, keep_versions=keep_versions, platform=platform,
                             engine=engine, actor_gpus=actor_gpus, episodes=episodes)
  vocab = model_config.vocab_size
  holder: dict[str, Any] = {}
  newest = latest_version or (lambda: holder["pool"].published_version)
  pool = rollout.SamplerPool(
      spec, params, version, num_samplers=num_samplers, address=address or None, actor_cpus=actor_cpus,
      local_gpus=local_gpus,
      validate=lambda chunk: rollout.validate_chunk(chunk, fingerprint=fingerprint, vocab_size=vocab,
                                                    latest_version=newest()))
  holder["pool"] = pool
  pool.placement = pool.describe()
  for actor in pool.placement:
    log.info("sampler actor %s (%s): GPUs %s, CUDA_VISIBLE_DEVICES=%r%s", actor["sampler_id"], actor["kind"],
             actor["gpu_ids"] or "none", actor["cuda_visible_devices"],
             f", engine {actor['engine_kwargs']}, weight transport {actor['weight_transport']}"
             if actor["engine_kwargs"] else f", JAX_PLATFORMS={actor['jax_platforms']}")
  return pool


class PipelineSource:
  """Ray sampler actors ahead of the learner, within a staleness bound (PipelineRL).

  Wraps a :class:`~jaxrl_llm.rollout.SamplerPool` and a
  :class:`~jaxrl_llm.rollout.PipelineFeeder` (see there for the staleness
  rule and exact versions). Prompts are drawn from the stream in data-step
  order; the stream state checkpointed after step t (:meth:`prompt_state`) is
  the one right after step t's prompts (a plain stream); a curated stream
  (one that records outcomes) replays its drawn-but-unrecorded batches
  itself, so its own state is checkpointed.

  The work dispatched beyond step t is checkpointed too (:meth:`get_state`,
  the job's ``pipeline`` slot): the feeder drains, and the state holds the
  sampled chunks of steps t+1..t+k with their work items. :meth:`set_state`
  on a resumed run's new source puts them back ready to train on, and draws
  those steps' prompts from the restored stream again (checking that they
  are the ones that were sampled), so the stream continues after the last
  *dispatched* step and nothing is sampled twice.

  Args:
    pool: the started sampler pool (:func:`start_sampler_pool`).
    prompts, encode, seed: as for :class:`SyncSource`.
    start_step: the RL step the run resumes at (data step 0 of the feeder).
    base_version: the policy version before ``start_step``'s update.
    group_size, max_lag, chunks_per_step: the feeder's settings.
    pad_id: padding id of the concatenated chunks.
    exact_versions: sample data step s with exactly version ``base + max(0, s - k)``
      (the pool's actors must keep ``max_lag + 1`` versions).
    episodes: the actors play multi-turn episodes: work items carry the examples and
      the rows come scored (``Rollout.rewards``, ``env/*`` metrics).
  """

  def __init__(self, pool: Any, prompts: Any, encode: Callable[[str], list[int]], seed: int, *, start_step: int,
               base_version: int, group_size: int, max_lag: int, chunks_per_step: int, pad_id: int,
               exact_versions: bool = False, episodes: bool = False):
    from jaxrl_llm import rollout

    self.pool = pool
    self.prompts = prompts
    self.encode = encode
    self.seed = seed
    self.start_step = start_step
    self.pad_id = pad_id
    self.episodes = bool(episodes)
    self._examples: dict[int, list] = {}
    self._stream_after: dict[int, dict] = {}
    self._replays = callable(getattr(prompts, "record", None))
    self._resume_stream: Optional[dict] = None  # the last prompt_state(): the stream before the untrained steps
    self.feeder = rollout.PipelineFeeder(pool, self._step_prompts, num_samples=group_size, max_lag=max_lag,
                                         base_version=base_version, chunks_per_step=chunks_per_step,
                                         exact_versions=exact_versions)

  @property
  def max_lag(self) -> int:
    return self.feeder.max_lag

  @max_lag.setter
  def max_lag(self, value: int) -> None:
    """The staleness window (the off-policy controller narrows and widens it)."""
    self.feeder.max_lag = int(value)

  def _step_prompts(self, s: int):
    pb = self.prompts.next_batch()
    self._examples[s] = list(pb.examples)
    self._stream_after[s] = self.prompts.get_state()
    key = np.asarray(sampling_key(self.seed, self.start_step + s))
    ids = [self.encode(e.prompt) for e in pb.examples]
    return (ids, key, list(pb.examples)) if self.episodes else (ids, key)

  def collect(self, step: int) -> Rollout:
    from jaxrl_llm import rollout

    s = step - self.start_step
    t0 = time.perf_counter()
    chunks = self.feeder.take(s)
    waited = time.perf_counter() - t0
    traj, responses = rollout.concat_chunks(chunks, self.pad_id)
    metrics = {"time/wait_s": waited, **self.feeder.metrics(),
               "pipeline/sampler_busy_s": float(sum(ch.sample_seconds for ch in chunks))}
    rewards, stats = rollout.concat_episode_fields(chunks) if self.episodes else (None, None)
    reward_metrics = {}
    if self.episodes:
      if rewards is None:
        raise RuntimeError(f"pipeline step {step}: the sampler actors returned unscored rows; the pool's actors "
                           "must play episodes (SamplerSpec.episodes) when env.name is set")
      from jaxrl_llm.envs.episodes import episode_metrics, reward_figures  # pylint: disable=import-outside-toplevel
      metrics.update(episode_metrics(stats, traj))
      reward_metrics = reward_figures(rewards)
    return Rollout(self._examples.pop(s), traj, responses, max(ch.sample_seconds for ch in chunks),
                   rewards=rewards, reward_metrics=reward_metrics, metrics=metrics)

  def publish(self, params: Any, version: int) -> float:
    return self.pool.publish(params, version) if version > self.pool.published_version else 0.0

  def prompt_state(self, step: int) -> dict:
    after = self._stream_after.pop(step - self.start_step)
    self._resume_stream = self.prompts.get_state() if self._replays else after
    return self._resume_stream

  def get_state(self) -> dict:
    """The pipeline's whole state for a checkpoint taken after the last :meth:`prompt_state` step.

    Drains the feeder first (a pipeline bubble; see
    :mod:`jaxrl_llm.rollout.pipeline`). Keys: ``start_step`` and ``seed`` (data
    step s is RL step ``start_step + s``), ``published_version``, ``stream`` (the
    prompt stream before the first untrained step, as :meth:`prompt_state`
    returned it), ``steps`` (the untrained data steps) and ``feeder``
    (:meth:`PipelineFeeder.get_state`). JSON-serialisable.
    """
    feeder = self.feeder.get_state()
    return {"start_step": self.start_step, "seed": self.seed, "published_version": self.pool.published_version,
            "stream": self._resume_stream, "steps": self.feeder.pending_steps(), "feeder": feeder}

  def set_state(self, state: dict) -> None:
    """Restores :meth:`get_state`'s output into a new source, before its first :meth:`collect`.

    The saved chunks become ready to train on (they are not sampled again),
    the prompts of their steps are drawn again from the saved stream state
    and checked against the sampled ones, and dispatching continues at the
    saved next step with the saved base version and lag window, so data step
    numbers and target versions are those of the uninterrupted run.

    Raises:
      ValueError: when the state does not continue this run (another seed, a
        first untrained step other than ``start_step``) or the prompts drawn
        again differ from the ones that were sampled.
    """
    feeder = state["feeder"]
    start, steps, next_step = int(state["start_step"]), [int(s) for s in state["steps"]], int(feeder["next_step"])
    first = steps[0] if steps else next_step
    if int(state["seed"]) != self.seed:
      raise ValueError(f"pipeline checkpoint state: seed {state['seed']}, this run has seed={self.seed}")
    if start + first != self.start_step or steps != list(range(first, next_step)):
      raise ValueError(f"pipeline checkpoint state: untrained RL steps {[start + s for s in steps]} (next to "
                       f"dispatch: {start + next_step}) do not continue a run resuming at RL step {self.start_step}")
    resumed_version = self.feeder.base_version
    self.feeder.set_state(feeder)
    expected = self.feeder.base_version + (self.start_step - start)
    if resumed_version != expected:
      log.warning("pipeline checkpoint state: the run resumes at policy version %d, the pipeline expected %d "
                  "(one version per RL step); target versions follow the pipeline's count", resumed_version, expected)
    self.start_step = start
    if state.get("stream") is not None:
      self.prompts.set_state(state["stream"])
      self._resume_stream = state["stream"]
    for s in steps:
      prompts, rng = self._step_prompts(s)
      items = self.feeder.step_items(s)
      sampled = [list(p) for item in items for p in item.prompts]
      if [list(p) for p in prompts] != sampled or any(not np.array_equal(item.rng, rng) for item in items):
        raise ValueError(f"pipeline checkpoint state: the prompts of RL step {start + s} drawn again from the "
                         "restored prompt stream are not the ones that were sampled (a curated stream with "
                         "data.max_outstanding below rollout.max_lag + 1?)")
    if steps:
      print(f"Pipeline resumed: {self.feeder.restored} sampled chunks of RL steps {start + steps[0]}-"
            f"{start + steps[-1]} restored from the checkpoint (not sampled again); dispatching from RL step "
            f"{start + next_step}.")

  def close(self) -> None:
    self.pool.shutdown()


def hf_export_dir(run_dir: str) -> str:
  """Where a vLLM pool's initial Hugging Face folder is written."""
  return os.path.join(run_dir, "sampler_init")
