"""The preference-optimisation job (``jaxrl-train`` with ``job="dpo"``): DPO, IPO or SimPO on preference pairs.

The policy (``config.model``, or ``init.hf_checkpoint``; no reward head) is
trained directly on pairs, without a reward model or sampling. On the shared
scaffolding (:class:`~jaxrl_llm.jobs.base.Job`): an optional SFT warm start on the
task's gold responses (``sft.steps``), then the reference policy is frozen (the
parameters at that moment; DPO and IPO only, SimPO is reference-free), the
optimizer is reset and the warm start is evaluated, then ``dpo.steps`` steps of
``dpo.loss`` (:mod:`jaxrl_llm.objectives.preference`) on ``dpo.batch_size`` pairs,
with periodic held-out evaluation (``eval.every``).

The pairs are the reward model's (``reward_model.data`` JSONL or the task's
built-in pairs, :func:`~jaxrl_llm.reward_model.preferences.build_preference_data`),
encoded as ``prompt | response | EOS`` (:class:`~jaxrl_llm.reward_model.PairEncoder`).
A response's log-probability is the sum of its tokens' (EOS included, the prompt
excluded) under the policy (:func:`pair_logprobs`); SimPO divides it by the
response length.

Evaluation: on the held-out pairs, the preferred-answer rate (share of pairs whose
chosen response the policy gives the higher log-probability; length-normalised for
SimPO), the implicit-reward accuracy and margin, and the mean loss; on the task's
held-out problems, the greedy accuracy and pass@k of the policy
(:class:`~jaxrl_llm.jobs.evaluation.PolicyEvaluator`, as the RL job measures it).

References: Rafailov et al., arXiv:2305.18290 (DPO); Azar et al., arXiv:2310.12036
(IPO); Meng et al., arXiv:2405.14734 (SimPO).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrl_llm import models, reduce
from jaxrl_llm.diagnostics import writers
from jaxrl_llm.jobs.base import PolicyJob, place_on_mesh
from jaxrl_llm.jobs.hooks import EvaluationHook
from jaxrl_llm.jobs.prompt_check import check_prompts
from jaxrl_llm.jobs.score import reward_runner
from jaxrl_llm.learner import builders, optim, update
from jaxrl_llm.learner.state import TrainState, create_train_state
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.objectives import preference
from jaxrl_llm.reward_model.encoding import PairEncoder, PairStream, PreferenceBatch, held_out_batches
from jaxrl_llm.reward_model.preferences import build_preference_data
from jaxrl_llm.tasks import build_eval_set

__all__ = ["PreferenceLoss", "PreferenceOptimizationJob", "PreferenceState", "make_preference_step",
           "pair_logprobs"]


@struct.dataclass
class PreferenceState:
  """The arrays of a preference run (a checkpoint's array item).

  Attributes:
    train: the policy's parameters, optimizer state, version and RNG.
    ref_params: the frozen reference policy (the parameters when the warm start ended), or None
      (before then, and always for SimPO).
  """

  train: TrainState
  ref_params: Any = None


@dataclasses.dataclass(frozen=True)
class PreferenceLoss:
  """One of :data:`~jaxrl_llm.objectives.preference.PREFERENCE_LOSSES` with its hyper-parameters (``config.dpo``)."""

  loss: str = "dpo"
  beta: float = 0.1
  label_smoothing: float = 0.0
  gamma: float = 0.5
  nll_coef: float = 0.0

  @property
  def uses_ref(self) -> bool:
    return self.loss != "simpo"

  def __call__(self, logps: tuple, refs: tuple) -> tuple[jax.Array, jax.Array, jax.Array]:
    """``(losses_b, chosen_reward_b, rejected_reward_b)``, float32 [B] each.

    Args:
      logps: ``(pi_c, pi_r, len_c, len_r)``, float32 [B] each (:func:`pair_logprobs`).
      refs: ``(ref_c, ref_r)``, the reference's summed log-probabilities (ignored by SimPO).
    """
    pc, pr, lc, lr = logps
    losses, chosen, rejected = preference.pair_losses(self.loss, pc, pr, *refs, lc, lr, beta=self.beta,
                                                      label_smoothing=self.label_smoothing, gamma=self.gamma)
    if self.nll_coef:  # RPO (Pang et al. 2024, arXiv:2404.19733): + coef * per-token NLL of the chosen response
      losses = losses - self.nll_coef * pc / jnp.maximum(lc, 1.0)
    return losses, chosen, rejected

  def preferred(self, logps: tuple) -> tuple[jax.Array, jax.Array]:
    """What the preferred-answer rate compares: summed log-probabilities, length-normalised for SimPO."""
    pc, pr, lc, lr = logps
    if self.loss == "simpo":
      return pc / jnp.maximum(lc, 1.0), pr / jnp.maximum(lr, 1.0)
    return pc, pr


def pair_logprobs(params: Any, config: ModelConfig, batch: PreferenceBatch
                  ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
  """Summed response log-probabilities of both sides of every pair, one forward pass over ``[2B, T]`` rows.

  Only the response tokens and their EOS count (``*_target_mask_bt``), never the prompt.

  Returns:
    ``(chosen_b, rejected_b, chosen_length_b, rejected_length_b)``, float32 [B] each (lengths in tokens).
  """
  tokens = jnp.concatenate([batch.chosen_bt, batch.rejected_bt], axis=0)
  mask = jnp.concatenate([batch.chosen_mask_bt, batch.rejected_mask_bt], axis=0)
  targets = jnp.concatenate([batch.chosen_target_mask_bt, batch.rejected_target_mask_bt], axis=0)
  logp = models.sequence_logprobs(params, config, tokens, mask)
  sums, lengths = reduce.masked_row_sum(logp, targets), reduce.row_count(targets)
  half = batch.chosen_bt.shape[0]
  return sums[:half], sums[half:], lengths[:half], lengths[half:]


def _reference(config: ModelConfig, spec: PreferenceLoss, ref_params: Any, batch: PreferenceBatch) -> tuple:
  """``(ref_c, ref_r)`` of the frozen reference (zeros for SimPO, which has none)."""
  if not spec.uses_ref:
    zeros = jnp.zeros(batch.valid_b.shape, jnp.float32)
    return zeros, zeros
  ref_c, ref_r, _, _ = pair_logprobs(ref_params, config, batch)
  return jax.lax.stop_gradient(ref_c), jax.lax.stop_gradient(ref_r)


def make_preference_step(config: ModelConfig, optimizer: Any, spec: PreferenceLoss, micro_batches: int = 1):
  """Returns a jitted ``step(state, batch) -> (state, metrics)`` of ``spec``'s loss.

  ``loss = sum_{valid pairs} l_i / n_valid``: the reference log-probabilities are computed
  first for the whole batch (no gradient), then each micro-batch's summed loss is divided by
  the whole batch's pair count, so micro-batch losses add up to the full-batch loss; the
  gradients are summed in a fixed order (:func:`jaxrl_llm.learner.update.accumulate`; with LoRA
  adapters, of the adapters alone) and applied by the guarded update (skipped when non-finite).

  Metrics: ``dpo/loss``, ``dpo/reward_accuracy``, ``dpo/reward_margin``, ``dpo/reward_chosen``,
  ``dpo/reward_rejected`` (implicit rewards), ``dpo/preferred_rate``, ``dpo/logp_chosen``,
  ``dpo/logp_rejected``, ``dpo/pairs``, ``grad_norm``, ``update/skipped_nonfinite``, ``update/param_norm``.
  """

  def loss_fn(params, mb, pairs):
    batch, ref_c, ref_r = mb
    logps = pair_logprobs(params, config, batch)
    losses, chosen, rejected = spec(logps, (ref_c, ref_r))
    return reduce.safe_div(reduce.batch_sum(losses, batch.valid_b), pairs), (*logps, chosen, rejected)

  @jax.jit
  def step(state: PreferenceState, batch: PreferenceBatch):
    ref_c, ref_r = _reference(config, spec, state.ref_params, batch)
    pairs = reduce.batch_count(batch.valid_b)
    total, grads, aux = update.accumulate(loss_fn, state.train.params, (batch, ref_c, ref_r), micro_batches, pairs,
                                          adapters_only=config.lora_rank > 0)
    train, metrics = update.apply_policy_update(state.train, grads, total, optimizer)
    pc, pr, lc, lr, chosen, rejected = (x.reshape(-1) for x in aux)
    valid = batch.valid_b
    pm = preference.preference_metrics(chosen, rejected, valid)
    metrics.update({"dpo/loss": total, "dpo/reward_accuracy": pm["accuracy"], "dpo/reward_margin": pm["margin"],
                    "dpo/reward_chosen": pm["chosen"], "dpo/reward_rejected": pm["rejected"], "dpo/pairs": pm["pairs"],
                    "dpo/preferred_rate": preference.pairwise_accuracy(*spec.preferred((pc, pr, lc, lr)), valid),
                    "dpo/logp_chosen": reduce.batch_mean(pc, valid), "dpo/logp_rejected": reduce.batch_mean(pr, valid)})
    return state.replace(train=train), metrics

  return step


class PreferenceOptimizationJob(PolicyJob):
  """A configured DPO / IPO / SimPO run. ``PreferenceOptimizationJob(config).train()`` does everything."""

  main_phase = "dpo"
  plot_keys = ("dpo/loss", "eval/preferred_rate", "eval/accuracy")

  def build(self) -> None:
    c = self.config
    dc = self.settings.dpo
    self.spec = PreferenceLoss(dc.loss, dc.beta, dc.label_smoothing, dc.simpo_gamma, dc.nll_coef)
    self.model_config = builders.build_model_config(c, self.tokenizer)
    self.task, self.long_prompts = check_prompts(self, c.rl.max_new_tokens)  # evaluation samples rl.max_new_tokens
    self.data = build_preference_data(c.reward_model, self.task, c.seed, c.task.eval_size)
    self.encoder = PairEncoder(self.tokenizer, c.task.use_chat_template, self.model_config.max_position_embeddings)
    o = c.optimizer
    self.optimizer = builders.for_trainable(c, optim.make_optimizer(  # model.lora: the adapters alone train
        dc.lr, o.warmup_steps, max(1, dc.steps), o.schedule, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2,
        max_grad_norm=o.max_grad_norm))
    params = builders.build_params(c, self.model_config, self.mesh, c.seed, c.init.hf_checkpoint or None)
    train = jax.jit(lambda p: create_train_state(p, self.optimizer, c.seed))(params)
    self.state = place_on_mesh(PreferenceState(train=train), self.mesh)
    self.sft_step = self.make_sft_step(builders.build_sft_optimizer(c))
    self.dpo_step = make_preference_step(self.model_config, self.optimizer, self.spec, c.learner.micro_batches)
    self._logps = jax.jit(lambda p, b: pair_logprobs(p, self.model_config, b))
    self._eval_metrics = jax.jit(self._held_out_metrics)
    self._accuracy = jax.jit(preference.pairwise_accuracy)
    self.pairs = PairStream()
    self.register_state("pairs", self.pairs)
    self.eval_batches, self.eval_too_long = held_out_batches(self.data.eval_pairs, self.encoder, dc.batch_size,
                                                             self.tokenizer.pad_id, lambda pair: 0.0)
    self.eval_set = build_eval_set(self.task, c.task.eval_size, seed=c.seed)
    self.rewards = reward_runner(self.task.reward, self.settings.reward, name="task")  # evaluation only
    self.on_close(self.rewards.close)
    self.register_state("eval_rewards", self.rewards)
    self.add_hook(EvaluationHook(c.eval.every, dc.steps))

  def restorable_like(self, state: PreferenceState) -> PreferenceState:
    if self.spec.uses_ref and state.ref_params is None:
      return state.replace(ref_params=state.train.params)  # a checkpoint of the main phase holds the reference
    return state

  def after_restore(self) -> None:
    self.start_local_sampler(self.make_sampler_config(1), self.rewards)

  def main_steps(self) -> int:
    return self.config.dpo.steps

  def next_batch(self) -> PreferenceBatch:
    """The next ``dpo.batch_size`` training pairs that fit the context (skips counted)."""
    return self.pairs.next_batch(self.data, self.encoder, self.config.dpo.batch_size, self.tokenizer.pad_id,
                                 lambda pair: 0.0)

  # ------------------------------------------------------------------ steps and evaluation

  def step(self) -> dict:
    t0 = time.perf_counter()
    self.state, m = self.dpo_step(self.state, self.next_batch())
    self.track_nonfinite(m)
    return dict(m, **self.pairs.metrics(), **{"time/step_s": time.perf_counter() - t0})

  def _held_out_metrics(self, logps: tuple, refs: tuple) -> tuple[dict, tuple]:
    """Loss, implicit-reward metrics and preferred-answer rate of the concatenated held-out pairs,
    and what the rate compares (per pair)."""
    losses, chosen, rejected = self.spec(logps, refs)
    valid = jnp.ones(losses.shape, bool)
    pm = preference.preference_metrics(chosen, rejected, valid)
    pc, pr = self.spec.preferred(logps)
    return {"eval/preferred_rate": preference.pairwise_accuracy(pc, pr, valid),
            "eval/loss": reduce.batch_mean(losses, valid), "eval/reward_accuracy": pm["accuracy"],
            "eval/reward_margin": pm["margin"], "eval/logp_chosen": reduce.batch_mean(logps[0], valid),
            "eval/logp_rejected": reduce.batch_mean(logps[1], valid), "eval/pairs": pm["pairs"]}, (pc, pr)

  def evaluate(self) -> dict[str, float]:
    """Held-out preferred-answer rate (and per kind), implicit-reward accuracy, loss; greedy accuracy and pass@k."""
    parts, kinds = [], []
    for batch, batch_kinds in self.eval_batches:
      n = len(batch_kinds)
      logps = self._logps(self.params, batch)
      refs = (self._logps(self.state.ref_params, batch)[:2] if self.state.ref_params is not None
              else (jnp.zeros_like(logps[0]),) * 2)
      parts.append([np.asarray(x)[:n] for x in (*logps, *refs)])
      kinds += batch_kinds
    columns = [np.concatenate(col) for col in zip(*parts)]
    metrics, (pc, pr) = self._eval_metrics(tuple(columns[:4]), tuple(columns[4:]))
    out = {k: float(v) for k, v in metrics.items()}
    kinds = np.asarray(kinds)
    for kind in sorted(set(kinds) - {""}):
      out[f"eval/preferred_rate/{kind}"] = float(self._accuracy(pc, pr, kinds == kind))
    self.publish_local()
    out.update(self.evaluator(self.eval_set.examples, self.progress.sft_step + self.progress.step))
    return out

  # ------------------------------------------------------------------ phases and outputs

  def end_warm_start(self, writer: writers.MetricsWriter) -> None:
    """Freezes the reference (DPO, IPO), resets the optimizer and evaluates the warm start."""
    train = self.state.train
    train = train.replace(opt_state=place_on_mesh(jax.jit(self.optimizer.init)(train.params), self.mesh))
    ref = jax.tree.map(jnp.copy, train.params) if self.spec.uses_ref else None
    self.state = self.state.replace(train=train, ref_params=ref)
    self.progress.warm_start = self.evaluate()
    writer.write(0, self.progress.warm_start)

  def summary(self, final: dict) -> dict:
    initial = self.progress.warm_start or {}
    k = self.config.eval.pass_k
    return {"loss": self.spec.loss,
            "heldout_preferred_rate": final["eval/preferred_rate"],
            "initial_preferred_rate": initial.get("eval/preferred_rate"),
            "heldout_greedy_accuracy": final["eval/accuracy"],
            "initial_greedy_accuracy": initial.get("eval/accuracy"),
            f"heldout_pass@{k}": final.get(f"eval/pass@{k}"),
            "heldout_reward_accuracy": final["eval/reward_accuracy"],
            "heldout_reward_margin": final["eval/reward_margin"],
            "heldout_loss": final["eval/loss"], "initial_loss": initial.get("eval/loss"),
            "heldout_preferred_rate_by_kind": {key.split("/", 2)[2]: v for key, v in final.items()
                                               if key.startswith("eval/preferred_rate/")},
            "heldout_pairs": int(final["eval/pairs"]), "dpo_steps": self.progress.step, "pairs_seen": self.pairs.seen,
            "rewards": self.rewards.metrics, "long_prompts": self.long_prompts,
            "data": dict(self.data.stats, train_skipped_too_long=self.pairs.skipped_too_long,
                         eval_skipped_too_long=self.eval_too_long)}

  def headline(self, summary: dict) -> str:
    def fmt(x):
      return "n/a" if x is None else f"{x:.3f}"

    return (f"{summary['loss'].upper()}: held-out preferred rate {fmt(summary['initial_preferred_rate'])} -> "
            f"{fmt(summary['heldout_preferred_rate'])}, greedy accuracy {fmt(summary['initial_greedy_accuracy'])} -> "
            f"{fmt(summary['heldout_greedy_accuracy'])} after {summary['dpo_steps']} steps "
            f"({summary['heldout_pairs']} held-out pairs)")
