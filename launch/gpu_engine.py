"""The engine part of ``launch.gpu_check``: its maths, the tiny checkpoint, and the learner side.

:func:`logprob_mismatch` and :func:`greedy_agreement` compare a sampler with the learner;
:func:`build_tiny_checkpoint` writes the small random Qwen2 (with transformers) that both
parts of the check run when no ``--hf_checkpoint`` is given; :func:`learner_mismatch` and
:func:`rl_update` are the learner's side of the engine part (jaxrl_llm's own log-probabilities
and one GRPO step).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

RATIO_BOUNDS = (0.8, 1.25)


# ------------------------------------------------------------------ the maths
def logprob_mismatch(learner_logp_bt: np.ndarray, behaviour_logp_bt: np.ndarray, mask_bt: np.ndarray,
                     bounds: tuple[float, float] = RATIO_BOUNDS) -> dict[str, float]:
  """Sampler-vs-learner disagreement on the sampled tokens.

  ``delta = log pi_learner(y_t) - log mu_sampler(y_t)`` over ``mask_bt``;
  the importance ratio is ``exp(delta)``.

  Args:
    learner_logp_bt: float [B, T] learner log-probabilities.
    behaviour_logp_bt: float [B, T] the sampler's recorded log-probabilities.
    mask_bt: bool [B, T] sampled tokens.
    bounds: ratio interval counted as "inside" (PipelineRL / ScaleRL use [0.8, 1.25]).

  Returns:
    ``{"tokens", "mean_abs", "max_abs", "mean", "outside_share"}``.
  """
  mask = np.asarray(mask_bt, bool)
  if mask.shape != np.shape(learner_logp_bt) or mask.shape != np.shape(behaviour_logp_bt):
    raise ValueError(f"logprob_mismatch: shapes {np.shape(learner_logp_bt)}, {np.shape(behaviour_logp_bt)} and "
                     f"mask {mask.shape} differ")
  if not mask.any():
    raise ValueError("logprob_mismatch: the mask selects no token")
  delta = (np.asarray(learner_logp_bt, np.float64) - np.asarray(behaviour_logp_bt, np.float64))[mask]
  ratio = np.exp(delta)
  outside = (ratio < bounds[0]) | (ratio > bounds[1])
  return {"tokens": int(mask.sum()), "mean_abs": float(np.abs(delta).mean()), "max_abs": float(np.abs(delta).max()),
          "mean": float(delta.mean()), "outside_share": float(outside.mean())}


def greedy_agreement(rows_a: Sequence[Sequence[int]], rows_b: Sequence[Sequence[int]]) -> dict[str, float]:
  """How far two greedy decoders agree, row by row.

  Returns:
    ``{"rows_identical": share of rows with equal responses,
    "prefix_share": mean over rows of (common prefix length / longer length)}``.
  """
  if len(rows_a) != len(rows_b) or not rows_a:
    raise ValueError(f"greedy_agreement: {len(rows_a)} vs {len(rows_b)} rows")
  identical, prefix = [], []
  for a, b in zip(rows_a, rows_b):
    a, b = list(a), list(b)
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
      common += 1
    identical.append(a == b)
    prefix.append(common / max(len(a), len(b), 1))
  return {"rows_identical": float(np.mean(identical)), "prefix_share": float(np.mean(prefix))}


# --------------------------------------------------------------------- steps

TINY_VOCAB = 128
TINY_TASK_CHARS = "0123456789+-*= abcdefghijklmnopqrstuvwxyz"  # the addition task's "+0123456789=" among them


def tiny_alphabet(size: int) -> str:
  """``size`` distinct characters: ``TINY_TASK_CHARS`` first, then upper case, punctuation (not ``<``/``>``,
  which spell the special tokens) and Greek letters.

  Raises:
    ValueError: when ``size`` is below ``len(TINY_TASK_CHARS)`` or above what the candidates hold.
  """
  import string  # pylint: disable=import-outside-toplevel
  greek = "".join(chr(c) for c in range(0x3B1, 0x3CA)) + "".join(chr(c) for c in range(0x391, 0x3AA) if c != 0x3A2)
  candidates = TINY_TASK_CHARS + string.ascii_uppercase + "".join(
      c for c in string.punctuation if c not in "<>") + greek
  chars = "".join(dict.fromkeys(candidates))
  if not len(TINY_TASK_CHARS) <= size <= len(chars):
    raise ValueError(f"tiny_alphabet: size={size}: expected {len(TINY_TASK_CHARS)}..{len(chars)}")
  return chars[:size]


def build_tiny_checkpoint(folder: str, seed: int) -> str:
  """A random Qwen2 (2 layers, hidden 256, head_dim 64, vocabulary 128) saved with transformers, and a char
  tokenizer with a token for every id, so whatever the random model samples decodes (the RL job decodes every
  response); its characters cover the addition task's."""
  import torch  # pylint: disable=import-outside-toplevel
  import transformers  # pylint: disable=import-outside-toplevel
  from jaxrl_llm import bridge  # pylint: disable=import-outside-toplevel
  from jaxrl_llm.bridge.tokenizer import DEFAULT_CHAR_SPECIALS  # pylint: disable=import-outside-toplevel
  specials = len(DEFAULT_CHAR_SPECIALS)
  tokenizer = bridge.build_char_tokenizer(tiny_alphabet(TINY_VOCAB - specials))
  config = transformers.Qwen2Config(
      vocab_size=TINY_VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
      num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, tie_word_embeddings=False,
      initializer_range=0.1, bos_token_id=tokenizer.bos_id, eos_token_id=tokenizer.eos_id,
      pad_token_id=tokenizer.pad_id)
  torch.manual_seed(seed)
  model = transformers.Qwen2ForCausalLM(config).float().eval()
  model.save_pretrained(folder)
  tokenizer.save(folder)
  return folder


