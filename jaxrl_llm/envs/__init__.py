"""Environments and tools for multi-turn agentic RL (docs/agents.md).

``base`` (the Environment protocol, StepResult, EpisodeLimits, the registry of
environments by name or import path), ``tools`` (the tool registry: calculator,
sandboxed python, user functions), ``tool_env`` (the built-in "tools"
environment), ``guess`` (a tool-free example environment), ``observation`` (how an
observation becomes tokens, chat-template aware) and ``episodes`` (the driver that
plays a batch of episodes with a sampler session and lays them out as a Trajectory).
The tool-call format and the sandbox live with the tasks that use them
(``tasks/tool_calls.py``, ``tasks/sandbox.py``).
"""

from jaxrl_llm.envs.base import (Environment, EpisodeLimits, StepResult, environment_names,
                                 load_environment_factory, register_environment)
from jaxrl_llm.envs.episodes import END_REASONS, EpisodeBatch, EpisodeRunner, episode_metrics, turn_spans
from jaxrl_llm.envs.observation import ObservationFormat
from jaxrl_llm.envs.tools import Tool, ToolRegistry, make_registry

__all__ = ["END_REASONS", "Environment", "EpisodeBatch", "EpisodeLimits", "EpisodeRunner", "ObservationFormat",
           "StepResult", "Tool", "ToolRegistry", "environment_names", "episode_metrics", "load_environment_factory",
           "make_registry", "register_environment", "turn_spans"]
