"""Tiny run configs shared by the job tests (a 1-layer decoder on 1-digit addition).

``overrides`` use ``__`` for dots: ``tiny_config(path, rl__steps=4, learner__mesh__data=1)``.
"""

import ml_collections

from jaxrl_llm import configuration as C


def _apply(c, overrides):
  for path, value in overrides.items():
    C.override(c, path.replace("__", "."), value)
  return c


def _tiny_model(c, run_dir, name):
  c.name = name
  c.run_dir = str(run_dir)
  c.model.hidden_size = 32
  c.model.intermediate_size = 64
  c.model.num_layers = 1
  c.model.num_heads = 2
  c.model.num_kv_heads = 1
  c.model.max_position_embeddings = 32
  c.task.kwargs = ml_collections.ConfigDict({"max_digits": 1, "eval_fraction": 0.3})
  c.log.progress = False
  return c


def tiny_config(run_dir, **overrides):
  """An RL run: 3 SFT steps, 2 RL steps of 2 prompts x 2 samples, checkpoint every step."""
  c = _tiny_model(C.base_config(), run_dir, "tiny")
  c.task.eval_size = 8
  c.sft.steps = 3
  c.sft.batch_size = 8
  c.rl.steps = 2
  c.rl.prompts_per_step = 2
  c.rl.samples_per_prompt = 2
  c.rl.max_new_tokens = 4
  c.eval.every = 2
  c.eval.pass_k = 2
  c.checkpoint.every = 1
  if "objective__recipe" not in overrides:  # GRPO without its KL term (no reference policy), as before
    c.objective.kwargs = ml_collections.ConfigDict({"kl_coef": 0.0})
  return _apply(c, overrides)


def tiny_rm_config(run_dir, **overrides):
  """A reward-model run on the built-in addition pairs (one device)."""
  c = _tiny_model(C.base_config(), run_dir, "tiny_rm")
  c.job = "reward_model"
  c.task.eval_size = 16
  c.sft.steps = 0
  c.reward_model.steps = 40
  c.reward_model.batch_size = 32
  c.reward_model.lr = 3e-3
  c.reward_model.eval_pairs = 64
  c.reward_model.pair_kinds = "padded,extra_digit"  # decidable by a 1-layer model in a few steps
  c.learner.mesh.data = 1  # one device: the 8-device mesh is exercised by the scorer tests
  c.eval.every = 20
  c.checkpoint.every = 1000
  return _apply(c, overrides)
