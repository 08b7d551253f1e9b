"""Prompt sources and verifiable rewards (pure Python + NumPy; no JAX).

Tasks: ``addition`` (default), ``sorting``, ``countdown``, ``jsonl`` (GSM8K-style files).
Each has a deterministic, resumable training stream, a disjoint held-out evaluation split
and a verifiable reward; ``RewardRunner`` runs rewards under a guard.
"""

from jaxrl_llm.tasks.addition import AdditionTask
from jaxrl_llm.tasks.base import (DEFAULT_SPLIT_SALT, CounterRng, Example, GeneratedTask, Task,
                                  TaskIterator, split_fraction)
from jaxrl_llm.tasks.countdown import CountdownTask, parse_expression
from jaxrl_llm.tasks.jsonl import JsonlTask
from jaxrl_llm.tasks.math_verify import answers_match, extract_answer, parse_number, verify
from jaxrl_llm.tasks.prompts import (EvalSet, PromptBatch, PromptSource, build_eval_set,
                                     group_examples)
from jaxrl_llm.tasks.registry import DEFAULT_TASK, get_task, list_tasks, register_task
from jaxrl_llm.tasks.reward_runner import RewardRunner
from jaxrl_llm.tasks.sorting import SortingTask

__all__ = [
    "AdditionTask", "CountdownTask", "CounterRng", "DEFAULT_SPLIT_SALT", "DEFAULT_TASK",
    "EvalSet", "Example", "GeneratedTask", "JsonlTask", "PromptBatch", "PromptSource",
    "RewardRunner", "SortingTask", "Task", "TaskIterator", "answers_match", "build_eval_set",
    "extract_answer", "get_task", "group_examples", "list_tasks", "parse_expression",
    "parse_number", "register_task", "split_fraction", "verify",
]

# Data curation (pass rates, retirement, prioritised / curriculum sampling, dynamic sampling).
from jaxrl_llm.tasks.curation import (CollectedGroups, CuratedPromptSource, CurationConfig,  # noqa: E402
                                      InformativeGroupCollector, PassRateTracker, default_difficulty,
                                      prompt_key, zero_variance_groups)

__all__ += [
    "CollectedGroups", "CuratedPromptSource", "CurationConfig", "InformativeGroupCollector",
    "PassRateTracker", "default_difficulty", "prompt_key", "zero_variance_groups",
]