def _learner_logp(params, model_config, result, temperature):
  from jaxrl_llm import models  # pylint: disable=import-outside-toplevel
  traj = result.trajectory
  mask = np.asarray(traj.sequence_mask_bt)
  return np.asarray(models.sequence_logprobs(params, model_config, traj.tokens_bt, mask, temperature))


def learner_mismatch(params, model_config, result, temperature) -> dict[str, float]:
  traj = result.trajectory
  return logprob_mismatch(_learner_logp(params, model_config, result, temperature), traj.behaviour_logp_bt,
                          traj.response_mask_bt)


def rl_update(params, model_config, result, temperature, num_samples, lr, seed):
  """One GRPO step of jaxrl_llm's learner on ``result`` (reward: share of even token ids)."""
  import jax.numpy as jnp  # pylint: disable=import-outside-toplevel
  from jaxrl_llm import advantages as A, objectives as O  # pylint: disable=import-outside-toplevel
  from jaxrl_llm.learner import optim, rl_step, state as state_lib  # pylint: disable=import-outside-toplevel
  traj = result.trajectory
  rewards = np.array([np.mean([t % 2 == 0 for t in r]) for r in result.response_tokens], np.float32)
  response = jnp.asarray(traj.response_mask_bt)
  adv = A.sequence_to_tokens(A.grpo_advantages(rewards, num_samples).advantages_b, response)
  zeros = jnp.zeros(response.shape, jnp.float32)
  batch = rl_step.RLBatch(tokens_bt=jnp.asarray(traj.tokens_bt),
                          seq_mask_bt=jnp.asarray(traj.sequence_mask_bt), response_mask_bt=response,
                          behaviour_logp_bt=jnp.asarray(traj.behaviour_logp_bt), advantages_bt=adv,
                          ref_logp_bt=zeros, lag_bt=jnp.zeros(response.shape, jnp.int32), old_values_bt=zeros,
                          returns_bt=zeros)
  objective = O.recipe("grpo", kl_coef=0.0)
  optimizer = optim.make_optimizer(lr)
  step = rl_step.make_rl_step(rl_step.RLStepSpec(model=model_config, temperature=temperature,
                                                 group_size=num_samples), objective, optimizer)
  train = state_lib.create_train_state(params, optimizer, seed)
  train, _, metrics = step(train, objective.init(None), batch)
  return train.params, {k: float(v) for k, v in metrics.items() if np.ndim(v) == 0}


