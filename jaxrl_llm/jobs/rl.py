"""The RL job behind ``jaxrl-train``: SFT warm start, then RL as named stages.

One RL step (:meth:`RLJob.step`) is five stages, each a function or object a
test can call alone::

  rollout = source.collect(t)                      # collect (jaxrl_llm.rollout.sources)
  rewards = score(rollout)                         # score   (jaxrl_llm.jobs.score)
  batch   = compute_advantages(spec, inputs)       # advantages, a pure function (jobs.advantages)
  result  = update(state, batch, ...)              # update: jitted step + consistency check (jobs.update)
  source.publish(new params, version)              # the samplers get the new weights

followed by the periodic hooks (controller, RFT, guard, evaluation;
:mod:`jaxrl_llm.jobs.hooks`) and a checkpoint when due (:class:`~jaxrl_llm.jobs.base.Job`).

The source is synchronous (samples in this process), dynamic sampling (DAPO)
or the PipelineRL pipeline of Ray sampler actors (``rollout.mode``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_llm import models, reward_model
from jaxrl_llm.errors import ConfigError
from jaxrl_llm.diagnostics import control, guard as guard_lib, offpolicy, writers
from jaxrl_llm.jobs import hooks as H
from jaxrl_llm.jobs.advantages import AdvantageInputs, AdvantageSpec, compute_advantages, gae_advantages
from jaxrl_llm.jobs.base import PolicyJob, place_on_mesh
from jaxrl_llm.jobs.collect import SourceFactory
from jaxrl_llm.jobs.demonstrations import DemonstrationStream, mix_demonstrations
from jaxrl_llm.jobs.stale_check import StaleConsistencyCheck
from jaxrl_llm.jobs.prompt_check import check_prompts
from jaxrl_llm.jobs.episodes import EpisodeEvaluator, build_episode_runner, episode_runner_builder
from jaxrl_llm.jobs.score import RewardStage, reward_runner, training_rewards
from jaxrl_llm.jobs.update import PolicyUpdate, RunState
from jaxrl_llm.learner import builders, mesh as mesh_lib, optim, rl_step, update
from jaxrl_llm.learner.state import create_train_state
from jaxrl_llm.rollout import sources
from jaxrl_llm.rollout.lagged import ParamsWindow
from jaxrl_llm.tasks import PromptSource, build_eval_set, curation

__all__ = ["RLJob", "StateSlot"]

log = logging.getLogger("jaxrl_llm")


class StateSlot:
  """A named piece of host state saved with checkpoints through two callables."""

  def __init__(self, get_state, set_state):
    self.get_state, self.set_state = get_state, set_state


class RLJob(PolicyJob):
  """A configured RL run. ``RLJob(config).train()`` does everything; the stages are public."""

  main_phase = "rl"
  plot_keys = ("reward/mean", "eval/accuracy")

  # ------------------------------------------------------------------ set-up

  def build(self) -> None:
    c = self.config
    # Batch-invariant mode: gradients of learner.grad_atoms atoms summed by a fixed tree (learner/update.py).
    self.grad_atoms = c.learner.grad_atoms if c.model.batch_invariant else 0
    if self.grad_atoms:
      mesh_lib.check_grad_atoms(self.mesh, self.grad_atoms)
    if jax.process_count() > 1 and c.rollout.mode == "pipeline":
      raise ConfigError(f"rollout.mode='pipeline' with a multi-process learner ({jax.process_count()} processes): "
                        "expected rollout.mode='sync' (the Ray sampler pool is driven from one learner process; "
                        "for sampler actors, run the learner as one process)")
    self.model_config = builders.build_model_config(c, self.tokenizer)
    budget = ((c.env.max_tokens, "env.max_tokens") if c.env.name  # an episode's model and observation tokens
              else (c.rl.max_new_tokens, "rl.max_new_tokens"))
    self.task, self.long_prompts = check_prompts(self, *budget)  # every row fits, or stop here
    self.critic_config = self.model_config.replace(value_head=True) if c.critic.enabled else None
    self.optimizer = builders.build_optimizer(c, c.sft.steps + c.rl.steps * c.rl.updates_per_batch)
    critic_optimizer = optim.make_optimizer(c.critic.lr, max_grad_norm=c.optimizer.max_grad_norm)
    self.critic_optimizer = builders.for_trainable(c, critic_optimizer) if c.critic.enabled else None
    self.objective = builders.build_objective(c)
    self.uses_ref = builders.needs_reference_policy(c)
    self.kl_coef_base = builders.objective_kl_coef(c)
    self.eval_set = build_eval_set(self.task, c.task.eval_size, seed=c.seed)
    self.sampler_config = self.make_sampler_config(c.rl.samples_per_prompt)
    self.state = self.initial_state()
    self.sft_step = self.make_sft_step(builders.build_sft_optimizer(c), self.grad_atoms)
    self._build_stages()
    self._build_hooks()

  def initial_state(self) -> RunState:
    c = self.config
    params = builders.build_params(c, self.model_config, self.mesh, c.seed, c.init.hf_checkpoint or None)
    critic_params = None
    if self.critic_config is not None:
      critic_params = builders.build_params(c, self.critic_config, self.mesh, c.seed + 1,
                                            c.critic.init_from or c.init.hf_checkpoint or None)
    train = create_train_state(params, self.optimizer, c.seed, critic_params, self.critic_optimizer)
    objective = self.objective.init(None)
    good = (train, objective) if c.guard.enabled else None  # same structure from the start: restorable
    return place_on_mesh(RunState(train=train, objective=objective, ref_params=None, good=good), self.mesh)

  def _build_stages(self) -> None:
    c = self.config
    n = c.rl.samples_per_prompt
    if c.data.curate:
      self.prompts = curation.CuratedPromptSource(self.task, c.rl.prompts_per_step, seed=c.seed, samples_per_prompt=n,
                                                  config=self.settings.curation)
    else:
      self.prompts = PromptSource(self.task, c.rl.prompts_per_step, seed=c.seed, samples_per_prompt=n)
    self.prompt_state: Optional[dict] = None
    self.register_state("prompts", StateSlot(lambda: self.prompt_state, self._set_prompt_state))
    runner = reward_runner(self.task.reward, self.settings.reward, name="task")  # config.reward: worker processes
    self.on_close(runner.close)
    # Evaluation scores through the same runner's workers with its own counters; its failures never stop the run.
    self.eval_rewards = runner.sharing("eval")
    self.register_state("eval_rewards", self.eval_rewards)
    sequence_rewards = reward_model.build_sequence_rewards(c, self.mesh, self.tokenizer, self.task, self.greedy)
    train_rewards = training_rewards(self.task, self.settings.reward, runner)  # reward.functions: weighted plug-ins
    self.on_close(train_rewards.close)
    self.score = RewardStage(train_rewards, self.decode_response, n, sequence_rewards=sequence_rewards,
                             reward_clip=c.advantage.reward_clip,
                             record=self.prompts.record if c.data.curate else None)
    self.register_state("rewards", self.score)
    self.advantage_spec = AdvantageSpec(
        estimator=c.advantage.estimator, normalization=c.advantage.normalization, group_size=n,
        gamma=c.advantage.gamma, lam=c.advantage.lam, filter_zero_variance=c.rl.filter_zero_variance,
        row_granule=self.row_granule(), kl_shaper=reward_model.build_kl_shaper(c),
        norm_level=c.advantage.norm_level, norm_shift_mean=c.advantage.norm_shift_mean, mesh=self.mesh)
    self.kl_coef: Optional[float] = None  # the KL penalty's current beta (adaptive)
    self.register_state("kl_reward", StateSlot(lambda: {"coef": self.kl_coef}, self._set_kl_coef))
    whole = (lambda f: update.replicated(f, self.mesh)) if self.grad_atoms else (lambda f: f)
    self.policy_logp = jax.jit(whole(lambda p, t, m: models.sequence_logprobs(p, self.model_config, t, m,
                                                                               c.rl.temperature)))
    self.critic_values = (jax.jit(whole(lambda p, t, m: rl_step.shifted_values(p, self.critic_config, t, m)))
                          if self.critic_config is not None else None)
    self.thresholds = self.settings.consistency
    # The parameters of the last versions of the lag window: the simulated lag samples from the oldest,
    # the stale consistency check re-scores stale rows with their own version's.
    self.versions = ParamsWindow(self.lag_window() + 1)
    stale_check = StaleConsistencyCheck(self.versions, self.policy_logp, self.thresholds,
                                        max_rows=c.diagnostics.stale_check_rows,
                                        max_unchecked=c.diagnostics.max_unchecked_steps)
    self.register_state("stale_check", stale_check)
    self.demonstrations = None
    if c.data.sft_mix:
      self.demonstrations = DemonstrationStream(
          c.data.sft_mix, self.task, c.seed + 2000, self.encode_prompt,
          lambda text: self.tokenizer.encode(text, add_special_tokens=False))
      self.register_state("demonstrations", self.demonstrations)
    self.alerts = offpolicy.AlertReporter()
    self.register_state("alerts", StateSlot(self.alerts.state_dict, self.alerts.load_state_dict))
    self.on_close(self._flush_alerts)
    spec = rl_step.RLStepSpec(model=self.model_config, temperature=c.rl.temperature, group_size=n,
                              micro_batches=c.learner.micro_batches, use_ref=self.uses_ref,
                              use_entropy=builders.objective_uses_entropy(c), critic=self.critic_config,
                              train_actor=True, grad_atoms=self.grad_atoms, proximal=self.proximal_source())
    self.update = PolicyUpdate(
        spec, self.objective, self.optimizer, self.critic_optimizer, mesh=self.mesh,
        updates_per_batch=c.rl.updates_per_batch, logp=self.policy_logp,
        diagnostics=offpolicy.StepDiagnostics(self.thresholds, max_abs_advantage=c.diagnostics.max_abs_advantage),
        consistency_action=c.diagnostics.consistency_action, drift_every=c.diagnostics.drift_every,
        track_nonfinite=self.track_nonfinite, stale_check=stale_check)
    self.episodes = episode_builder = None  # config.env: multi-turn episodes
    if self.settings.env.enabled:
      self.episodes = build_episode_runner(self.settings.env, self.task, self.tokenizer, self.encode_prompt)
      episode_builder = episode_runner_builder(self.settings.env, self.task, self.tokenizer,
                                               c.task.use_chat_template)
    self.sources = SourceFactory(c, model_config=self.model_config, sampler_config=self.sampler_config,
                                 tokenizer=self.tokenizer, prompts=self.prompts, encode_prompt=self.encode_prompt,
                                 score=self.score, versions=self.versions, run_dir=self.run_dir,
                                 episodes=self.episodes, episode_builder=episode_builder)
    self.register_state("pipeline", self.sources)  # the pipeline's sampled, untrained work
    self.source: Any = None  # made when the RL phase starts (Ray actors only then)
    self.last_samples: Any = None  # (examples, response ids, rewards, finished) of the last batch, for RFT
    self._recompute = None  # GAE path: advantages with the updated critic (advantage drift)

  def _build_hooks(self) -> None:
    c = self.config
    self.controller = None
    if c.control.enabled:
      self.controller = control.OffPolicyController(self.settings.control, kl_coef=self.kl_coef_base)
      self.add_hook(H.ControllerHook(self.controller, self.kl_coef_base))
    if c.data.rft_every:
      self.add_hook(H.RFTHook(c.data.rft_every, c.data.rft_min_reward,
                              self.make_sft_step(self.optimizer)))
    self.guard_hook = None
    if c.guard.enabled:
      gs = self.settings.guard
      self.guard_hook = H.GuardHook(guard_lib.ImprovementGuard(gs),
                                    list(build_eval_set(self.task, gs.eval_size, seed=c.seed + 7).examples),
                                    gs.lr_shrink, gs.clip_shrink)
      self.add_hook(self.guard_hook)
    self.add_hook(H.PolicyVersionHook())
    self.add_hook(H.EvaluationHook(c.eval.every, c.rl.steps))

  def make_evaluator(self, rewards: Any) -> Any:
    """Held-out evaluation by episodes when ``config.env`` is set (see ``jobs.episodes``)."""
    if self.episodes is None:
      return super().make_evaluator(rewards)
    return EpisodeEvaluator(self.sampler, self.episodes, rewards, seed=self.config.seed,
                            pass_k=self.config.eval.pass_k)

  def proximal_source(self) -> str:
    """Where the step's pi_k comes from (``objective.proximal``; see ``rl_step.PROXIMAL_SOURCES``):
    the update's own forward when it sees the whole batch once, else one forward before the first update."""
    c = self.config
    if c.objective.proximal == "behaviour":
      return "behaviour"
    whole_once = c.rl.updates_per_batch == 1 and c.learner.micro_batches == 1 and not self.grad_atoms
    return "forward" if whole_once else "batch"

  def lag_window(self) -> int:
    """The most versions a batch's data may lag behind the learner (simulated or pipeline)."""
    c = self.config
    if c.rollout.simulated_lag:
      return c.rollout.simulated_lag
    return c.rollout.max_lag if c.rollout.mode == "pipeline" else 0

  def restorable_like(self, state: RunState) -> RunState:
    if self.uses_ref and state.ref_params is None:
      return state.replace(ref_params=state.train.params)
    return state

  def after_restore(self) -> None:
    if self.controller is not None:
      self.state = H.apply_control(self.state, self.controller, self.kl_coef_base)
    self.start_local_sampler(self.sampler_config, self.eval_rewards)

  def _flush_alerts(self) -> None:
    for line in self.alerts.flush(self.progress.step):
      log.warning("RL step %d: %s", self.progress.step, line)

  def _set_prompt_state(self, state: dict) -> None:
    self.prompt_state = state
    self.prompts.set_state(state)

  def _set_kl_coef(self, state: dict) -> None:
    self.kl_coef = state.get("coef")

  def row_granule(self) -> int:
    """Smallest learner batch: a multiple of the group size, micro-batches and data-parallel size
    (invariant mode: whole groups in each of the atoms, the same on every mesh)."""
    c = self.config
    if self.grad_atoms:
      return c.rl.samples_per_prompt * self.grad_atoms
    data = int(np.prod([self.mesh.shape[a] for a in self.mesh.axis_names if a in ("data", "fsdp")]))
    return int(np.lcm.reduce([c.rl.samples_per_prompt, c.learner.micro_batches, data]))

  # ------------------------------------------------------------------ the RL step

  def main_steps(self) -> int:
    return self.config.rl.steps

  def step(self) -> dict:
    """One RL step: collect -> score -> advantages -> update -> publish."""
    t = self.progress.step
    source = self.start_source()
    t0 = time.perf_counter()
    rollout = source.collect(t)                                    # 1. collect
    batch, metrics = self.prepare(rollout)                         # 2. score, 3. advantages
    t1 = time.perf_counter()
    metrics.update(self.learn(batch, metrics))                     # 4. update (+ consistency check)
    t_publish = time.perf_counter()
    self.versions.push(int(self.state.train.policy_version), self.params)
    source.publish(self.params, int(self.state.train.policy_version))  # 5. publish to the samplers
    t2 = time.perf_counter()
    self.prompt_state = source.prompt_state(t)
    tokens = float(np.asarray(batch.response_mask_bt).sum())
    metrics.update({"time/publish_s": t2 - t_publish, "time/learn_s": t2 - t1, "time/step_s": t2 - t0,
                    "throughput/tokens_per_s": tokens / max(t2 - t0, 1e-9)})
    return metrics

  def start_source(self) -> sources.RolloutSource:
    """The RL phase's source of samples, started on first use (Ray actors only then)."""
    if self.source is None:
      self.versions.reset(int(self.state.train.policy_version), self.state.train.params)
      lag = self.controller.state.max_lag if self.controller is not None else self.config.rollout.max_lag
      self.source = self.sources.make(self.state.train.params, int(self.state.train.policy_version),
                                      self.progress.step, self.sampler, lag)
      self.on_close(self.source.close)
    return self.source

  def prepare(self, rollout: sources.Rollout) -> tuple[rl_step.RLBatch, dict]:
    """Score (unless the source did) and advantages: the batch to train on and the data metrics."""
    traj = rollout.trajectory.trimmed(multiple=8)
    rewards, reward_metrics = ((rollout.rewards, rollout.reward_metrics) if rollout.rewards is not None
                               else self.score(rollout.examples, traj, rollout.response_tokens))
    self.score.end_step()  # stops the run when the reward failed on most calls for reward.failure_steps steps
    self.last_samples = (rollout.examples, rollout.response_tokens, rewards, np.asarray(traj.finished_b))
    out = compute_advantages(self.advantage_spec, self.advantage_inputs(traj, rewards))
    self.kl_coef = out.kl_coef if out.kl_coef is not None else self.kl_coef
    self._recompute = self.advantage_recomputer(out, out.batch)
    batch = self.with_reference(self.with_demonstrations(out.batch))
    metrics = {**reward_metrics, **out.metrics, **self.sampling_metrics(rollout, traj), **rollout.metrics,
               "data/rows": float(batch.tokens_bt.shape[0])}
    return batch, metrics

  def learn(self, batch: rl_step.RLBatch, data_metrics: dict) -> dict:
    """The update stage on ``batch`` (``rl.updates_per_batch`` steps, consistency check, diagnostics)."""
    t = self.progress.step
    result = self.update(self.state, batch, step=t, train_actor=self.trains_actor(t),
                         filter_rate=data_metrics.get("data/zero_variance_groups", 0.0),
                         recompute_advantages=self._recompute)
    self.state = result.state
    return {**result.metrics, **self.report_alerts(t, result)}

  def advantage_inputs(self, traj: Any, rewards: np.ndarray) -> AdvantageInputs:
    """The advantages stage's inputs: for GAE, the critic's values (and the reference's
    log-probabilities for the KL penalty), from forward passes on the sampled rows."""
    values = ref = None
    if self.advantage_spec.estimator == "gae":
      tokens = jnp.asarray(traj.tokens_bt)
      seq = jnp.asarray(traj.sequence_mask_bt)
      values = self.critic_values(self.state.train.critic_params, tokens, seq)
      if self.advantage_spec.kl_shaper is not None:
        ref = self.policy_logp(self.state.ref_params, tokens, seq)
    return AdvantageInputs(traj, rewards, int(self.state.train.policy_version), values, ref, self.kl_coef)

  def with_reference(self, batch: rl_step.RLBatch) -> rl_step.RLBatch:
    """Fills the reference log-probabilities the objective needs (after filtering: fewer rows)."""
    if not self.uses_ref or self.advantage_spec.kl_shaper is not None:
      return batch
    return batch.replace(ref_logp_bt=self.policy_logp(self.state.ref_params, batch.tokens_bt, batch.seq_mask_bt))

  def with_demonstrations(self, batch: rl_step.RLBatch) -> rl_step.RLBatch:
    """Appends ``data.sft_mix_rows`` demonstration rows (``data.sft_mix``; :mod:`jaxrl_llm.jobs.demonstrations`)."""
    if self.demonstrations is None:
      return batch
    c = self.config
    params = self.state.train.params
    return mix_demonstrations(batch, self.demonstrations.next_pairs(c.data.sft_mix_rows),
                              eos_id=self.tokenizer.eos_id, pad_id=self.tokenizer.pad_id,
                              max_length=c.model.max_position_embeddings,
                              logp=lambda t, m: self.policy_logp(params, t, m))

  def advantage_recomputer(self, out: Any, batch: rl_step.RLBatch) -> Optional[Callable]:
    """GAE path: ``state -> advantages`` with the updated critic (the advantage drift), else None."""
    if out.rewards_bt is None:
      return None

    def recompute(state: RunState):
      values = self.critic_values(state.train.critic_params, batch.tokens_bt, batch.seq_mask_bt)
      return gae_advantages(self.advantage_spec, out.rewards_bt, values, batch.response_mask_bt)[0]

    return recompute

  def trains_actor(self, step: int) -> bool:
    """False while the critic warms up (``critic.warmup_steps``: the actor is frozen)."""
    c = self.config
    return step >= c.critic.warmup_steps or not c.critic.enabled

  def sampling_metrics(self, rollout: sources.Rollout, traj: Any) -> dict:
    gen_tokens = int(np.asarray(traj.response_mask_bt).sum())
    out = {"throughput/sample_tokens_per_s": gen_tokens / max(rollout.sample_seconds, 1e-9),
           "time/sample_s": rollout.sample_seconds, **self.score.runner_metrics(), **self.eval_rewards.metrics}
    if self.config.data.curate:
      out.update(self.prompts.metrics())
    return out

  def report_alerts(self, step: int, result: Any) -> dict:
    """Logs the step's alerts (each kind once with its cause, then rate-limited); returns ``alerts/*``."""
    for line in self.alerts.report(step, result.alerts):
      log.warning("RL step %d: %s", step, line)
    if result.skipped:
      log.warning("RL step %d: update discarded (consistency check failed; diagnostics.consistency_action=skip)",
                  step)
    return self.alerts.metrics()

  # ------------------------------------------------------------------ policy access

  def greedy(self, examples) -> tuple[Any, list[str]]:
    """The current policy's greedy answers: ``(Trajectory, texts)`` (reward-model baselines)."""
    self.publish_local()
    return self.evaluator.greedy(examples)

  def greedy_correct(self, examples) -> np.ndarray:
    self.publish_local()
    return self.evaluator.greedy_correct(examples)

  def evaluate(self) -> dict[str, float]:
    """Greedy accuracy and pass@k on the held-out set."""
    self.publish_local()
    return self.evaluator(self.eval_set.examples, self.progress.sft_step + self.progress.step)

  # ------------------------------------------------------------------ phases and outputs

  def end_warm_start(self, writer: writers.MetricsWriter) -> None:
    """Evaluates the warm start; freezes the reference policy; the guard's first good version."""
    self.progress.warm_start = self.evaluate()
    writer.write(0, {k.replace("eval/", "warm_start/"): v for k, v in self.progress.warm_start.items()})
    writer.write(0, self.progress.warm_start)
    if self.uses_ref:
      self.state = self.state.replace(ref_params=jax.tree.map(jnp.copy, self.state.train.params))
    if self.guard_hook is not None:
      writer.write(0, self.guard_hook(self, 0, {}))

  def summary(self, final: dict) -> dict:
    k = self.config.eval.pass_k
    return {"final_accuracy": final["eval/accuracy"], f"final_pass@{k}": final[f"eval/pass@{k}"],
            "warm_start_accuracy": (self.progress.warm_start or {}).get("eval/accuracy"),
            "rl_steps": self.progress.step, "alerts": dict(self.alerts.counts),
            "rewards": {**self.score.runner_metrics(), **self.eval_rewards.metrics},
            "sampler_pool": pool.stats.as_metrics() if (pool := getattr(self.source, "pool", None)) else None,
            "sampler_placement": pool.placement if pool else None,
            "guard_rollbacks": self.guard_hook.guard.state.rollbacks if self.guard_hook is not None else 0,
            "long_prompts": self.long_prompts,
            "controller": self.controller.get_state() if self.controller is not None else None}

  def headline(self, summary: dict) -> str:
    return (f"held-out greedy accuracy {summary['warm_start_accuracy'] or 0:.3f} after the warm start -> "
            f"{summary['final_accuracy']:.3f} after {summary['rl_steps']} RL steps")
