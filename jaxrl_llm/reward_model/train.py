"""Reward-model training on the learner's machinery (``jaxrl-train`` with ``job="reward_model"``).

The model is the run's decoder (``config.model``, or ``init.hf_checkpoint``)
with a scalar reward head read at the EOS token (:mod:`.eos`). One run, in order:

1. set-up: validate the config, check that the run folder is writable, build
   task, tokenizer, mesh, model (parameters in the mesh sharding), the
   preference data (:mod:`.preferences`) and the optimizers; resume from the
   latest checkpoint when one exists;
2. optional SFT warm start (``sft.steps``) on the task's gold responses, with
   the policy's SFT step (the trunk learns the task's language first);
3. evaluation of the warm start on the held-out pairs (pairwise accuracy and
   mean margin; 0.5 is chance), then ``reward_model.steps`` steps of the
   Bradley-Terry loss (:mod:`.loss`) on ``reward_model.batch_size`` pairs, with
   the learner's micro-batching (``learner.micro_batches``) and guarded update
   (a non-finite loss or gradient skips the step); periodic held-out
   evaluation (``eval.every``) and orbax checkpoints (``checkpoint.every``);
4. outputs in the run folder, as for an RL run: ``metrics.jsonl``,
   TensorBoard events, ``curves.png`` (loss and held-out accuracy), a
   ``summary.json`` and the model as a Hugging Face folder in ``hf_export/``
   (the trunk as ``model.safetensors``, the reward head in the heads side file
   ``jaxrl_llm_extra/heads.safetensors``), which RL runs use as their reward
   (``reward_model.path``) and critic initialisation (``critic.init_from``).

The optimizer is ``optimizer.*`` with ``reward_model.lr``; its state is reset
when the warm start ends, so the reward phase starts its schedule at step 0.
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

from jaxrl_llm import bridge, configuration, models, reduce
from jaxrl_llm.diagnostics import writers
from jaxrl_llm.learner import builders, checkpoint, mesh as mesh_lib, optim, sft, update
from jaxrl_llm.learner.state import TrainState, create_train_state
from jaxrl_llm.models.config import ModelConfig
from jaxrl_llm.reward_model import loss as rm_loss
from jaxrl_llm.reward_model.encoding import PairEncoder, PreferenceBatch, collate_pairs, encode_prompt
from jaxrl_llm.reward_model.preferences import PreferencePair, build_preference_data
from jaxrl_llm.tasks import get_task

log = logging.getLogger("jaxrl_llm")

# Consecutive training pairs that do not fit the context before the run gives up.
MAX_CONSECUTIVE_TOO_LONG = 1000


class NonFiniteError(RuntimeError):
  """Raised after ``learner.max_nonfinite_in_a_row`` consecutive skipped updates."""


@dataclasses.dataclass
class Progress:
  """Host-side position of a reward-model run (saved as JSON next to the arrays)."""

  phase: str = "sft"  # "sft" | "rm" | "done"
  sft_step: int = 0
  rm_step: int = 0
  sft_stream: Optional[dict] = None
  pair_position: int = 0
  pairs_seen: int = 0
  skipped_too_long: int = 0
  initial_eval: Optional[dict] = None
  nonfinite_in_a_row: int = 0
  skipped_updates: int = 0


def pair_scores(params: Any, config: ModelConfig, batch: PreferenceBatch) -> tuple[jax.Array, jax.Array]:
  """Scores of both sides of every pair in one forward pass over ``[2B, T]`` rows.

  Returns:
    ``(chosen_b, rejected_b)``, float32 [B] each.
  """
  tokens = jnp.concatenate([batch.chosen_bt, batch.rejected_bt], axis=0)
  mask = jnp.concatenate([batch.chosen_mask_bt, batch.rejected_mask_bt], axis=0)
  scores = models.reward_scores(params, config, tokens, mask).astype(jnp.float32)
  half = batch.chosen_bt.shape[0]
  return scores[:half], scores[half:]


def make_rm_step(config: ModelConfig, optimizer, micro_batches: int = 1, lm_coef: float = 0.0):
  """Returns a jitted ``step(state, batch) -> (state, metrics)`` of the Bradley-Terry loss.

  ``loss = mean_pairs BT + lm_coef * token-mean NLL of the chosen responses`` (the
  optional language-model term keeps the trunk predicting good responses, which
  is what a verifier-like reward model reads; 0 drops it). Each micro-batch's
  sums are divided by the whole batch's pair and target-token counts, so
  micro-batch losses add up to the full-batch loss; the gradients are summed in
  a fixed order (:func:`jaxrl_llm.learner.update.accumulate`) and applied by the
  guarded update (skipped when non-finite).

  Metrics: ``rm/loss`` (the total), ``rm/bt_loss``, ``rm/lm_loss``,
  ``rm/accuracy``, ``rm/margin``, ``rm/chosen``, ``rm/rejected``, ``rm/pairs``,
  ``grad_norm``, ``update/skipped_nonfinite``, ``update/param_norm``.
  """

  def loss_fn(params, mb: PreferenceBatch, counts):
    pairs, tokens = counts
    chosen, rejected = pair_scores(params, config, mb)
    bt = reduce.safe_div(reduce.batch_sum(rm_loss.pairwise_losses(chosen, rejected, mb.margin_b), mb.valid_b),
                         pairs)
    lm = jnp.zeros((), jnp.float32)
    if lm_coef:
      logp = models.sequence_logprobs(params, config, mb.chosen_bt, mb.chosen_mask_bt)
      lm = reduce.safe_div(reduce.token_sum(-logp, mb.chosen_target_mask_bt & mb.valid_b[:, None]), tokens)
    return bt + lm_coef * lm, (chosen, rejected, bt, lm)

  @jax.jit
  def step(state: TrainState, batch: PreferenceBatch):
    counts = (reduce.batch_count(batch.valid_b),
              reduce.token_count(batch.chosen_target_mask_bt & batch.valid_b[:, None]))
    total, grads, (chosen, rejected, bt, lm) = update.accumulate(loss_fn, state.params, batch, micro_batches,
                                                                 counts)
    state, metrics = update.apply_policy_update(state, grads, total, optimizer)
    pm = rm_loss.preference_metrics(chosen.reshape(-1), rejected.reshape(-1), batch.valid_b)
    metrics.update({"rm/loss": total, "rm/bt_loss": jnp.sum(bt), "rm/lm_loss": jnp.sum(lm),
                    **{f"rm/{k}": v for k, v in pm.items()}})
    return state, metrics

  return step


def _place(tree: Any, mesh) -> Any:
  """Leaves already sharded on ``mesh`` stay; the rest (counters, RNG) are replicated on it."""
  replicated = mesh_lib.replicated(mesh)

  def place(x):
    sharding = getattr(x, "sharding", None)
    if isinstance(sharding, jax.sharding.NamedSharding) and sharding.mesh == mesh:
      return x
    return jax.device_put(x, replicated)

  return jax.tree.map(place, tree)


class RewardModelRun:
  """A configured reward-model run. ``RewardModelRun(config).train()`` does everything."""

  def __init__(self, config: ml_collections.ConfigDict):
    configuration.validate(config)
    self.config = config
    rc = config.reward_model
    self.run_dir = os.path.abspath(configuration.run_dir(config))
    checkpoint.check_writable(self.run_dir, "run folder (run_dir)")
    self.checkpointer = checkpoint.Checkpointer(os.path.join(self.run_dir, "checkpoints"),
                                                keep=config.checkpoint.keep, save_every=config.checkpoint.every)
    self.task = get_task(config.task.name, **dict(config.task.kwargs))
    self.tokenizer = builders.build_tokenizer(config, self.task)
    self.mesh = mesh_lib.make_mesh(dict(config.learner.mesh))
    self.model_config = builders.build_model_config(config, self.tokenizer, reward_head=True)
    self.data = build_preference_data(rc, self.task, config.seed, config.task.eval_size)
    self.encoder = PairEncoder(self.tokenizer, config.task.use_chat_template,
                               self.model_config.max_position_embeddings)
    o = config.optimizer
    self.optimizer = optim.make_optimizer(rc.lr, o.warmup_steps, max(1, rc.steps), o.schedule,
                                          weight_decay=o.weight_decay, b1=o.b1, b2=o.b2,
                                          max_grad_norm=o.max_grad_norm)
    self.sft_optimizer = builders.build_sft_optimizer(config)
    params = builders.build_params(config, self.model_config, self.mesh, config.seed,
                                   config.init.hf_checkpoint or None)
    self._state = _place(jax.jit(lambda p: create_train_state(p, self.optimizer, config.seed))(params), self.mesh)
    self.progress = Progress()
    if config.checkpoint.resume and self.checkpointer.latest_step() is not None:
      state, extra, step = self.checkpointer.restore(self._state)
      self._state = _place(state, self.mesh)
      self.progress = Progress(**extra["progress"])
      print(f"Resumed from {self.checkpointer.directory} at step {step} ({self.progress.phase} phase).")
    self._rm_step = make_rm_step(self.model_config, self.optimizer, config.learner.micro_batches,
                                 rc.lm_coef)
    self._sft_step = sft.make_sft_step(self.model_config, self.sft_optimizer, config.learner.micro_batches)
    self._scores = jax.jit(lambda p, b: pair_scores(p, self.model_config, b))
    self._eval_loss = jax.jit(rm_loss.bradley_terry_loss)
    self._accuracy = jax.jit(rm_loss.pairwise_accuracy)
    self._eval_batches = self._encode_eval()

  @property
  def params(self) -> Any:
    return self._state.params

  # ------------------------------------------------------------------ data

  def _margin(self, pair: PreferencePair) -> float:
    return float(self.config.reward_model.margin if pair.margin is None else pair.margin)

  def _encode_eval(self) -> list[tuple[PreferenceBatch, list[str]]]:
    """Held-out pairs as fixed-size batches (with each pair's kind); too-long pairs are counted and left out."""
    size = self.config.reward_model.batch_size
    encoded, margins, kinds = [], [], []
    self.eval_too_long = 0
    for pair in self.data.eval_pairs:
      enc = self.encoder.pair(pair)
      if enc is None:
        self.eval_too_long += 1
        continue
      encoded.append(enc)
      margins.append(self._margin(pair))
      kinds.append(pair.kind)
    if self.eval_too_long:
      log.warning("%d held-out pairs exceed the context (%d tokens) and are not evaluated", self.eval_too_long,
                  self.encoder.max_length)
    if not encoded:
      raise ValueError("no held-out preference pair fits the model's context; check reward_model.eval_data / "
                       "eval_fraction and model.max_position_embeddings")
    return [(collate_pairs(encoded[i:i + size], margins[i:i + size], self.tokenizer.pad_id, size,
                           self.encoder.max_length), kinds[i:i + size]) for i in range(0, len(encoded), size)]

  def next_batch(self) -> PreferenceBatch:
    """The next ``reward_model.batch_size`` training pairs that fit the context (skips counted)."""
    size = self.config.reward_model.batch_size
    encoded, margins, too_long = [], [], 0
    while len(encoded) < size:
      pair = self.data.train_pair(self.progress.pair_position)
      self.progress.pair_position += 1
      enc = self.encoder.pair(pair)
      if enc is None:
        too_long += 1
        self.progress.skipped_too_long += 1
        if too_long >= MAX_CONSECUTIVE_TOO_LONG:
          raise ValueError(f"{too_long} consecutive training pairs (last: {pair.source}) exceed the context of "
                           f"{self.encoder.max_length} tokens (model.max_position_embeddings)")
        continue
      too_long = 0
      encoded.append(enc)
      margins.append(self._margin(pair))
    self.progress.pairs_seen += size
    return collate_pairs(encoded, margins, self.tokenizer.pad_id, size, self.encoder.max_length)

  # ------------------------------------------------------------------ evaluation

  def evaluate(self) -> dict[str, float]:
    """Held-out pairwise accuracy, mean margin, loss and chosen / rejected score means (and per kind)."""
    chosen, rejected, margins, kinds = [], [], [], []
    for batch, batch_kinds in self._eval_batches:
      c, r = self._scores(self._state.params, batch)
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

  # ------------------------------------------------------------------ phases

  def _track_nonfinite(self, metrics: dict) -> None:
    if float(metrics["update/skipped_nonfinite"]) > 0:
      self.progress.skipped_updates += 1
      self.progress.nonfinite_in_a_row += 1
      log.warning("non-finite loss or gradient: update skipped (%d in a row)", self.progress.nonfinite_in_a_row)
      limit = self.config.learner.max_nonfinite_in_a_row
      if self.progress.nonfinite_in_a_row >= limit:
        raise NonFiniteError(f"{self.progress.nonfinite_in_a_row} consecutive updates had a non-finite loss or "
                             f"gradient (limit learner.max_nonfinite_in_a_row={limit}); stopping. The last good "
                             f"state is in {self.checkpointer.directory}.")
    else:
      self.progress.nonfinite_in_a_row = 0

  def _save(self, force: bool = False) -> None:
    step = self.progress.sft_step + self.progress.rm_step
    if force or self.checkpointer.should_save(step):
      self.checkpointer.save(step, self._state, {"progress": dataclasses.asdict(self.progress)})

  def run_sft(self, mw: writers.MetricsWriter) -> None:
    """The warm start: the policy's SFT step on the task's gold responses (the reward head is untouched)."""
    c = self.config
    stream = self.task.train_prompts(seed=c.seed + 1000)
    if self.progress.sft_stream:
      stream.set_state(self.progress.sft_stream)
    while self.progress.sft_step < c.sft.steps:
      examples = [next(stream) for _ in range(c.sft.batch_size)]
      batch = sft.collate([encode_prompt(self.tokenizer, e.prompt, c.task.use_chat_template) for e in examples],
                          [self.tokenizer.encode(self.task.sft_target(e), add_special_tokens=False)
                           for e in examples],
                          self.tokenizer.eos_id, self.tokenizer.pad_id, self.model_config.max_position_embeddings)
      self._state, m = self._sft_step(self._state, batch)
      self.progress.sft_step += 1
      self.progress.sft_stream = stream.get_state()
      self._track_nonfinite(m)
      if self.progress.sft_step % c.log.every == 0:
        mw.write(self.progress.sft_step - c.sft.steps, m)
      self._save()

  def run_rm(self, mw: writers.MetricsWriter) -> None:
    c = self.config
    while self.progress.rm_step < c.reward_model.steps:
      t0 = time.perf_counter()
      batch = self.next_batch()
      self._state, m = self._rm_step(self._state, batch)
      self._track_nonfinite(m)
      self.progress.rm_step += 1
      step = self.progress.rm_step
      m = dict(m, **{"time/step_s": time.perf_counter() - t0, "data/pairs_seen": float(self.progress.pairs_seen),
                     "data/skipped_too_long": float(self.progress.skipped_too_long)})
      if step % c.eval.every == 0 or step == c.reward_model.steps:
        m.update(self.evaluate())
      if step % c.log.every == 0 or "eval/pairwise_accuracy" in m:
        mw.write(step, m)
      self._save()

  # ------------------------------------------------------------------ whole run

  def train(self) -> dict:
    c = self.config
    start = time.time()
    mw = writers.MetricsWriter(self.run_dir, c.sft.steps + c.reward_model.steps, description=c.name,
                               progress=c.log.progress, tensorboard=c.log.tensorboard)
    try:
      if self.progress.phase == "sft":
        if c.sft.steps:
          self.run_sft(mw)
        # the reward phase starts its own optimizer schedule
        self._state = self._state.replace(opt_state=_place(jax.jit(self.optimizer.init)(self._state.params),
                                                           self.mesh))
        self.progress.initial_eval = self.evaluate()
        mw.write(0, self.progress.initial_eval)
        self.progress.phase = "rm"
        self._save(force=True)
      if self.progress.phase == "rm":
        self.run_rm(mw)
        self.progress.phase = "done"
        self._save(force=True)
      final = self.evaluate()
    finally:
      mw.close()
      self.checkpointer.close()
    return self._finish(final, time.time() - start, mw)

  def _finish(self, final: dict, seconds: float, mw: writers.MetricsWriter) -> dict:
    c = self.config
    records = writers.read_jsonl(mw.jsonl_path)
    plot = writers.plot_curves(records, os.path.join(self.run_dir, "curves.png"),
                               ["rm/loss", "eval/pairwise_accuracy"], title=c.name)
    export_dir = None
    if c.export.hf:
      export_dir = bridge.export_hf_checkpoint(self._state.params, self.model_config,
                                               os.path.join(self.run_dir, "hf_export"), tokenizer=self.tokenizer)
    initial = self.progress.initial_eval or {}
    summary = {
        "name": c.name,
        "job": "reward_model",
        "heldout_pairwise_accuracy": final["eval/pairwise_accuracy"],
        "heldout_mean_margin": final["eval/mean_margin"],
        "heldout_loss": final["eval/loss"],
        "heldout_accuracy_by_kind": {k.split("/", 2)[2]: v for k, v in final.items()
                                     if k.startswith("eval/accuracy/")},
        "initial_pairwise_accuracy": initial.get("eval/pairwise_accuracy"),
        "heldout_pairs": int(final["eval/pairs"]),
        "sft_steps": self.progress.sft_step,
        "rm_steps": self.progress.rm_step,
        "pairs_seen": self.progress.pairs_seen,
        "data": dict(self.data.stats, train_skipped_too_long=self.progress.skipped_too_long,
                     eval_skipped_too_long=self.eval_too_long),
        "skipped_updates": self.progress.skipped_updates,
        "wall_clock_s": seconds,
        "run_dir": self.run_dir,
        "outputs": {"metrics": mw.jsonl_path, "tensorboard": mw.tb_dir, "plot": plot, "hf_export": export_dir,
                    "checkpoints": self.checkpointer.directory},
    }
    with open(os.path.join(self.run_dir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
    print(f"\n{c.name}: held-out pairwise accuracy {summary['initial_pairwise_accuracy'] or 0:.3f} before "
          f"reward training -> {summary['heldout_pairwise_accuracy']:.3f} after {summary['rm_steps']} steps "
          f"(mean margin {summary['heldout_mean_margin']:.3f}, {summary['heldout_pairs']} pairs, {seconds:.0f} s)."
          f"\nOutputs in {self.run_dir}: metrics.jsonl, tensorboard/, curves.png, summary.json"
          + (", hf_export/" if export_dir else ""))
    return summary


def train(config: ml_collections.ConfigDict) -> dict:
  """Runs a whole reward-model job; returns the summary dict (also written to summary.json)."""
  return RewardModelRun(config).train()
