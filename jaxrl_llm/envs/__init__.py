"""Environments, tools and the sandbox for multi-turn agentic RL."""
