"""The training loop behind ``jaxrl-train``: SFT warm start, then RL (synchronous, or
PipelineRL with Ray sampler actors when ``rollout.mode="pipeline"``; see :class:`Pipeline`).

One run, in order:

1. set-up: validate the config, check that the run and checkpoint folders are
   writable (before any compute), build task, tokenizer, mesh, model, sampler,
   objective and optimizers; resume from the latest checkpoint when one exists;
2. SFT warm start (``sft.steps``) on the task's gold responses;
3. evaluation of the warm start (greedy accuracy, pass@k on held-out prompts);
4. RL: each step samples ``rl.prompts_per_step`` prompts x
   ``rl.samples_per_prompt`` responses, scores them with the task's reward
   (guarded: timeouts and exceptions score 0 and are counted), computes
   advantages, takes ``rl.updates_per_batch`` jitted updates and publishes the
   new weights to the sampler(s); periodic evaluation and checkpoints. In
   pipeline mode the samples of step t come from sampler actors that run up to
   ``rollout.max_lag`` steps ahead (``jaxrl_llm.rollout``);
5. outputs in the run folder: ``metrics.jsonl``, TensorBoard events,
   ``curves.png``, ``summary.json``, the policy as a Hugging Face folder in
   ``hf_export/``, and a printed summary.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import struct

from jaxrl_llm import advantages as A, bridge, configuration, models, objectives as O, reward_model
from jaxrl_llm.diagnostics import control, guard as guard_lib, offpolicy, writers
from jaxrl_llm.learner import builders, checkpoint, mesh as mesh_lib, multihost, rft, rl_step, sft, update
from jaxrl_llm.learner.state import TrainState, create_train_state
from jaxrl_llm.sampling import JaxSampler, SamplerConfig
from jaxrl_llm.tasks import PromptSource, RewardRunner, build_eval_set, curation, get_task
from jaxrl_llm.types import concat_trajectories

log = logging.getLogger("jaxrl_llm")


# RewardRunner counters saved with the run's progress (cumulative over the whole run).
_REWARD_COUNTERS = ("calls", "failures", "timeouts", "nonfinite", "worker_restarts", "seconds")


class NonFiniteError(RuntimeError):
  """Raised after ``learner.max_nonfinite_in_a_row`` consecutive skipped updates."""


@struct.dataclass
class RunState:
  """Everything saved in a checkpoint's array item."""

  train: TrainState
  objective: Any
  ref_params: Any = None
  good: Any = None  # (TrainState, objective state) of the guard's last good version


@dataclasses.dataclass
class Progress:
  """Host-side position of the run (saved as JSON next to the arrays)."""

  phase: str = "sft"  # "sft" | "rl" | "done"
  sft_step: int = 0
  rl_step: int = 0
  sft_stream: Optional[dict] = None
  prompt_stream: Optional[dict] = None
  warm_start: Optional[dict] = None
  nonfinite_in_a_row: int = 0
  skipped_updates: int = 0
  controller: Optional[dict] = None
  guard: Optional[dict] = None
  alerts: dict = dataclasses.field(default_factory=dict)  # alert name -> times raised (StepDiagnostics)
  reward_state: Optional[dict] = None  # running moments of the reward-model reward (reward_model.scorer)
  kl_reward_coef: Optional[float] = None  # current beta of the KL penalty in the reward (reward_model.shaping)
  reward_counters: Optional[dict] = None  # the task RewardRunner's counters (reward/task/* metrics)


