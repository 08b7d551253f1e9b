"""Multi-turn RL with a tool: multiplication with the calculator (jaxrl_llm/tasks/tool_multiply.py).

  jaxrl-train --config=configs/tool_multiply.py

Each episode is played by the built-in "tools" environment: the model calls the
calculator (``<tool_call>{"name":"calc","arguments":{"expr":"482*37"}}</tool_call>``),
reads ``<tool_response>17834</tool_response>`` and answers. The warm start is a
short SFT on such demonstrations (the tool's answers are context, not targets);
RL on the final answer's reward does the rest. Figures: bench/README.md
("Multi-turn tool use"); the protocol: docs/agents.md.
"""

import ml_collections

from jaxrl_llm.configuration import base_config


def get_config():
  c = base_config()
  c.name = "tool_multiply"
  c.task.name = "tool_multiply"
  c.task.kwargs = ml_collections.ConfigDict({"min_digits": 2, "max_digits": 2, "tool_demo_fraction": 0.25,
                                              "partial_credit": 0.5})
  c.task.eval_size = 128
  c.model.max_position_embeddings = 128
  c.env.name = "tools"
  c.env.tools = ("calculator",)
  c.env.tool_aliases = ml_collections.ConfigDict({"calculator": "calc"})
  c.env.max_turns = 3
  c.env.max_tokens = 96
  c.env.max_turn_tokens = 64
  c.sft.steps = 200
  c.sft.lr = 1e-3
  c.rl.steps = 120
  c.rl.prompts_per_step = 16
  c.rl.samples_per_prompt = 8
  c.rl.filter_zero_variance = False
  c.objective.recipe = "grpo"
  c.objective.kwargs.kl_coef = 0.0
  c.advantage.estimator = "grpo"
  c.optimizer.lr = 3e-4
  c.eval.every = 20
  return c
