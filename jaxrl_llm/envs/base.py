"""The environment protocol of multi-turn episodes, their limits, and the environment registry.

An episode alternates turns: the policy writes, the environment answers, the policy
continues, and the reward comes at the end (ReAct's thought / action / observation loop, Yao
et al., arXiv:2210.03629)::

  observation = env.reset(example)        # the prompt text
  while True:
    text = <the policy's turn, decoded with special tokens kept>
    result = env.step(text)               # StepResult(observation, reward, done, info)
    if result.done: break                 # result.reward is the episode's reward
    <append result.observation's tokens (ObservationFormat.wrap) and continue>

Environments are stateful per episode: the rollout driver calls an *environment factory*
once per row, as ``factory(task=task, tools=registry, **kwargs)`` (``kwargs``: the
environment's own settings), and uses the returned :class:`Environment` for that row's
episode only. A factory is named by ``env.name``: a built-in (``"tools"``:
:class:`~jaxrl_llm.envs.tool_env.ToolEnvironment`) or an import path ``"pkg.mod:make"``,
resolved by the same resolver as reward plug-ins (:func:`jaxrl_llm.tasks.reward_plugins.resolve`).

:class:`EpisodeLimits` bounds an episode: turns, tokens after the prompt (model and
observation tokens together), and tokens of one model turn. What the driver does at a limit
(end the episode, score what it has) is the driver's.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable, Mapping, Protocol, runtime_checkable

from jaxrl_llm.errors import ConfigError
from jaxrl_llm.settings import did_you_mean

FIELD = "env.name"


@dataclasses.dataclass(frozen=True)
class StepResult:
  """What an environment answers to one model turn.

  Attributes:
    observation: text to append after the turn (empty when ``done``).
    reward: the episode's reward when ``done`` (0 on intermediate turns by convention).
    done: the episode is over.
    info: per-turn numbers for metrics (e.g. ``tool_calls``, ``tool_errors``, ``tool_seconds``).
  """

  observation: str
  reward: float = 0.0
  done: bool = False
  info: Mapping[str, Any] = dataclasses.field(default_factory=dict)


@runtime_checkable
class Environment(Protocol):
  """One episode's environment (stateful; one instance per episode)."""

  def reset(self, example: Any) -> str:
    """Starts the episode on ``example`` (a task's Example) and returns the prompt text."""
    ...

  def step(self, text: str) -> StepResult:
    """Answers the model's turn ``text`` (decoded with special tokens kept)."""
    ...


EnvironmentFactory = Callable[..., Environment]


def _positive_int(owner: str, name: str, value: Any) -> None:
  if isinstance(value, bool) or not isinstance(value, int) or value < 1:
    raise ValueError(f"{owner}.{name} must be an int >= 1, got {value!r}")


@dataclasses.dataclass(frozen=True)
class EpisodeLimits:
  """Bounds of one episode.

  Attributes:
    max_turns: model turns at most (the last one must answer).
    max_tokens: tokens after the prompt, model and observation tokens together.
    max_turn_tokens: tokens of one model turn (<= ``max_tokens``).
  """

  max_turns: int = 4
  max_tokens: int = 256
  max_turn_tokens: int = 64

  def __post_init__(self):
    for name in ("max_turns", "max_tokens", "max_turn_tokens"):
      _positive_int("EpisodeLimits", name, getattr(self, name))
    if self.max_turn_tokens > self.max_tokens:
      raise ValueError(f"EpisodeLimits.max_turn_tokens={self.max_turn_tokens} must be <= "
                       f"max_tokens={self.max_tokens} (the tokens of the whole episode after the prompt)")


_REGISTRY: dict[str, EnvironmentFactory] = {}
# Built-ins register themselves when their module is imported (imported on first use).
_BUILTIN_MODULES = {"tools": "jaxrl_llm.envs.tool_env", "guess": "jaxrl_llm.envs.guess"}


def register_environment(name: str, factory: EnvironmentFactory, *, replace: bool = False) -> None:
  """Registers ``factory(task=, tools=, **kwargs) -> Environment`` under ``name``.

  Raises:
    ValueError: for a name that is empty or has a ``:`` (import paths need no registering),
      a factory that is not callable, or a name already taken by another factory
      (unless ``replace``).
  """
  if not isinstance(name, str) or not name or ":" in name:
    raise ValueError(f"environment name {name!r}: expected a non-empty name without ':'")
  if not callable(factory):
    raise ValueError(f"environment {name!r}: the factory must be callable, got {type(factory).__name__}")
  if not replace and _REGISTRY.get(name, factory) is not factory:
    raise ValueError(f"environment {name!r} is already registered (to {_REGISTRY[name]!r}); pass replace=True")
  _REGISTRY[name] = factory


def environment_names() -> list[str]:
  """The registered and built-in environment names, sorted."""
  return sorted(set(_REGISTRY) | set(_BUILTIN_MODULES))


def resolve_callable(path: str, field: str, expected: str) -> Callable[..., Any]:
  """The callable at import path ``"pkg.mod:attr"`` (via the reward plug-ins' resolver).

  Raises:
    ConfigError: naming ``field`` and ``expected`` when the module does not import, the
      attribute is missing or is not callable.
  """
  from jaxrl_llm.tasks import reward_plugins  # pylint: disable=import-outside-toplevel
  try:
    return reward_plugins.resolve(path)
  except ConfigError as e:
    detail = str(e)
    prefix = f"{reward_plugins.FIELD}: "
    detail = detail[len(prefix):] if detail.startswith(prefix) else detail
    detail = detail.replace(", not a callable fn(example, response_text)", ", not a callable")
    raise ConfigError(f"{field}: {detail}; expected {expected}") from None


def load_environment_factory(name: str) -> EnvironmentFactory:
  """The factory named by ``env.name``: a registered name (``"tools"``) or ``"pkg.mod:make"``.

  Raises:
    ConfigError: naming ``env.name`` for anything else, an import path that does not
      resolve, or a non-callable.
  """
  expected = (f"a registered environment ({', '.join(environment_names())}) or an import path "
              "'package.module:factory' of a callable factory(task=, tools=, **kwargs) -> Environment")
  if not isinstance(name, str) or not name.strip():
    raise ConfigError(f"{FIELD}={name!r}: expected {expected}")
  if ":" in name:
    return resolve_callable(name, f"{FIELD}={name!r}", expected)
  if name not in _REGISTRY and name in _BUILTIN_MODULES:
    importlib.import_module(_BUILTIN_MODULES[name])
  if name not in _REGISTRY:
    raise ConfigError(f"{FIELD}={name!r} is not a registered environment"
                      f"{did_you_mean(name, environment_names())}; expected {expected}")
  return _REGISTRY[name]


__all__ = ["Environment", "EnvironmentFactory", "EpisodeLimits", "FIELD", "StepResult", "environment_names",
           "load_environment_factory", "register_environment", "resolve_callable"]
