"""Prompt sources and verifiable rewards (pure Python + NumPy; no JAX).

Tasks: ``addition`` (default), ``sorting``, ``countdown``, ``jsonl`` (GSM8K-style files).
Data curation (pass rates, retirement, prioritised and curriculum sampling, dynamic
sampling) is the ``curation`` subpackage.
Each has a deterministic, resumable training stream, a disjoint held-out evaluation split
and a verifiable reward; ``RewardRunner`` runs rewards under a guard, in a pool of worker
processes (``workers.WorkerPool``) killed and replaced when a call overruns its deadline,
crashes or runs out of memory. Every task also says how hard a problem is
(``Task.difficulty``, for curriculum sampling) and makes built-in preference pairs
(``Task.preference_pairs``, for reward models).
"""

from jaxrl_llm.tasks.addition import AdditionTask
from jaxrl_llm.tasks.base import DEFAULT_SPLIT_SALT, Example, GeneratedTask, Task, TaskIterator, split_fraction
from jaxrl_llm.tasks.countdown import CountdownTask, parse_expression
from jaxrl_llm.tasks.curation import (CollectedGroups, CuratedPromptSource, CurationConfig,
                                      InformativeGroupCollector, PassRateTracker, prompt_key, zero_variance_groups)
from jaxrl_llm.tasks.jsonl import JsonlTask
from jaxrl_llm.tasks.math_verify import answers_match, extract_answer, parse_number, verify
from jaxrl_llm.tasks.pairs import TEXT_PAIR_KINDS, ResponsePair
from jaxrl_llm.tasks.prompts import EvalSet, PromptBatch, PromptSource, build_eval_set, group_examples
from jaxrl_llm.tasks.registry import (DEFAULT_TASK, get_task, list_tasks, register_task, task_factory,
                                      unregister_task)
from jaxrl_llm.tasks.reward_runner import RewardFailureError, RewardRunner
from jaxrl_llm.tasks.rng import CounterRng
from jaxrl_llm.tasks.sorting import SortingTask
from jaxrl_llm.tasks.workers import WorkerPool, WorkerStartError

__all__ = [
    "AdditionTask", "CollectedGroups", "CountdownTask", "CounterRng", "CuratedPromptSource", "CurationConfig",
    "DEFAULT_SPLIT_SALT", "DEFAULT_TASK", "EvalSet", "Example", "GeneratedTask", "InformativeGroupCollector",
    "JsonlTask", "PassRateTracker", "PromptBatch", "PromptSource", "ResponsePair", "RewardFailureError", "RewardRunner",
    "SortingTask", "WorkerPool", "WorkerStartError",
    "TEXT_PAIR_KINDS", "Task", "TaskIterator", "answers_match", "build_eval_set", "extract_answer", "get_task",
    "group_examples", "list_tasks", "parse_expression", "parse_number", "prompt_key", "register_task", "unregister_task",
    "split_fraction", "task_factory", "verify", "zero_variance_groups",
]
