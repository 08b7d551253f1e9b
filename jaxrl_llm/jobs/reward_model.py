"""The reward-model job (``jaxrl-train`` with ``job="reward_model"``).

The model is the run's decoder (``config.model``, or ``init.hf_checkpoint``)
with a scalar reward head read at the EOS token (:mod:`jaxrl_llm.reward_model.eos`).
On the shared scaffolding (:class:`~jaxrl_llm.jobs.base.Job`): an optional SFT
warm start on the task's gold responses (the trunk learns the task's language
first), an evaluation on the held-out pairs (pairwise accuracy and mean margin;
0.5 is chance), then ``reward_model.steps`` steps of the Bradley-Terry loss
(:func:`jaxrl_llm.reward_model.step.make_rm_step`) on ``reward_model.batch_size``
pairs, with periodic held-out evaluation (``eval.every``). The outputs are an RL
run's, with the model exported as a Hugging Face folder whose heads side file
holds the reward head: RL runs use it as their reward (``reward_model.path``)
and critic initialisation (``critic.init_from``).

The optimizer is ``optimizer.*`` with ``reward_model.lr``; its state is reset
when the warm start ends, so the reward phase starts its schedule at step 0.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import numpy as np

from jaxrl_llm.diagnostics import writers
from jaxrl_llm.jobs.base import Job, place_on_mesh
from jaxrl_llm.jobs.hooks import EvaluationHook
from jaxrl_llm.jobs.prompt_check import check_prompts
from jaxrl_llm.learner import builders, optim
from jaxrl_llm.learner.state import create_train_state
from jaxrl_llm.reward_model import loss as rm_loss
from jaxrl_llm.reward_model.encoding import PairEncoder, PairStream, PreferenceBatch, held_out_batches
from jaxrl_llm.reward_model.preferences import PreferencePair, build_preference_data
from jaxrl_llm.reward_model.step import make_rm_step, pair_scores

__all__ = ["PairStream", "RewardModelJob"]


class RewardModelJob(Job):
  """A configured reward-model run. ``RewardModelJob(config).train()`` does everything."""

  main_phase = "rm"
  plot_keys = ("rm/loss", "eval/pairwise_accuracy")

  def build(self) -> None:
    c = self.config
    rc = c.reward_model
    self.model_config = builders.build_model_config(c, self.tokenizer, reward_head=True)
    self.task, self.long_prompts = check_prompts(self, None)  # the warm start's rows fit, or stop here
    self.data = build_preference_data(rc, self.task, c.seed, c.task.eval_size)
    self.encoder = PairEncoder(self.tokenizer, c.task.use_chat_template, self.model_config.max_position_embeddings)
    o = c.optimizer
    self.optimizer = builders.for_trainable(c, optim.make_optimizer(
        rc.lr, o.warmup_steps, max(1, rc.steps), o.schedule, weight_decay=o.weight_decay, b1=o.b1, b2=o.b2,
        max_grad_norm=o.max_grad_norm))
    params = builders.build_params(c, self.model_config, self.mesh, c.seed, c.init.hf_checkpoint or None)
    self.state = place_on_mesh(jax.jit(lambda p: create_train_state(p, self.optimizer, c.seed))(params), self.mesh)
    self.sft_step = self.make_sft_step(builders.build_sft_optimizer(c))
    self.rm_step = make_rm_step(self.model_config, self.optimizer, c.learner.micro_batches, rc.lm_coef)
    self.scores = jax.jit(lambda p, b: pair_scores(p, self.model_config, b))
    self._eval_loss = jax.jit(rm_loss.bradley_terry_loss)
    self._accuracy = jax.jit(rm_loss.pairwise_accuracy)
    self.pairs = PairStream()
    self.register_state("pairs", self.pairs)
    self.eval_batches = self._encode_eval()
    self.add_hook(EvaluationHook(c.eval.every, rc.steps))

  @property
  def train_state(self) -> Any:
    return self.state

  def set_train_state(self, train: Any) -> None:
    self.state = train

  @property
  def params(self) -> Any:
    return self.state.params

  def main_steps(self) -> int:
    return self.config.reward_model.steps

  # ------------------------------------------------------------------ data

  def _margin(self, pair: PreferencePair) -> float:
    return float(self.config.reward_model.margin if pair.margin is None else pair.margin)

  def _encode_eval(self) -> list[tuple[PreferenceBatch, list[str]]]:
    """Held-out pairs as fixed-size batches (with each pair's kind); too-long pairs are counted and left out."""
    batches, self.eval_too_long = held_out_batches(self.data.eval_pairs, self.encoder,
                                                   self.config.reward_model.batch_size, self.tokenizer.pad_id,
                                                   self._margin)
    return batches

  def next_batch(self) -> PreferenceBatch:
    """The next ``reward_model.batch_size`` training pairs that fit the context (skips counted)."""
    return self.pairs.next_batch(self.data, self.encoder, self.config.reward_model.batch_size, self.tokenizer.pad_id,
                                 self._margin)

  # ------------------------------------------------------------------ steps and evaluation

  def step(self) -> dict:
    t0 = time.perf_counter()
    self.state, m = self.rm_step(self.state, self.next_batch())
    self.track_nonfinite(m)
    return dict(m, **self.pairs.metrics(), **{"time/step_s": time.perf_counter() - t0})

  def evaluate(self) -> dict[str, float]:
    """Held-out pairwise accuracy, mean margin, loss and chosen / rejected score means (and per kind)."""
    chosen, rejected, margins, kinds = [], [], [], []
    for batch, batch_kinds in self.eval_batches:
      c, r = self.scores(self.state.params, batch)
      n = len(batch_kinds)
      chosen.append(np.asarray(c)[:n])
      rejected.append(np.asarray(r)[:n])
      margins.append(np.asarray(batch.margin_b)[:n])
      kinds += batch_kinds
    chosen, rejected, margins = (np.concatenate(x) for x in (chosen, rejected, margins))
    total, metrics = self._eval_loss(chosen, rejected, margins)
    out = {"eval/pairwise_accuracy": float(metrics["accuracy"]), "eval/mean_margin": float(metrics["margin"]),
           "eval/loss": float(total), "eval/chosen_mean": float(metrics["chosen"]),
           "eval/rejected_mean": float(metrics["rejected"]), "eval/pairs": float(metrics["pairs"])}
    kinds = np.asarray(kinds)
    for kind in sorted(set(kinds) - {""}):
      out[f"eval/accuracy/{kind}"] = float(self._accuracy(chosen, rejected, kinds == kind))
    return out

  # ------------------------------------------------------------------ phases and outputs

  def end_warm_start(self, writer: writers.MetricsWriter) -> None:
    """Resets the optimizer (the reward phase starts its own schedule) and evaluates the warm start."""
    self.state = self.state.replace(opt_state=place_on_mesh(jax.jit(self.optimizer.init)(self.state.params),
                                                            self.mesh))
    self.progress.warm_start = self.evaluate()
    writer.write(0, self.progress.warm_start)

  def summary(self, final: dict) -> dict:
    initial = self.progress.warm_start or {}
    return {"heldout_pairwise_accuracy": final["eval/pairwise_accuracy"],
            "heldout_mean_margin": final["eval/mean_margin"], "heldout_loss": final["eval/loss"],
            "heldout_accuracy_by_kind": {k.split("/", 2)[2]: v for k, v in final.items()
                                         if k.startswith("eval/accuracy/")},
            "initial_pairwise_accuracy": initial.get("eval/pairwise_accuracy"),
            "heldout_pairs": int(final["eval/pairs"]), "rm_steps": self.progress.step,
            "pairs_seen": self.pairs.seen,
            "data": dict(self.data.stats, train_skipped_too_long=self.pairs.skipped_too_long,
                         eval_skipped_too_long=self.eval_too_long)}

  def headline(self, summary: dict) -> str:
    return (f"held-out pairwise accuracy {summary['initial_pairwise_accuracy'] or 0:.3f} before reward training -> "
            f"{summary['heldout_pairwise_accuracy']:.3f} after {summary['rm_steps']} steps (mean margin "
            f"{summary['heldout_mean_margin']:.3f}, {summary['heldout_pairs']} pairs)")
