"""Periodic hooks of the RL job: controller, rejection-sampling fine-tuning, guard, evaluation.

A hook runs after an RL step when it is due (``Hook.due(step)``, with
``step`` the number of steps done) and returns metrics for that step's
record. The RL job registers them in this order, which is the order they run
in: :class:`ControllerHook`, :class:`RFTHook`, :class:`GuardHook`,
:class:`PolicyVersionHook`, :class:`EvaluationHook`. A hook with host state
(``get_state``/``set_state``) is checkpointed with the run under its name.

Adding a hook is one class here (or in your own module) plus
``job.add_hook(MyHook())``; see docs/architecture.md for a worked example.
"""

from __future__ import annotations

import logging
from typing import Any

from jaxrl_llm import objectives as O
from jaxrl_llm.diagnostics import control, guard as guard_lib
from jaxrl_llm.jobs.base import Hook
from jaxrl_llm.learner import optim, rft

__all__ = ["ControllerHook", "EvaluationHook", "GuardHook", "PolicyVersionHook", "RFTHook", "apply_control"]

log = logging.getLogger("jaxrl_llm")


def apply_control(state: Any, controller: control.OffPolicyController, kl_coef_base: float) -> Any:
  """Writes the controller's clip scale and KL coefficient into the run state's objective state."""
  st = controller.state
  obj = state.objective
  keys = O.control_keys(obj)
  if control.CLIP_KEY in keys:
    obj = O.set_control(obj, control.CLIP_KEY, st.clip_scale)
  if st.kl_coef is not None and control.KL_KEY in keys:
    obj = O.set_control(obj, control.KL_KEY, st.kl_coef / kl_coef_base)
  return state.replace(objective=obj)


class ControllerHook(Hook):
  """Every step: the off-policy controller reacts to the step's drift, staleness and KL.

  The clip scale (and KL coefficient) go into the objective state (no
  recompilation); the staleness window goes to a pipeline source's ``max_lag``.
  """

  name = "controller"

  def __init__(self, controller: control.OffPolicyController, kl_coef_base: float):
    self.controller = controller
    self.kl_coef_base = kl_coef_base

  def __call__(self, job: Any, step: int, metrics: dict) -> dict:
    kl = metrics.get("kl_loss/kl_mean")
    out = self.controller.update(drift=metrics.get("offpolicy/drift_tv"),
                                 staleness=metrics.get("offpolicy/staleness_tv"),
                                 kl=None if kl is None else float(kl), episodes=int(metrics["data/rows"]))
    job.state = apply_control(job.state, self.controller, self.kl_coef_base)
    if hasattr(job.source, "max_lag"):
      job.source.max_lag = self.controller.state.max_lag
    return out

  def get_state(self) -> dict:
    return self.controller.get_state()

  def set_state(self, state: dict) -> None:
    self.controller.set_state(state)


class RFTHook(Hook):
  """Every ``data.rft_every`` steps: one SFT step on the best of each group's n samples.

  The last batch's groups whose best reward reaches ``min_reward`` (finished
  responses only) contribute their best sample; the step uses the RL
  optimizer (its moments and schedule continue) and bumps the policy version.
  References: Touvron et al., Llama 2, arXiv:2307.09288 (rejection-sampling
  fine-tuning); Yuan et al., arXiv:2308.01825 (RFT).
  """

  name = "rft"

  def __init__(self, every: int, min_reward: float, sft_step: Any):
    self.every = every
    self.min_reward = min_reward
    self.sft_step = sft_step

  def due(self, step: int) -> bool:
    return step % self.every == 0

  def __call__(self, job: Any, step: int, metrics: dict) -> dict:
    c = job.config
    examples, responses, rewards, finished = job.last_samples
    n = c.rl.samples_per_prompt
    rows = rft.select_best_of_k(rewards, n, self.min_reward, finished)
    out = rft.best_of_k_metrics(rewards, rows, n)
    if rows.size == 0:
      return out
    batch = rft.rft_batch([job.encode_prompt(e.prompt) for e in examples], responses, rows, job.tokenizer.eos_id,
                          job.tokenizer.pad_id, c.model.max_position_embeddings,
                          num_rows=max(c.rl.prompts_per_step, len(examples)))
    train, m = self.sft_step(job.state.train, batch)
    job.state = job.state.replace(train=train)
    out.update({f"rft/{k}": v for k, v in m.items()})
    return out


class GuardHook(Hook):
  """Every ``guard.every`` steps: held-out greedy accuracy; roll back on a significant drop.

  On a regression the run returns to the last good version's parameters,
  optimizer and objective state, with the learning-rate scale (and, under
  control, the clip scale) multiplied by the shrink factors; policy versions
  stay monotone for the samplers. Otherwise the current version becomes the
  last good one.
  """

  name = "guard"

  def __init__(self, guard: guard_lib.ImprovementGuard, examples: list, lr_shrink: float, clip_shrink: float):
    self.guard = guard
    self.examples = examples
    self.lr_shrink = lr_shrink
    self.clip_shrink = clip_shrink

  def due(self, step: int) -> bool:
    return self.guard.due(step)

  def __call__(self, job: Any, step: int, metrics: dict) -> dict:
    correct = job.greedy_correct(self.examples)
    verdict = self.guard.judge(step, float(correct.mean()), int(correct.size))
    print(verdict.message(step))
    out = {"guard/accuracy": verdict.accuracy, "guard/rolled_back": float(verdict.rollback)}
    state = job.state
    if verdict.rollback:
      good_train, good_objective = state.good
      opt_state = optim.set_lr_scale(good_train.opt_state, optim.get_lr_scale(good_train.opt_state) * self.lr_shrink)
      train = good_train.replace(opt_state=opt_state, policy_version=state.train.policy_version + 1)
      job.state = state.replace(train=train, objective=good_objective)
      if job.controller is not None:
        job.controller.shrink_clip(self.clip_shrink)
        job.state = apply_control(job.state, job.controller, job.kl_coef_base)
      log.warning("guard rolled back to the version of RL step %d; learning-rate scale now %.3g",
                  self.guard.state.good_step, optim.get_lr_scale(opt_state))
    else:
      job.state = state.replace(good=(state.train, state.objective))
    out["optimizer/lr_scale"] = optim.get_lr_scale(job.state.train.opt_state)
    out.update(self.guard.metrics())
    return out

  def get_state(self) -> dict:
    return self.guard.get_state()

  def set_state(self, state: dict) -> None:
    self.guard.set_state(state)


class PolicyVersionHook(Hook):
  """Every step: records ``policy_version`` after the hooks that may change it (RFT, guard)."""

  name = "policy_version"

  def __call__(self, job: Any, step: int, metrics: dict) -> dict:
    return {"policy_version": float(job.state.train.policy_version)}


class EvaluationHook(Hook):
  """Every ``eval.every`` steps and after the last one: the job's held-out evaluation."""

  name = "evaluation"

  def __init__(self, every: int, last_step: int):
    self.every = every
    self.last_step = last_step

  def due(self, step: int) -> bool:
    return step % self.every == 0 or step == self.last_step

  def __call__(self, job: Any, step: int, metrics: dict) -> dict:
    return job.evaluate()