class Run:
  """A configured run. ``Run(config).train()`` does everything; parts are reusable in tests."""

  def __init__(self, config: ml_collections.ConfigDict):
    configuration.validate(config)
    self.config = config
    self.run_dir = os.path.abspath(configuration.run_dir(config))
    checkpoint.check_writable(self.run_dir, "run folder (run_dir)")
    self.checkpointer = checkpoint.Checkpointer(os.path.join(self.run_dir, "checkpoints"),
                                                keep=config.checkpoint.keep, save_every=config.checkpoint.every)
    self.task = get_task(config.task.name, **dict(config.task.kwargs))
    self.tokenizer = builders.build_tokenizer(config, self.task)
    self.mesh = mesh_lib.make_mesh(dict(config.learner.mesh))
    # Batch-invariant mode: gradients of learner.grad_atoms atoms summed by a fixed tree (learner/update.py).
    self.grad_atoms = config.learner.grad_atoms if config.model.batch_invariant else 0
    if self.grad_atoms:
      mesh_lib.check_grad_atoms(self.mesh, self.grad_atoms)
    if jax.process_count() > 1 and config.rollout.mode == "pipeline":
      raise ValueError("rollout.mode='pipeline' with a multi-process learner: expected 'sync' (the Ray sampler "
                       "pool is driven from one learner process)")
    # Process 0 writes the run's files; the others write theirs under process_<i>/.
    self.out_dir = (self.run_dir if multihost.is_main_process()
                    else os.path.join(self.run_dir, f"process_{jax.process_index()}"))
    critic = config.critic.enabled
    self.model_config = builders.build_model_config(config, self.tokenizer)
    self.critic_config = self.model_config.replace(value_head=True) if critic else None
    total = config.sft.steps + config.rl.steps * config.rl.updates_per_batch
    self.optimizer = builders.build_optimizer(config, total)
    self.sft_optimizer = _sft_optimizer(config)
    self.critic_optimizer = (builders.optim.make_optimizer(config.critic.lr, max_grad_norm=config.optimizer.max_grad_norm)
                             if critic else None)
    self.objective = builders.build_objective(config, config.rl.max_new_tokens)
    self.uses_ref = builders.needs_reference_policy(config)
    self.rewarder = RewardRunner(self.task.reward, timeout_s=5.0, name="task")
    self.eval_set = build_eval_set(self.task, config.task.eval_size, seed=config.seed)
    self.sampler_config = SamplerConfig(
        max_new_tokens=config.rl.max_new_tokens, temperature=config.rl.temperature, top_k=config.rl.top_k,
        top_p=config.rl.top_p, num_samples=config.rl.samples_per_prompt, seed=config.seed,
        max_length=config.model.max_position_embeddings if not config.init.hf_checkpoint else None)
    self.thresholds = offpolicy.ConsistencyThresholds(
        max_kl_k3=config.diagnostics.max_kl_k3, max_out_of_bounds=config.diagnostics.max_out_of_bounds,
        min_ess_rate=config.diagnostics.min_ess_rate)
    self.diagnostics = offpolicy.StepDiagnostics(self.thresholds,
                                                 max_abs_advantage=config.diagnostics.max_abs_advantage,
                                                 max_filter_rate=config.diagnostics.max_filter_rate)
    self.controller = _make_controller(config)
    self.guard = guard_lib.ImprovementGuard(_guard_settings(config)) if config.guard.enabled else None
    self.guard_set = (build_eval_set(self.task, config.guard.eval_size, seed=config.seed + 7)
                      if config.guard.enabled else None)
    self._state = self._initial_state()
    self.progress = Progress()
    self._restore()
    for name, value in (self.progress.reward_counters or {}).items():
      setattr(self.rewarder, name, value)  # a resumed run logs the counts an uninterrupted one would
    if self.controller is not None:
      if self.progress.controller:
        self.controller.set_state(self.progress.controller)
      self._apply_control()
    if self.guard is not None and self.progress.guard:
      self.guard.set_state(self.progress.guard)
    if self.progress.alerts:
      self.diagnostics.load_state_dict({"counts": self.progress.alerts})
    self.sampler = JaxSampler(self.model_config, multihost.local_copy(self._state.train.params), self.sampler_config)
    self.publish()
    self.sequence_rewards = reward_model.build_sequence_rewards(config, self.mesh, self.tokenizer, self.task,
                                                                self.greedy_responses)
    if self.sequence_rewards is not None:
      self.sequence_rewards.set_state(self.progress.reward_state)
    self.kl_shaper = reward_model.build_kl_shaper(config)
    self._sft_step = sft.make_sft_step(self.model_config, self.sft_optimizer, config.learner.micro_batches,
                                       grad_atoms=self.grad_atoms, mesh=self.mesh)
    self._rl_steps: dict[bool, Any] = {}
    self._gae_inputs = None  # (rewards_bt, response_mask_bt) of the last GAE batch, for the advantage drift
    self._source = None  # the RL prompt source (set by run_rl)
    self._last_samples = None  # (examples, response ids, rewards, finished) of the last batch, for RFT
    self._rft_step = None
    # Invariant mode: whole-array forwards on every device (no layout-dependent partial sums).
    whole = (lambda f: update.replicated(f, self.mesh)) if self.grad_atoms else (lambda f: f)
    self._logp = jax.jit(whole(lambda p, t, m: models.sequence_logprobs(p, self.model_config, t, m,
                                                                             config.rl.temperature)))
    self._values = (jax.jit(whole(lambda p, t, m: rl_step.shifted_values(p, self.critic_config, t, m)))
                    if critic else None)

  # ------------------------------------------------------------------ state

  def _initial_state(self) -> RunState:
    c = self.config
    params = builders.build_params(c, self.model_config, self.mesh, c.seed, c.init.hf_checkpoint or None)
    critic_params = None
    if self.critic_config is not None:
      critic_params = builders.build_params(c, self.critic_config, self.mesh, c.seed + 1,
                                            c.critic.init_from or c.init.hf_checkpoint or None)
    train = create_train_state(params, self.optimizer, c.seed, critic_params, self.critic_optimizer)
    objective = self.objective.init(None)
    good = (train, objective) if c.guard.enabled else None  # same structure from the start: restorable
    return _place_on_mesh(RunState(train=train, objective=objective, ref_params=None, good=good), self.mesh)

  def _restore(self) -> None:
    if not (self.config.checkpoint.resume and self.checkpointer.latest_step() is not None):
      return
    like = self._state
    if self.uses_ref and like.ref_params is None:
      like = like.replace(ref_params=like.train.params)
    state, extra, step = self.checkpointer.restore(like)
    self._state = state
    self.progress = Progress(**extra["progress"])
    log.warning("resumed from checkpoint step %d (%s phase)", step, self.progress.phase)
    print(f"Resumed from {self.checkpointer.directory} at step {step} ({self.progress.phase} phase).")

  def _save(self, force: bool = False) -> None:
    self.progress.reward_counters = {k: getattr(self.rewarder, k) for k in _REWARD_COUNTERS}
    if self.controller is not None:
      self.progress.controller = self.controller.get_state()
    if self.guard is not None:
      self.progress.guard = self.guard.get_state()
    step = self.progress.sft_step + self.progress.rl_step
    if force or self.checkpointer.should_save(step):
      self.checkpointer.save(step, self._state, {"progress": dataclasses.asdict(self.progress)})

  @property
  def params(self) -> Any:
    return self._state.train.params

  def publish(self) -> None:
    """Sends the current policy weights to the sampler if it has an older version."""
    version = int(self._state.train.policy_version)
    if self.sampler.policy_version != version:
      # the sampler runs on one local device with a whole copy (same bits on any mesh / process count)
      self.sampler.update_weights(multihost.local_copy(self._state.train.params), version)

  # ------------------------------------------------------------------ data

  def encode_prompt(self, text: str) -> list[int]:
    if self.config.task.use_chat_template:
      text = self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return self.tokenizer.encode(text, add_special_tokens=False)

  def decode_response(self, ids: list[int]) -> str:
    return self.tokenizer.decode(ids, skip_special_tokens=True)

  # ------------------------------------------------------------------ evaluation

  def greedy_correct(self, examples) -> np.ndarray:
    """bool [len(examples)]: whether the greedy answer of the current policy is exactly right."""
    self.publish()
    prompts = [self.encode_prompt(e.prompt) for e in examples]
    greedy = self.sampler.generate(prompts, greedy=True, num_samples=1, rng=jax.random.PRNGKey(0))
    return np.array([self.task.reward(e, self.decode_response(r)) >= 1.0
                     for e, r in zip(examples, greedy.response_tokens)])

  def evaluate(self, pass_k: Optional[int] = None) -> dict[str, float]:
    """Greedy accuracy and pass@k on the held-out set."""
    pass_k = pass_k or self.config.eval.pass_k
    examples = list(self.eval_set.examples)
    correct = self.greedy_correct(examples)
    prompts = [self.encode_prompt(e.prompt) for e in examples]
    rng = jax.random.fold_in(jax.random.PRNGKey(self.config.seed + 1), self.progress.sft_step + self.progress.rl_step)
    sampled = self.sampler.generate(prompts, num_samples=pass_k, rng=jax.random.fold_in(rng, 1))
    hits = np.array([self.task.reward(examples[i // pass_k], self.decode_response(r)) >= 1.0
                     for i, r in enumerate(sampled.response_tokens)]).reshape(len(examples), pass_k)
    return {"eval/accuracy": float(correct.mean()), f"eval/pass@{pass_k}": float(hits.any(1).mean()),
            "eval/sample_accuracy": float(hits.mean())}

  # ------------------------------------------------------------------ SFT

  def run_sft(self, metrics_writer: writers.MetricsWriter) -> None:
    c = self.config
    stream = self.task.train_prompts(seed=c.seed + 1000)
    if self.progress.sft_stream:
      stream.set_state(self.progress.sft_stream)
    length = c.model.max_position_embeddings
    while self.progress.sft_step < c.sft.steps:
      examples = [next(stream) for _ in range(c.sft.batch_size)]
      batch = sft.collate([self.encode_prompt(e.prompt) for e in examples],
                          [self.tokenizer.encode(self.task.sft_target(e), add_special_tokens=False) for e in examples],
                          self.tokenizer.eos_id, self.tokenizer.pad_id, length)
      train, m = self._sft_step(self._state.train, batch)
      self._state = self._state.replace(train=train)
      self.progress.sft_step += 1
      self.progress.sft_stream = stream.get_state()
      self._track_nonfinite(m)
      if self.progress.sft_step % c.log.every == 0:
        metrics_writer.write(self.progress.sft_step - c.sft.steps, m)
      self._save()

  def _track_nonfinite(self, metrics: dict) -> None:
    skipped = float(metrics["update/skipped_nonfinite"]) > 0
    if skipped:
      self.progress.skipped_updates += 1
      self.progress.nonfinite_in_a_row += 1
      log.warning("non-finite loss or gradient: update skipped (%d in a row)", self.progress.nonfinite_in_a_row)
      if self.progress.nonfinite_in_a_row >= self.config.learner.max_nonfinite_in_a_row:
        raise NonFiniteError(
            f"{self.progress.nonfinite_in_a_row} consecutive updates had a non-finite loss or gradient "
            f"(limit learner.max_nonfinite_in_a_row={self.config.learner.max_nonfinite_in_a_row}); "
            f"stopping. The last good state is in {self.checkpointer.directory}.")
    else:
      self.progress.nonfinite_in_a_row = 0

  # ------------------------------------------------------------------ RL

  def _rl_step_fn(self, train_actor: bool):
    if train_actor not in self._rl_steps:
      c = self.config
      spec = rl_step.RLStepSpec(model=self.model_config, temperature=c.rl.temperature,
                                group_size=c.rl.samples_per_prompt, micro_batches=c.learner.micro_batches,
                                use_ref=self.uses_ref, use_entropy=bool(c.objective.entropy_coef),
                                critic=self.critic_config, train_actor=train_actor, grad_atoms=self.grad_atoms)
      self._rl_steps[train_actor] = rl_step.make_rl_step(spec, self.objective, self.optimizer, self.critic_optimizer,
                                                         mesh=self.mesh)
    return self._rl_steps[train_actor]

  def sampling_key(self, rl_step_index: int) -> jax.Array:
    """The sampling key of RL step ``i``: a function of (seed, i) only, so a resumed
    run, and the pipeline with k = 0, sample what the uninterrupted synchronous run would."""
    return jax.random.fold_in(jax.random.PRNGKey(self.config.seed), rl_step_index)

  def collect(self, prompt_source: PromptSource) -> tuple[rl_step.RLBatch, dict]:
    """Samples (in this process), scores and turns one batch of prompts into an RLBatch."""
    if self.config.data.dynamic_sampling:
      return self.collect_informative(prompt_source)
    pb = prompt_source.next_batch()
    t0 = time.perf_counter()
    result = self.sampler.generate([self.encode_prompt(e.prompt) for e in pb.examples],
                                   rng=self.sampling_key(self.progress.rl_step))
    return self.build_batch(pb.examples, result.trajectory, result.response_tokens, time.perf_counter() - t0)

  def collect_informative(self, prompt_source: PromptSource) -> tuple[rl_step.RLBatch, dict]:
    """Dynamic sampling (DAPO, arXiv:2503.14476): sampling rounds of ``rl.prompts_per_step``
    prompts until that many groups with unequal rewards are collected (at most
    ``data.max_rounds``; then zero-variance groups pad the batch, counted in
    ``data/dynamic_padded_groups``). Round r of RL step i samples with
    ``fold_in(sampling_key(i), r)`` (round 0: the key itself), so the rounds
    are a function of (seed, step) and a resumed run repeats them."""
    c = self.config
    n = c.rl.samples_per_prompt
    collector = curation.InformativeGroupCollector(c.rl.prompts_per_step, n, max_rounds=c.data.max_rounds)
    trajectories, responses, examples, rewards, reward_metrics = [], [], [], [], {}
    t0 = time.perf_counter()
    key = self.sampling_key(self.progress.rl_step)
    while not collector.done:
      pb = prompt_source.next_batch()
      rng = key if not trajectories else jax.random.fold_in(key, len(trajectories))
      result = self.sampler.generate([self.encode_prompt(e.prompt) for e in pb.examples], rng=rng)
      pairs = [(pb.examples[i // n], self.decode_response(r)) for i, r in enumerate(result.response_tokens)]
      round_rewards, reward_metrics = self.score_rewards(pb.examples, pairs, result.trajectory.trimmed(multiple=8))
      self._record_pass_rates(pb.examples, round_rewards)
      trajectories.append(result.trajectory)
      responses += list(result.response_tokens)
      examples += list(pb.examples)
      rewards.append(round_rewards)
      collector.add(round_rewards)
    out = collector.result()
    rows = np.asarray(out.rows_b)
    traj = concat_trajectories(trajectories, self.model_config.pad_token_id).take(rows)
    batch, metrics = self.build_batch([examples[int(r) // n] for r in rows[::n]], traj,
                                      [responses[int(r)] for r in rows], time.perf_counter() - t0,
                                      scored=(np.concatenate(rewards)[rows], reward_metrics))
    metrics.update(out.metrics())
    return batch, metrics

  def _record_pass_rates(self, examples, rewards) -> None:
    if isinstance(self._source, curation.CuratedPromptSource):
      self._source.record(list(examples), rewards)

  def build_batch(self, examples, trajectory, response_tokens, t_sample: float,
                  scored: Optional[tuple[np.ndarray, dict]] = None) -> tuple[rl_step.RLBatch, dict]:
    """Scores sampled responses and builds the RLBatch (advantages, reference, lags).

    Args:
      examples: the G prompts' task examples.
      trajectory: the B = G * n sampled rows (numpy Trajectory).
      response_tokens: per row, the sampled ids.
      t_sample: seconds spent sampling (for the metrics).
      scored: ``(rewards [B], reward metrics)`` when the caller already scored the
        rows (and fed the curated source's pass rates); None: score them here.
    """
    c = self.config
    n = c.rl.samples_per_prompt
    traj = trajectory.trimmed(multiple=8)
    pairs = [(examples[i // n], self.decode_response(r)) for i, r in enumerate(response_tokens)]
    if scored is None:
      rewards, reward_metrics = self.score_rewards(examples, pairs, traj)
      self._record_pass_rates(examples, rewards)
    else:
      rewards, reward_metrics = scored
    self._last_samples = (examples, response_tokens, rewards, np.asarray(trajectory.finished_b))
    tokens = jnp.asarray(traj.tokens_bt)
    response = jnp.asarray(traj.response_mask_bt)
    seq = jnp.asarray(traj.prompt_mask_bt) | response
    behaviour = jnp.asarray(traj.behaviour_logp_bt)
    zeros = jnp.zeros(tokens.shape, jnp.float32)
    old_values, returns = zeros, zeros
    metrics: dict[str, Any] = dict(reward_metrics)
    ref = None
    if c.advantage.estimator == "gae":
      old_values = self._values(self._state.train.critic_params, tokens, seq)
      if self.kl_shaper is not None:  # r_t = 1[EOS] r - beta KL_t against the warm start
        ref = self._logp(self._state.ref_params, tokens, seq)
        rewards_bt, self.progress.kl_reward_coef, kl_metrics = self.kl_shaper(
            rewards, behaviour, ref, response, self.progress.kl_reward_coef)
        metrics.update(kl_metrics)
      else:
        rewards_bt = A.reward_at_eos(rewards, response)
      adv, returns = A.gae(rewards_bt, jnp.where(response, old_values, 0.0), response,
                           gamma=c.advantage.gamma, lam=c.advantage.lam)
      self._gae_inputs = (rewards_bt, response)
      metrics.update(offpolicy.advantage_substitution_error(
          np.asarray(old_values), offpolicy.monte_carlo_returns(np.asarray(rewards_bt), np.asarray(response),
                                                                c.advantage.gamma), np.asarray(response)))
    else:
      out = A.group_advantages(rewards, n, estimator=builders.GROUP_ESTIMATORS[c.advantage.estimator])
      adv = A.sequence_to_tokens(out.advantages_b, response)
      metrics["data/zero_variance_groups"] = jnp.mean(out.zero_variance_g.astype(jnp.float32))
      if c.rl.filter_zero_variance:
        response = response & ~out.zero_variance_b[:, None]
    if c.advantage.normalization != "none":
      norm = A.make_advantage_normalizer(c.advantage.normalization, group_size=n)
      adv = norm(adv, response)
    if c.rl.filter_zero_variance and c.advantage.estimator != "gae":
      rows = rl_step.informative_rows(np.asarray(out.zero_variance_b), n, self._row_granule())
      tokens, seq, response, behaviour, adv, zeros = (jnp.asarray(a)[rows] for a in
                                                      (tokens, seq, response, behaviour, adv, zeros))
      old_values, returns = zeros, zeros
      traj = traj.replace(policy_version_bt=np.asarray(traj.policy_version_bt)[rows])
      metrics["data/rows_trained"] = float(len(rows))
    if ref is None:
      ref = self._logp(self._state.ref_params, tokens, seq) if self.uses_ref else zeros
    version = int(self._state.train.policy_version)
    lag = jnp.where(response, version - jnp.asarray(traj.policy_version_bt), 0)
    batch = rl_step.RLBatch(tokens_bt=tokens, seq_mask_bt=seq, response_mask_bt=response,
                            behaviour_logp_bt=behaviour, advantages_bt=adv, ref_logp_bt=ref, lag_bt=lag,
                            old_values_bt=old_values, returns_bt=returns)
    lag_np = np.asarray(lag)[np.asarray(response)]
    metrics["data/lag_max"] = float(lag_np.max()) if lag_np.size else 0.0
    metrics["data/lag_mean"] = float(lag_np.mean()) if lag_np.size else 0.0
    gen_tokens = int(np.asarray(traj.response_mask_bt).sum())
    lengths = np.asarray(traj.response_mask_bt).sum(1)
    metrics.update({
        "reward/mean": float(rewards.mean()), "reward/std": float(rewards.std()),
        "response/length_mean": float(lengths.mean()),
        "response/finished_share": float(np.asarray(traj.finished_b).mean()),
        "throughput/sample_tokens_per_s": gen_tokens / max(t_sample, 1e-9),
        "time/sample_s": t_sample,
    })
    metrics.update(self.rewarder.metrics)
    if isinstance(self._source, curation.CuratedPromptSource):
      metrics.update(self._source.metrics())
    return batch, metrics

  def score_rewards(self, examples, pairs, trajectory) -> tuple[np.ndarray, dict]:
    """Sequence rewards of the B sampled rows: the task's rule reward (guarded runner), combined
    with a reward model's processed score when ``reward_model.path`` is set (see
    :class:`jaxrl_llm.reward_model.SequenceRewards`), then clipped by ``advantage.reward_clip``.

    Returns:
      ``(rewards float32 [B], metrics)``.
    """
    c = self.config
    rewards = np.asarray(self.rewarder.score(pairs), np.float32)
    metrics: dict[str, Any] = {}
    if self.sequence_rewards is not None:
      rewards, metrics = self.sequence_rewards(examples, pairs, trajectory, rewards)
      self.progress.reward_state = self.sequence_rewards.get_state()
    if c.advantage.reward_clip:
      rewards = np.clip(rewards, -c.advantage.reward_clip, c.advantage.reward_clip)
    return rewards, metrics

  def greedy_responses(self, examples) -> tuple[Any, list[str]]:
    """The current policy's greedy answer to each example: ``(Trajectory, response texts)``."""
    self.publish()
    out = self.sampler.generate([self.encode_prompt(e.prompt) for e in examples], greedy=True, num_samples=1,
                                rng=jax.random.PRNGKey(0))
    return out.trajectory, [self.decode_response(r) for r in out.response_tokens]

  def _row_granule(self) -> int:
    """Smallest learner batch: a multiple of the group size, micro-batches and data-parallel size
    (invariant mode: whole groups in each of the atoms, the same on every mesh)."""
    c = self.config
    if self.grad_atoms:
      return c.rl.samples_per_prompt * self.grad_atoms
    data = int(np.prod([self.mesh.shape[a] for a in self.mesh.axis_names if a in ("data", "fsdp")]))
    return int(np.lcm.reduce([c.rl.samples_per_prompt, c.learner.micro_batches, data]))

  def prompt_source(self) -> PromptSource | curation.CuratedPromptSource:
    """The RL prompt stream: plain task order, or curated (``data.curate``) with pass-rate state."""
    c = self.config
    if c.data.curate:
      return curation.CuratedPromptSource(self.task, c.rl.prompts_per_step, seed=c.seed,
                                          samples_per_prompt=c.rl.samples_per_prompt,
                                          config=configuration.curation_config(c))
    return PromptSource(self.task, c.rl.prompts_per_step, seed=c.seed, samples_per_prompt=c.rl.samples_per_prompt)

  def run_rl(self, metrics_writer: writers.MetricsWriter) -> None:
    c = self.config
    source = self._source = self.prompt_source()
    if self.progress.prompt_stream:
      source.set_state(self.progress.prompt_stream)
    pipeline = Pipeline(self, source) if c.rollout.mode == "pipeline" else None
    try:
      self._rl_loop(metrics_writer, source, pipeline)
    finally:
      if pipeline is not None:
        pipeline.close()

  def _rl_loop(self, metrics_writer: writers.MetricsWriter, source: PromptSource, pipeline: Optional["Pipeline"]):
    c = self.config
    while self.progress.rl_step < c.rl.steps:
      t0 = time.perf_counter()
      batch, metrics = pipeline.collect() if pipeline else self.collect(source)
      # the learner's idle time: sampling in the synchronous loop, waiting for chunks in the pipeline
      metrics.setdefault("time/wait_s", metrics["time/sample_s"])
      t1 = time.perf_counter()
      metrics.update(self.learn(batch, metrics))
      t_publish = time.perf_counter()
      if pipeline:
        if self.controller is not None:
          pipeline.feeder.max_lag = self.controller.state.max_lag
        pipeline.publish()
      else:
        self.publish()
      metrics["time/publish_s"] = time.perf_counter() - t_publish
      t2 = time.perf_counter()
      if c.data.rft_every and (self.progress.rl_step + 1) % c.data.rft_every == 0:
        metrics.update(self.rft_step())
      self.progress.rl_step += 1
      stream = pipeline.stream_state() if pipeline else None
      # A curated source replays drawn-but-unrecorded batches after set_state, so
      # its own state is right in both modes; the plain stream in the pipeline is
      # the state right after this step's prompts.
      self.progress.prompt_stream = source.get_state() if (pipeline is None or c.data.curate) else stream
      tokens = float(np.asarray(batch.response_mask_bt).sum())
      metrics.update({"time/learn_s": t2 - t1, "time/step_s": t2 - t0,
                      "throughput/tokens_per_s": tokens / max(t2 - t0, 1e-9)})
      if self.guard is not None and self.guard.due(self.progress.rl_step):
        metrics.update(self.guard_check())
      metrics["policy_version"] = float(self._state.train.policy_version)
      if self.progress.rl_step % c.eval.every == 0 or self.progress.rl_step == c.rl.steps:
        metrics.update(self.evaluate())
      if self.progress.rl_step % c.log.every == 0 or "eval/accuracy" in metrics:
        metrics_writer.write(self.progress.rl_step, metrics)
      self._save()

  def learn(self, batch: rl_step.RLBatch, data_metrics: dict) -> dict:
    """The update(s) on one batch, bracketed by the consistency check and the diagnostics.

    ``rl.updates_per_batch`` jitted steps; the first one also returns the
    learner's log-probabilities pi_k of the batch before any update, which the
    consistency check compares with the sampler's (and, with
    ``diagnostics.consistency_action="skip"``, discards the update on an
    alert). Then the seed diagnostics (drift, staleness, alerts) and the
    controller's reaction to them.

    Returns:
      the step's metrics (objective, optimizer, ``consistency/*``,
      ``offpolicy/*``, ``alerts/*``, ``control/*``).
    """
    c = self.config
    train_actor = self.progress.rl_step >= c.critic.warmup_steps or not c.critic.enabled
    step_fn = self._rl_step_fn(train_actor)
    batch = self._shard_batch(batch)
    before = self._state
    logp_k = None
    for _ in range(c.rl.updates_per_batch):
      train, obj_state, m = step_fn(self._state.train, self._state.objective, batch)
      logp = m.pop("logp_bt")
      logp_k = logp if logp_k is None else logp_k
      self._state = self._state.replace(train=train, objective=obj_state)
      self._track_nonfinite(m) if train_actor else None
    metrics = dict(m)
    metrics.update(self.diagnose(batch, np.asarray(logp_k), before, data_metrics, train_actor))
    if self.controller is not None:
      kl = m.get("kl_loss/kl_mean")
      metrics.update(self.controller.update(
          drift=metrics.get("offpolicy/drift_tv"), staleness=metrics.get("offpolicy/staleness_tv"),
          kl=None if kl is None else float(kl), episodes=int(batch.tokens_bt.shape[0])))
      self._apply_control()
    return metrics

  def _shard_batch(self, batch: rl_step.RLBatch) -> rl_step.RLBatch:
    """Default path: rows split over the mesh's batch axes (data x fsdp), so each device
    computes its share instead of the whole batch. Invariant mode places atoms itself."""
    shards = mesh_lib.batch_divisor(self.mesh)
    if self.grad_atoms or shards == 1 or batch.tokens_bt.shape[0] % shards:
      return batch
    return jax.tree.map(lambda x: jax.device_put(x, mesh_lib.batch_sharding(self.mesh, x.ndim)), batch)

  def diagnose(self, batch: rl_step.RLBatch, logp_k: np.ndarray, before: RunState, data_metrics: dict,
               train_actor: bool) -> dict:
    """Consistency check, seed diagnostics and alerts of one learner step (host-side, float64).

    Args:
      batch: the batch just trained on.
      logp_k: float32 [B, T] learner log-probabilities before the update.
      before: the run state before the update (restored on a skipped update).
      data_metrics: the batch's data metrics (filter rate).
      train_actor: False during critic warm-up (nothing to skip or drift).
    """
    c = self.config
    mask = np.asarray(batch.response_mask_bt)
    behaviour = np.asarray(batch.behaviour_logp_bt)
    out, alerts = self.diagnostics.before_update(
        logp_k, behaviour, mask, np.asarray(batch.lag_bt), np.asarray(batch.advantages_bt),
        float(data_metrics.get("data/zero_variance_groups", 0.0)))
    inconsistent = any(a.metric.startswith("consistency/") for a in alerts)
    skipped = inconsistent and c.diagnostics.consistency_action == "skip" and train_actor
    if skipped:
      self._state = before
    out["consistency/update_skipped"] = float(skipped)
    every = c.diagnostics.drift_every
    if train_actor and not skipped and every and self.progress.rl_step % every == 0:
      after = np.asarray(self._logp(self.params, batch.tokens_bt, batch.seq_mask_bt))
      drift, drift_alerts = self.diagnostics.after_update(logp_k, after, behaviour, mask)
      out.update(drift)
      alerts += drift_alerts
      if self._gae_inputs is not None:
        out.update(self._advantage_drift(batch))
    for a in alerts:
      log.warning("RL step %d alert: %s%s", self.progress.rl_step, a,
                  " (update discarded)" if skipped and a.metric.startswith("consistency/") else "")
    self.progress.alerts = self.diagnostics.state_dict()["counts"]
    return out

  def _advantage_drift(self, batch: rl_step.RLBatch) -> dict:
    """GAE path: advantages recomputed with the updated critic against those trained on."""
    rewards_bt, response = self._gae_inputs
    c = self.config
    values = self._values(self._state.train.critic_params, batch.tokens_bt, batch.seq_mask_bt)
    adv, _ = A.gae(rewards_bt, jnp.where(response, values, 0.0), response, gamma=c.advantage.gamma,
                   lam=c.advantage.lam)
    if c.advantage.normalization != "none":
      adv = A.make_advantage_normalizer(c.advantage.normalization, group_size=c.rl.samples_per_prompt)(adv, response)
    return offpolicy.advantage_drift(np.asarray(batch.advantages_bt), np.asarray(adv), np.asarray(response))

  def rft_step(self) -> dict:
    """Rejection-sampling fine-tuning: one SFT step on the best of each group's n samples.

    The last batch's groups whose best reward reaches ``data.rft_min_reward``
    (finished responses only) contribute their best sample; the step uses the
    RL optimizer (its moments and schedule continue) and bumps the policy
    version. References: Touvron et al., Llama 2, arXiv:2307.09288 (rejection
    sampling fine-tuning); Yuan et al., arXiv:2308.01825 (RFT).
    """
    c = self.config
    examples, responses, rewards, finished = self._last_samples
    n = c.rl.samples_per_prompt
    rows = rft.select_best_of_k(rewards, n, c.data.rft_min_reward, finished)
    out = rft.best_of_k_metrics(rewards, rows, n)
    if rows.size == 0:
      return out
    if self._rft_step is None:
      self._rft_step = sft.make_sft_step(self.model_config, self.optimizer, c.learner.micro_batches)
    batch = rft.rft_batch([self.encode_prompt(e.prompt) for e in examples], responses, rows, self.tokenizer.eos_id,
                          self.tokenizer.pad_id, c.model.max_position_embeddings,
                          num_rows=max(c.rl.prompts_per_step, len(examples)))
    train, m = self._rft_step(self._state.train, batch)
    self._state = self._state.replace(train=train)
    out.update({f"rft/{k}": v for k, v in m.items()})
    return out

  def _apply_control(self) -> None:
    """Writes the controller's clip scale and KL coefficient into the objective state."""
    st = self.controller.state
    obj = self._state.objective
    keys = O.control_keys(obj)
    if control.CLIP_KEY in keys:
      obj = O.set_control(obj, control.CLIP_KEY, st.clip_scale)
    if st.kl_coef is not None and control.KL_KEY in keys:
      obj = O.set_control(obj, control.KL_KEY, st.kl_coef / self.config.objective.kl_coef)
    self._state = self._state.replace(objective=obj)

  def guard_check(self) -> dict:
    """Evaluates the guard's held-out prompts; rolls back to the last good version on a regression."""
    g = self.config.guard
    correct = self.greedy_correct(list(self.guard_set.examples))
    verdict = self.guard.judge(self.progress.rl_step, float(correct.mean()), int(correct.size))
    print(verdict.message(self.progress.rl_step))
    out = {"guard/accuracy": verdict.accuracy, "guard/rolled_back": float(verdict.rollback)}
    if verdict.rollback:
      good_train, good_objective = self._state.good
      version = self._state.train.policy_version + 1  # versions stay monotone for the samplers
      opt_state = builders.optim.set_lr_scale(
          good_train.opt_state, builders.optim.get_lr_scale(good_train.opt_state) * g.lr_shrink)
      train = good_train.replace(opt_state=opt_state, policy_version=version)
      self._state = self._state.replace(train=train, objective=good_objective)
      if self.controller is not None:
        self.controller.shrink_clip(g.clip_shrink)
        self._apply_control()
      log.warning("guard rolled back to the version of RL step %d; learning-rate scale now %.3g",
                  self.guard.state.good_step, builders.optim.get_lr_scale(opt_state))
    else:
      self._state = self._state.replace(good=(self._state.train, self._state.objective))
    out["optimizer/lr_scale"] = builders.optim.get_lr_scale(self._state.train.opt_state)
    out.update(self.guard.metrics())
    return out

  # ------------------------------------------------------------------ whole run

  def train(self) -> dict:
    c = self.config
    start = time.time()
    mw = writers.MetricsWriter(self.out_dir, c.sft.steps + c.rl.steps, description=c.name,
                               progress=c.log.progress, tensorboard=c.log.tensorboard)
    try:
      if self.progress.phase == "sft":
        if c.sft.steps:
          self.run_sft(mw)
        self.progress.warm_start = self.evaluate()
        mw.write(0, {k.replace("eval/", "warm_start/"): v for k, v in self.progress.warm_start.items()})
        mw.write(0, self.progress.warm_start)
        if self.uses_ref:
          self._state = self._state.replace(ref_params=jax.tree.map(jnp.copy, self._state.train.params))
        if self.guard is not None:  # the warm start is the first good version
          mw.write(0, self.guard_check())
        self.progress.phase = "rl"
        self._save(force=True)
      if self.progress.phase == "rl":
        self.run_rl(mw)
        self.progress.phase = "done"
        self._save(force=True)
      final = self.evaluate()
    finally:
      mw.close()
      self.rewarder.close()
      self.checkpointer.close()
    return self._finish(final, time.time() - start, mw)

  def _finish(self, final: dict, seconds: float, mw: writers.MetricsWriter) -> dict:
    c = self.config
    records = writers.read_jsonl(mw.jsonl_path)
    plot = writers.plot_curves([r for r in records if r["step"] >= 0], os.path.join(self.out_dir, "curves.png"),
                               ["reward/mean", "eval/accuracy"], title=c.name)
    export_dir = None
    if c.export.hf:
      params = multihost.to_host(self.params)  # every process takes part in gathering; process 0 writes
      if multihost.is_main_process():
        export_dir = bridge.export_hf_checkpoint(params, self.model_config, os.path.join(self.run_dir, "hf_export"),
                                                 tokenizer=self.tokenizer)
    warm = self.progress.warm_start or {}
    summary = {
        "name": c.name,
        "final_accuracy": final["eval/accuracy"],
        f"final_pass@{c.eval.pass_k}": final[f"eval/pass@{c.eval.pass_k}"],
        "warm_start_accuracy": warm.get("eval/accuracy"),
        "sft_steps": self.progress.sft_step,
        "rl_steps": self.progress.rl_step,
        "skipped_updates": self.progress.skipped_updates,
        "alerts": dict(self.progress.alerts),
        "guard_rollbacks": self.guard.state.rollbacks if self.guard is not None else 0,
        "controller": self.controller.get_state() if self.controller is not None else None,
        "wall_clock_s": seconds,
        "run_dir": self.run_dir,
        "outputs": {"metrics": mw.jsonl_path, "tensorboard": mw.tb_dir, "plot": plot,
                    "hf_export": export_dir, "checkpoints": self.checkpointer.directory},
    }
    with open(os.path.join(self.out_dir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
    print(f"\n{c.name}: held-out greedy accuracy {summary['warm_start_accuracy'] or 0:.3f} after the warm start "
          f"-> {summary['final_accuracy']:.3f} after {summary['rl_steps']} RL steps "
          f"({seconds:.0f} s).\nOutputs in {self.run_dir}: metrics.jsonl, tensorboard/, curves.png, summary.json"
          + (", hf_export/" if export_dir else ""))
    return summary


class Pipeline:
  """The RL data path of ``rollout.mode="pipeline"``: Ray sampler actors ahead of the learner.

  Wraps a :class:`~jaxrl_llm.rollout.SamplerPool` and a
  :class:`~jaxrl_llm.rollout.PipelineFeeder` (see there for the staleness
  rule). Prompts are drawn from the run's prompt stream in step order; the
  stream state saved with a checkpoint is the one right after the learner's
  last consumed step, so a resumed run re-samples the steps that were in
  flight.
  """

  def __init__(self, run: Run, source: PromptSource):
    from jaxrl_llm import rollout  # Ray is imported only when the pipeline is used

    c = run.config
    self.run = run
    self.source = source
    self.start_step = run.progress.rl_step
    self._examples: dict[int, tuple] = {}
    self._stream_after: dict[int, dict] = {}
    fingerprint = bridge.make_fingerprint(run.tokenizer, run.model_config)
    model_path = ""
    if c.sampler.kind == "vllm":  # vLLM starts from an HF folder of the current weights
      model_path = str(bridge.export_hf_checkpoint(run.params, run.model_config,
                                                   os.path.join(run.run_dir, "sampler_init"), tokenizer=run.tokenizer))
    spec = rollout.SamplerSpec(model_config=run.model_config, sampler_config=run.sampler_config,
                               fingerprint=fingerprint.to_dict(), kind=c.sampler.kind,
                               segment_tokens=c.rollout.segment_tokens, model_path=model_path)
    self.version = int(run._state.train.policy_version)
    vocab = run.model_config.vocab_size
    self.pool = rollout.SamplerPool(
        spec, run.params, self.version, num_samplers=c.rollout.num_samplers, address=c.rollout.address or None,
        actor_cpus=c.rollout.actor_cpus,
        validate=lambda chunk: rollout.validate_chunk(chunk, fingerprint=fingerprint, vocab_size=vocab,
                                                      latest_version=self.pool.published_version))
    self.feeder = rollout.PipelineFeeder(self.pool, self._step_prompts, num_samples=c.rl.samples_per_prompt,
                                         max_lag=c.rollout.max_lag, base_version=self.version,
                                         chunks_per_step=c.rollout.chunks_per_step or c.rollout.num_samplers)

  def _step_prompts(self, s: int):
    pb = self.source.next_batch()
    self._examples[s] = pb.examples
    self._stream_after[s] = self.source.get_state()
    prompts = [self.run.encode_prompt(e.prompt) for e in pb.examples]
    return prompts, np.asarray(self.run.sampling_key(self.start_step + s))

  def collect(self) -> tuple[rl_step.RLBatch, dict]:
    s = self.run.progress.rl_step - self.start_step
    t0 = time.perf_counter()
    from jaxrl_llm import rollout

    chunks = self.feeder.take(s)
    waited = time.perf_counter() - t0
    traj, responses = rollout.concat_chunks(chunks, self.run.model_config.pad_token_id)
    batch, metrics = self.run.build_batch(self._examples.pop(s), traj, responses,
                                          max(ch.sample_seconds for ch in chunks))
    metrics["time/wait_s"] = waited
    metrics.update(self.feeder.metrics())
    metrics["pipeline/sampler_busy_s"] = float(sum(ch.sample_seconds for ch in chunks))
    return batch, metrics

  def publish(self) -> float:
    """Publishes the learner's new weights to the actors (and the in-process eval sampler)."""
    version = int(self.run._state.train.policy_version)
    seconds = self.pool.publish(self.run.params, version) if version > self.pool.published_version else 0.0
    self.run.publish()
    return seconds

  def stream_state(self) -> dict:
    return self._stream_after.pop(self.run.progress.rl_step - 1 - self.start_step)

  def close(self) -> None:
    self.pool.shutdown()


def _place_on_mesh(tree: Any, mesh) -> Any:
  """Commits every leaf to ``mesh``: sharded leaves keep their sharding, the rest
  (step counters, RNG, optimizer counts, objective state) are replicated, so a
  state restored from a checkpoint lands on the same devices as a fresh one."""
  replicated = mesh_lib.replicated(mesh)

  def place(x):
    if isinstance(getattr(x, "sharding", None), jax.sharding.NamedSharding) and x.sharding.mesh == mesh:
      return x
    return jax.device_put(x, replicated)

  return jax.tree.map(place, tree)


def _make_controller(config: ml_collections.ConfigDict) -> Optional[control.OffPolicyController]:
  cc = config.control
  if not cc.enabled:
    return None
  settings = control.ControlSettings(
      drift_target=cc.drift_target, staleness_target=cc.staleness_target, tolerance=cc.tolerance,
      tighten=cc.tighten, relax=cc.relax, min_clip_scale=cc.min_clip_scale, max_clip_scale=cc.max_clip_scale,
      max_lag=config.rollout.max_lag if config.rollout.mode == "pipeline" else 0,
      min_lag=min(cc.min_lag, config.rollout.max_lag if config.rollout.mode == "pipeline" else 0),
      kl_target=cc.kl_target, kl_horizon=cc.kl_horizon)
  return control.OffPolicyController(settings, kl_coef=config.objective.kl_coef)


def _guard_settings(config: ml_collections.ConfigDict) -> guard_lib.GuardSettings:
  g = config.guard
  return guard_lib.GuardSettings(every=g.every, eval_size=g.eval_size, min_drop=g.min_drop, z=g.z,
                                 lr_shrink=g.lr_shrink, clip_shrink=g.clip_shrink, max_rollbacks=g.max_rollbacks)


def _sft_optimizer(config: ml_collections.ConfigDict):
  o = config.optimizer
  return builders.optim.make_optimizer(config.sft.lr, config.sft.warmup_steps, max(1, config.sft.steps), "constant",
                                       weight_decay=o.weight_decay, b1=o.b1, b2=o.b2, max_grad_norm=o.max_grad_norm)


def train(config: ml_collections.ConfigDict) -> dict:
  """Runs a whole job; returns the summary dict (also written to summary.json)."""
  return Run(config).train()
