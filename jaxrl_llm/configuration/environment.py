"""Settings of ``config.env``: multi-turn episodes with an environment and its tools (``jaxrl_llm.envs``).

With ``env.name`` empty (the default) every RL rollout is one model turn scored by
the task's reward. With a name, each rollout row is an episode of
:class:`jaxrl_llm.envs.episodes.EpisodeRunner`: model turns alternate with the
environment's observations until it is done, and its rewards are the row's reward.
"""

from __future__ import annotations

import dataclasses

from jaxrl_llm.settings import (BOOL, MAPPING, POSITIVE_INT, STRING, Check, check, require, setting)

OBSERVATION_FORMATS = ("plain", "chat")
TOOL_LIST = Check(lambda v: isinstance(v, (tuple, list)) and all(isinstance(e, str) and e for e in v),
                  "a sequence of tool names ('calculator', 'python') or import paths 'pkg.mod:fn'")


@dataclasses.dataclass(frozen=True)
class EnvSettings:
  """``config.env``: the environment of multi-turn episodes (docs/agents.md)."""

  name: str = setting("", "environment: a registered name ('tools') or an import path 'pkg.mod:make' called "
                      "as make(task=, tools=, **env.kwargs) per episode; empty: single-turn rollouts", STRING)
  kwargs: dict = setting({}, "keyword arguments of the environment factory", MAPPING, free=True)
  tools: tuple = setting((), "tools the environment may call: 'calculator', 'python' (sandboxed) or import paths "
                         "'pkg.mod:fn'", TOOL_LIST)
  tool_aliases: dict = setting({}, "names the model calls tools by, e.g. {'calculator': 'calc'}", MAPPING,
                               free=True)
  max_turns: int = setting(4, "model turns per episode at most", POSITIVE_INT)
  max_tokens: int = setting(256, "tokens per episode after the prompt (model and observation tokens)",
                            POSITIVE_INT)
  max_turn_tokens: int = setting(64, "tokens per model turn at most", POSITIVE_INT)
  observation_format: str = setting("plain", "'plain': observations are appended as the environment wrote "
                                    "them; 'chat': wrapped as a tool message by the tokenizer's chat template",
                                    choices=OBSERVATION_FORMATS)
  stop_at_tool_call: bool = setting(True, "end a model turn at the tool-call end token ('</tool_call>') when "
                                    "the tokenizer has it as one token (the EOS always ends a turn)", BOOL)
  sandbox_workers: int = setting(2, "warm sandboxes of the 'python' tool", POSITIVE_INT)

  def __post_init__(self):
    check(self, "env")
    require(self, "env", self.max_turn_tokens <= self.max_tokens, "max_turn_tokens",
            f"at most env.max_tokens={self.max_tokens}")

  @property
  def enabled(self) -> bool:
    return bool(self.name)