# ------------------------------------------------------------------ multi-turn episodes
class _ScriptedEnvironment:
  """Answers each turn with a fixed observation and ends after ``turns`` turns (the check's episodes)."""

  def __init__(self, observation: str, turns: int):
    self.observation, self.turns, self.seen = observation, turns, 0

  def reset(self, example) -> str:
    return example.prompt

  def step(self, text: str):
    from jaxrl_llm.envs.base import StepResult  # pylint: disable=import-outside-toplevel
    self.seen += 1
    return StepResult("", reward=1.0, done=True) if self.seen >= self.turns else StepResult(self.observation)


def episode_mismatch(sampler, params, model_config, tokenizer, prompts: Sequence[Sequence[int]], temperature: float,
                     *, turns: int = 3, turn_tokens: int = 12, samples: int = 2, seed: int = 0,
                     open_session=None) -> dict:
  """Plays ``turns``-turn episodes with ``sampler`` (vLLM: a :class:`~jaxrl_llm.sampling.session.ReplaySession`,
  each turn re-submitting the history) and compares the behaviour log-probabilities of its model tokens
  with the learner's over the whole rows, overall and after the first observation. ``open_session``:
  the session maker (default: the sampler's own, :func:`jaxrl_llm.sampling.session.open_session`)."""
  import jax  # pylint: disable=import-outside-toplevel
  from jaxrl_llm import models  # pylint: disable=import-outside-toplevel
  from jaxrl_llm.envs.base import EpisodeLimits  # pylint: disable=import-outside-toplevel
  from jaxrl_llm.envs.episodes import EpisodeRunner  # pylint: disable=import-outside-toplevel
  from jaxrl_llm.envs.observation import ObservationFormat  # pylint: disable=import-outside-toplevel
  from jaxrl_llm.tasks.base import Example  # pylint: disable=import-outside-toplevel
  observation = tokenizer.decode(list(prompts[0][:4]))  # characters the tokenizer has
  runner = EpisodeRunner(
      env_factory=lambda example: _ScriptedEnvironment(observation, turns),
      limits=EpisodeLimits(max_turns=turns, max_tokens=turns * (turn_tokens + 8), max_turn_tokens=turn_tokens),
      encode_prompt=lambda text: tokenizer.encode(text, add_special_tokens=False),
      encode_text=lambda text: tokenizer.encode(text, add_special_tokens=False), decode=tokenizer.decode,
      observation_format=ObservationFormat.plain(), stop_token_ids=(tokenizer.eos_id,), pad_id=tokenizer.pad_id,
      **({"open_session": open_session} if open_session is not None else {}))
  examples = [Example(tokenizer.decode(list(p)), "") for p in prompts]
  out = runner.run(sampler, examples, samples, jax.random.PRNGKey(seed))
  traj = out.trajectory
  learner = np.asarray(models.sequence_logprobs(params, model_config, traj.tokens_bt, np.asarray(traj.sequence_mask_bt),
                                                temperature))
  response, obs = np.asarray(traj.response_mask_bt), np.asarray(traj.observation_mask_bt)
  after = response & (np.cumsum(obs, axis=1) > 0)
  report = {"rows": int(response.shape[0]), "observation_tokens": int(obs.sum()), "turns_mean": float(
      np.mean(out.stats["turns"])), "mismatch": logprob_mismatch(learner, traj.behaviour_logp_bt, response)}
  if after.any():
    report["mismatch_after_observation"] = logprob_mismatch(learner, traj.behaviour_logp_bt, after)
  return report
