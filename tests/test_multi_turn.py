"""Multi-turn episodes: row layout, the KV-cache session, masking, in-flight weights, broken environments."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_llm import bridge, models, objectives as O
from jaxrl_llm.envs.base import EpisodeLimits, StepResult
from jaxrl_llm.envs.episodes import EpisodeRunner, turn_spans
from jaxrl_llm.envs.observation import ObservationFormat
from jaxrl_llm.jobs.advantages import AdvantageInputs, AdvantageSpec, compute_advantages
from jaxrl_llm.learner import rl_step
from jaxrl_llm.learner.state import create_train_state
from jaxrl_llm.rollout.schema import SCHEMA_VERSION, RolloutChunk, validate_rows
from jaxrl_llm.sampling import JaxSampler, SamplerConfig
from jaxrl_llm.sampling.session import JaxSession, ReplaySession
from jaxrl_llm.tasks.base import Example

TOK = bridge.build_char_tokenizer("abcdefghij0123456789[]")
EOS = TOK.eos_id


def _config(invariant: bool) -> models.ModelConfig:
  return models.tiny(vocab_size=TOK.vocab_size, hidden_size=32, intermediate_size=64, num_layers=2,
                     max_position_embeddings=128, batch_invariant=invariant, eos_token_id=EOS,
                     pad_token_id=TOK.pad_id)


class ScriptedEnv:
  """Answers each turn with ``[obs<turn>]`` and ends after ``turns`` turns with reward = len(last turn) % 2."""

  def __init__(self, turns: int = 3, on_step=None):
    self.turns, self.on_step, self.seen = turns, on_step, 0

  def reset(self, example):
    return example.prompt

  def step(self, text):
    self.seen += 1
    if self.on_step is not None:
      self.on_step(self.seen)
    if self.seen >= self.turns:
      return StepResult("", reward=float(len(text) % 2), done=True, info={"tool_calls": 0})
    return StepResult(f"[{'abc'[:self.seen]}{self.seen}]", info={"tool_calls": 1, "tool_errors": self.seen - 1})


def _runner(env_factory, *, max_turns=3, max_tokens=40, max_turn_tokens=6, open_session=None):
  kwargs = {} if open_session is None else {"open_session": open_session}
  return EpisodeRunner(env_factory=env_factory,
                       limits=EpisodeLimits(max_turns=max_turns, max_tokens=max_tokens, max_turn_tokens=max_turn_tokens),
                       encode_prompt=TOK.encode, encode_text=TOK.encode, decode=TOK.decode,
                       observation_format=ObservationFormat.plain(), stop_token_ids=(EOS,), pad_id=TOK.pad_id,
                       **kwargs)


EXAMPLES = [Example("ab12", "x"), Example("c3", "y"), Example("dd", "z")]


def _learner_logp(params, config, traj):
  return np.asarray(models.sequence_logprobs(params, config, jnp.asarray(traj.tokens_bt),
                                             jnp.asarray(traj.sequence_mask_bt)))


def test_rows_hold_turns_and_observations_and_the_learner_agrees_bit_for_bit():
  config = _config(invariant=True)
  params = models.init_params(config, jax.random.PRNGKey(0))
  sampler = JaxSampler(config, params, SamplerConfig(temperature=1.0))
  out = _runner(lambda e: ScriptedEnv()).run(sampler, EXAMPLES, 2, jax.random.PRNGKey(1))
  traj = out.trajectory
  prompt, resp, obs = (np.asarray(m) for m in (traj.prompt_mask_bt, traj.response_mask_bt, traj.observation_mask_bt))
  assert not (prompt & resp).any() and not (prompt & obs).any() and not (resp & obs).any()
  assert obs.any(), "no observation was appended"
  for r in range(traj.batch_size):
    spans = turn_spans(traj, r)
    kinds = [k for k, _, _ in spans]
    assert kinds[0] == "prompt" and kinds[1] == "model"
    assert all(a != b for a, b in zip(kinds, kinds[1:]))  # turns alternate
    for kind, start, stop in spans:
      if kind == "observation":  # exactly the environment's text, tokenised
        assert TOK.decode(traj.tokens_bt[r, start:stop]).startswith("[")
    assert out.response_tokens[r] == [int(t) for t in traj.tokens_bt[r][resp[r]]]
  # observation tokens: no behaviour log-probability, no version
  assert (np.asarray(traj.behaviour_logp_bt)[obs] == 0).all() and (np.asarray(traj.policy_version_bt)[obs] == -1).all()
  assert (np.asarray(traj.policy_version_bt)[resp] == 0).all()
  # the learner's log pi of every model token, after observations too, is the sampler's bit for bit
  learner = _learner_logp(params, config, traj)
  np.testing.assert_array_equal(learner[resp], np.asarray(traj.behaviour_logp_bt)[resp])
  # the wire format accepts the rows
  chunk = RolloutChunk(schema_version=SCHEMA_VERSION, request_id=0, step=0, chunk=0, sampler_id="s", fingerprint={},
                       trajectory=traj, response_tokens=out.response_tokens)
  assert validate_rows(chunk, latest_version=0, vocab_size=config.vocab_size) == {}
  bad = chunk.trajectory.replace(behaviour_logp_bt=np.where(obs, -1.0, traj.behaviour_logp_bt).astype(np.float32))
  reasons = validate_rows(dataclasses.replace(chunk, trajectory=bad), latest_version=0,
                          vocab_size=config.vocab_size)
  assert any("observation tokens" in r for v in reasons.values() for r in v)
  # episode bookkeeping
  assert out.end_reasons.count("done") + out.end_reasons.count("token_limit") == traj.batch_size
  assert out.metrics["env/observation_tokens"] == obs.sum() and out.metrics["env/model_tokens"] == resp.sum()
  done = np.array([r == "done" for r in out.end_reasons])
  np.testing.assert_array_equal(np.asarray(traj.finished_b), done)


def test_replaying_session_equals_the_kv_cache_session():
  """What vLLM's path does (each turn re-submits the history) gives the KV-cache session's rows (greedy,
  batch-invariant: bit for bit)."""
  config = _config(invariant=True)
  params = models.init_params(config, jax.random.PRNGKey(2))
  sampler = JaxSampler(config, params, SamplerConfig(temperature=1.0))

  def replay(sampler, prompts, *, rng, row_ids, capacity, max_turn_tokens, **overrides):
    return ReplaySession(sampler, prompts, rng=rng, row_ids=row_ids, capacity=capacity,
                         config=sampler.config.replace(**overrides), model_config=sampler.model_config, **overrides)

  cached = _runner(lambda e: ScriptedEnv()).run(sampler, EXAMPLES, 1, jax.random.PRNGKey(0), greedy=True)
  replayed = _runner(lambda e: ScriptedEnv(), open_session=replay).run(sampler, EXAMPLES, 1, jax.random.PRNGKey(0),
                                                                       greedy=True)
  for name in ("tokens_bt", "response_mask_bt", "observation_mask_bt", "behaviour_logp_bt"):
    np.testing.assert_array_equal(getattr(cached.trajectory, name), getattr(replayed.trajectory, name), err_msg=name)
  assert cached.end_reasons == replayed.end_reasons


def test_new_weights_between_turns_sample_the_next_turn_with_their_version():
  config = _config(invariant=True)
  p0 = models.init_params(config, jax.random.PRNGKey(0))
  p1 = models.init_params(config, jax.random.PRNGKey(5))
  sampler = JaxSampler(config, p0, SamplerConfig(temperature=1.0))

  def update_after_first_turn(seen):
    if seen == 1 and sampler.policy_version == 0:
      sampler.update_weights(p1, 1)  # an in-flight update lands between turns

  out = _runner(lambda e: ScriptedEnv(turns=2, on_step=update_after_first_turn), max_turn_tokens=4).run(
      sampler, EXAMPLES[:1], 1, jax.random.PRNGKey(3))
  traj = out.trajectory
  versions = np.asarray(traj.policy_version_bt)[0]
  spans = [s for s in turn_spans(traj, 0) if s[0] == "model"]
  assert len(spans) == 2, out.end_reasons
  (_, a0, b0), (_, a1, b1) = spans
  assert (versions[a0:b0] == 0).all() and (versions[a1:b1] == 1).all()
  behaviour = np.asarray(traj.behaviour_logp_bt)[0]
  np.testing.assert_array_equal(_learner_logp(p0, config, traj)[0, a0:b0], behaviour[a0:b0])
  np.testing.assert_array_equal(_learner_logp(p1, config, traj)[0, a1:b1], behaviour[a1:b1])


def test_observation_tokens_contribute_nothing_to_the_loss_or_the_gradient():
  config = _config(invariant=False)
  params = models.init_params(config, jax.random.PRNGKey(0))
  sampler = JaxSampler(config, params, SamplerConfig(temperature=1.0))
  n = 2
  out = _runner(lambda e: ScriptedEnv(turns=2)).run(sampler, EXAMPLES[:2], n, jax.random.PRNGKey(4))
  traj = out.trajectory
  obs = np.asarray(traj.observation_mask_bt)
  assert obs.any()
  rewards = np.array([1.0, 0.0, 0.0, 1.0], np.float32)
  batch = compute_advantages(AdvantageSpec(estimator="grpo", group_size=n, row_granule=n),
                             AdvantageInputs(traj, rewards, learner_version=0)).batch
  rng = np.random.default_rng(0)
  noise = lambda: jnp.where(jnp.asarray(obs), jnp.asarray(rng.normal(size=obs.shape), jnp.float32) - 3.0, 0.0)
  garbage = batch.replace(advantages_bt=batch.advantages_bt + noise(), behaviour_logp_bt=batch.behaviour_logp_bt
                          + noise(), ref_logp_bt=batch.ref_logp_bt + noise())
  objective = O.recipe("grpo", kl_coef=0.0)
  import optax
  opt = optax.sgd(1.0)
  spec = rl_step.RLStepSpec(model=config, temperature=1.0, group_size=n, proximal="behaviour")
  step = rl_step.make_rl_step(spec, objective, opt)
  state = create_train_state(params, opt, 0)
  s_a, _, m_a = step(state, objective.init(None), batch)
  s_b, _, m_b = step(state, objective.init(None), garbage)
  assert float(m_a["grad_norm"]) > 0
  assert float(m_a["loss"]) == float(m_b["loss"]) and float(m_a["grad_norm"]) == float(m_b["grad_norm"])
  for x, y in zip(jax.tree.leaves(s_a.params), jax.tree.leaves(s_b.params)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  # ... yet they are context: other observation tokens change the log-probabilities of the model's next turn
  changed = np.where(obs, TOK.encode("j")[0], np.asarray(traj.tokens_bt))
  after = np.asarray(traj.response_mask_bt) & (np.cumsum(obs, axis=1) > 0)
  base = _learner_logp(params, config, traj)
  moved = np.asarray(models.sequence_logprobs(params, config, jnp.asarray(changed), jnp.asarray(traj.sequence_mask_bt)))
  assert after.any() and np.abs(base - moved)[after].max() > 1e-4


class _Raises(ScriptedEnv):
  def step(self, text):
    raise RuntimeError("environment bug")


class _NotAString(ScriptedEnv):
  def step(self, text):
    return StepResult(123)  # type: ignore[arg-type]


class _NaNReward(ScriptedEnv):
  def step(self, text):
    return StepResult("", reward=float("nan"), done=True)


class _NeverDone(ScriptedEnv):
  def step(self, text):
    return StepResult("[a]", reward=0.25)


class _HugeObservation(ScriptedEnv):
  def step(self, text):
    return StepResult("[" + "a" * 500 + "]")


class _ResetRaises(ScriptedEnv):
  def reset(self, example):
    raise ValueError("no such example")


def test_broken_environments_end_their_own_episode_with_a_named_reason():
  kinds = {"ok": lambda: ScriptedEnv(turns=1), "raises": _Raises, "not_a_string": _NotAString, "nan": _NaNReward,
           "never_done": _NeverDone, "huge": _HugeObservation, "reset": _ResetRaises}
  examples = [Example("ab", "x", meta={"kind": k}) for k in kinds]
  config = _config(invariant=False)
  sampler = JaxSampler(config, models.init_params(config, jax.random.PRNGKey(0)), SamplerConfig(temperature=1.0))
  # a stop set the untrained model never emits: every turn runs its 4 tokens, so the ends are deterministic
  runner = _runner(lambda e: kinds[e.meta["kind"]](), max_turns=2, max_tokens=20, max_turn_tokens=4)
  runner.stop_token_ids = (TOK.pad_id + 10_000,)
  out = runner.run(sampler, examples, 1, jax.random.PRNGKey(0))
  reasons = dict(zip(kinds, out.end_reasons))
  assert reasons == {"ok": "done", "raises": "env_error", "not_a_string": "bad_observation", "nan": "bad_reward",
                     "never_done": "turn_limit", "huge": "context_exhausted", "reset": "env_error"}
  rewards = dict(zip(kinds, out.rewards.tolist()))
  assert rewards["never_done"] == 0.5  # the rewards so far: two steps of 0.25
  assert all(rewards[k] == 0.0 for k in ("raises", "not_a_string", "nan", "reset"))
  for reason in set(reasons.values()):
    assert out.metrics[f"env/ended_{reason}"] == list(reasons.values()).count(reason)
  assert not np.asarray(out.trajectory.response_mask_bt)[list(kinds).index("reset")].any()  # never played


def test_session_refuses_what_does_not_fit():
  config = _config(invariant=False)
  sampler = JaxSampler(config, models.init_params(config, jax.random.PRNGKey(0)), SamplerConfig())
  session = JaxSession(sampler, [[3, 4]], rng=jax.random.PRNGKey(0), row_ids=[0], capacity=8, max_turn_tokens=4)
  with pytest.raises(ValueError, match="capacity"):
    session.generate([0], [9], (EOS,))
  session.generate([0], [4], (EOS,))
  with pytest.raises(ValueError, match="append"):
    session.generate([0], [1], (EOS,))  # the observation (or an empty one) must come first
  with pytest.raises(ValueError, match="capacity"):
    session.append([0], [[5] * 9])
  with pytest.raises(ValueError, match="prompt 0 has 200 tokens"):
    JaxSession(sampler, [[3] * 200], rng=jax.random.PRNGKey(0), row_ids=[0], capacity=8, max_turn_tokens=4)


def test_tool_demonstrations_train_the_model_turns_only_and_play_back_through_the_environment():
  from jaxrl_llm.tasks.tool_calls import TOOL_CALL_CLOSE
  from jaxrl_llm.envs.tool_env import ToolEnvironment
  from jaxrl_llm.envs.tools import make_registry
  from jaxrl_llm.learner import sft
  from jaxrl_llm.tasks import get_task
  task = get_task("tool_multiply", min_digits=2, max_digits=2, tool_demo_fraction=0.5)
  tok = bridge.build_char_tokenizer(task.alphabet, bridge.tokenizer.DEFAULT_CHAR_SPECIALS + task.special_tokens)
  examples = [task.train_example(0, i) for i in range(40)]
  with_tool = [e for e in examples if task.uses_tool_in_demonstration(e)]
  assert 0 < len(with_tool) < len(examples)  # tool_demo_fraction: some demonstrations answer directly
  example = with_tool[0]
  segments = task.sft_segments(example)
  assert [trained for _, trained in segments] == [True, False, True]
  assert "".join(text for text, _ in segments) == task.sft_target(example)
  ids, flags = [], []
  for text, trained in segments:
    piece = tok.encode(text, add_special_tokens=False)
    ids, flags = ids + piece, flags + [not trained] * len(piece)
  prompt = tok.encode(example.prompt)
  batch = sft.collate([prompt], [ids], tok.eos_id, tok.pad_id, 128, context_only=[flags])
  target = np.asarray(batch.target_mask_bt)[0]
  seq = np.asarray(batch.seq_mask_bt)[0]
  response_tokens = set(np.flatnonzero(np.asarray(flags)) + len(prompt))
  assert not target[sorted(response_tokens)].any() and seq[sorted(response_tokens)].all()  # read, not learned
  assert target.sum() == len(ids) - len(response_tokens) + 1  # the model's turns and the EOS
  # the demonstration, played through the built-in environment with the calculator as "calc", scores 1
  env = ToolEnvironment(task, make_registry(["calculator"], aliases={"calculator": "calc"}))
  env.reset(example)
  call = segments[0][0]
  assert call.endswith(TOOL_CALL_CLOSE) and tok.token_to_id(TOOL_CALL_CLOSE) is not None  # one stop token
  first = env.step(call)
  assert first.observation == segments[1][0] and not first.done
  last = env.step(segments[2][0] + "<eos>")
  assert last.done and last.reward == 1.0


def test_the_python_tool_runs_model_code_in_the_sandbox_and_its_counters_reach_the_step():
  from jaxrl_llm.configuration.environment import EnvSettings
  from jaxrl_llm.tasks import sandbox
  from jaxrl_llm.jobs.episodes import build_episode_runner
  from jaxrl_llm.tasks import get_task
  ok, why = sandbox.isolation_available()
  if not ok:
    pytest.skip(f"no process isolation on this machine: {why}")
  runner = build_episode_runner(EnvSettings(name="tools", tools=("python",), sandbox_workers=1),
                                get_task("tool_multiply"), TOK, TOK.encode)
  env = runner.env_factory(Example("2*3=", "6"))
  env.reset(Example("2*3=", "6"))
  code = "import socket; socket.create_connection(('127.0.0.1', 22), timeout=1); print('escaped')"
  step = env.step('<tool_call>{"name": "python", "arguments": {"code": "%s"}}</tool_call>' % code)
  assert not step.done and "escaped" not in step.observation and "error" in step.observation
  assert step.info["tool_errors"] == 1
  printed = env.step('<tool_call>{"name": "python", "arguments": {"code": "print(2 * 3)"}}</tool_call>')
  assert printed.observation == "<tool_response>\n6\n</tool_response>"
  counters = runner.resource_metrics()
  assert counters["sandbox/calls"] == 2 and runner.resource_metrics()["sandbox/calls"] == 0  # per step


def test_a_multi_token_stop_sequence_ends_the_turn_in_both_sessions():
  """A tool-call end tag the tokenizer splits into several tokens ends the turn right after it, in the
  KV-cache session (inside the compiled loop) and the replaying one (cut after the fact) alike."""
  config = _config(invariant=True)
  sampler = JaxSampler(config, models.init_params(config, jax.random.PRNGKey(7)), SamplerConfig(greedy=True))
  prompts = [[5, 6, 7], [8, 9]]
  free = JaxSession(sampler, prompts, rng=jax.random.PRNGKey(0), row_ids=[0, 1], capacity=12, max_turn_tokens=8)
  first = free.generate([0, 1], [8, 8], ())[0].tokens
  sequence = tuple(first[2:4])
  end = next(i + 2 for i in range(len(first) - 1) if tuple(first[i:i + 2]) == sequence)
  sessions = [JaxSession(sampler, prompts, rng=jax.random.PRNGKey(0), row_ids=[0, 1], capacity=12,
                         max_turn_tokens=8),
              ReplaySession(sampler, prompts, rng=jax.random.PRNGKey(0), row_ids=[0, 1], capacity=12,
                            config=sampler.config, model_config=config)]
  outs = [s.generate([0, 1], [8, 8], (), stop_sequences=[sequence]) for s in sessions]
  for out in outs:
    assert out[0].tokens == first[:end] and out[0].stopped
  assert [o.tokens for o in outs[0]] == [o.tokens for o in outs[1]]
  assert [o.logprobs for o in outs[0]] == [o.logprobs for o in outs[1]]
  for s in sessions:  # the next turn continues after the stop sequence in both
    s.append([0, 1], [[3], [3]])
  nxt = [s.generate([0, 1], [2, 2], ()) for s in sessions]
  assert [o.tokens for o in nxt[0]] == [o.tokens for o in nxt[1]]


def test_turn_stops_follow_the_tokenizer():
  from jaxrl_llm.jobs.episodes import turn_stops
  specials = bridge.tokenizer.DEFAULT_CHAR_SPECIALS
  one_token = bridge.build_char_tokenizer("abc", specials + ("</tool_call>",))
  assert turn_stops(one_token, True) == ((1, one_token.token_to_id("</tool_call>")), ())
  assert turn_stops(one_token, False) == ((1,), ())
  split = bridge.build_char_tokenizer("<>/_acdeloprt")
  assert turn_stops(split, True) == ((1,), (tuple(split.encode("</tool_call>")),))
  assert turn_stops(bridge.build_char_tokenizer("0123456789"), True) == ((1,), ())  # cannot write the tag
