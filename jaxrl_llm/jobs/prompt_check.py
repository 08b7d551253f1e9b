"""Every prompt checked against the context at start-up (``data.long_prompts``).

A prompt the sampler cannot fit would otherwise stop the run whenever it is first drawn
(and again on every resume: the order is deterministic). So, once, while a job builds:

* the rule is the sampler's (``sampling.layout.prepare_prompts``): the prompt's ids, as
  the job encodes them (:meth:`Job.encode_prompt`: chat template included), plus
  ``rl.max_new_tokens`` must fit in the model's ``max_position_embeddings``; and, when
  the task's reference answers are trained on (``sft.steps > 0`` for the warm start, or
  ``data.sft_mix='task'``), a training row's prompt + reference answer + EOS must fit too
  (``learner.sft.collate``);
* a dataset task (one with ``examples()`` / ``with_examples()``, e.g. ``jsonl``) has every
  training and held-out row tokenised and checked;
* a generated task (addition, countdown, ...) has no row list: its prompts are bounded by
  its own settings, and the check covers the held-out set and the first
  :data:`SAMPLE` prompts of each training stream the job draws from.

What a row that does not fit does (``data.long_prompts``):

* ``"error"`` (default): the run stops before any step with a
  :class:`~jaxrl_llm.errors.ConfigError` naming ``file:line`` (a generated task: the
  task and the example) and how many rows are too long;
* ``"skip"``: such rows are dropped from training and evaluation (a dataset task's
  training order is then over the kept rows, deterministic as before);
* ``"truncate"``: the prompt keeps its last tokens, as many as fit (the sampler's
  ``truncate_prompts`` convention), decoded back to text so that every consumer (sampler,
  learner, warm start, RFT) sees the same shorter prompt. A row whose reference answer
  alone does not fit cannot be truncated and stops the run.

Skipped and truncated rows are counted: a warning line, and ``long_prompts`` in the
job's ``summary.json``. Generated tasks always stop (there is no row to drop).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable, Optional

from jaxrl_llm.configuration.operations import LONG_PROMPT_ACTIONS
from jaxrl_llm.errors import ConfigError

__all__ = ["LongPrompts", "SAMPLE", "check_prompts"]

log = logging.getLogger("jaxrl_llm")

SAMPLE = 256  # prompts checked per training stream of a generated task
_SHOWN = 3  # rows named in a message besides the first


@dataclasses.dataclass
class LongPrompts:
  """What the check found and did (``summary.json``'s ``long_prompts``)."""

  action: str
  checked: int = 0
  whole: bool = True  # every row (a dataset task) or a sample (a generated task)
  too_long: int = 0
  skipped: int = 0
  truncated: int = 0

  def as_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class _Rule:
  context: int
  new_tokens: Optional[int]  # None: the job does not sample (reward model)
  sft: bool  # reference answers are trained on
  budget_field: str = "rl.max_new_tokens"  # the setting new_tokens comes from

  def problem(self, n_prompt: int, n_target: Optional[int]) -> str:
    """Why ``n_prompt`` prompt tokens (and ``n_target`` answer tokens, for a training row) do not fit; "" if they do."""
    if self.new_tokens is not None and n_prompt + self.new_tokens > self.context:
      return (f"its prompt has {n_prompt} tokens; with {self.budget_field}={self.new_tokens} it needs "
              f"{n_prompt + self.new_tokens} > {self.context} (model.max_position_embeddings)")
    if self.sft and n_target is not None and n_prompt + n_target + 1 > self.context:
      return (f"its prompt ({n_prompt} tokens) + reference answer ({n_target}) + EOS = {n_prompt + n_target + 1} "
              f"tokens exceed the context of {self.context} (model.max_position_embeddings) that the warm start "
              "(sft.steps) or data.sft_mix='task' trains on")
    return ""

  def budget(self, n_target: Optional[int]) -> int:
    """The most prompt tokens that fit."""
    limits = [self.context - self.new_tokens] if self.new_tokens is not None else [self.context - 1]
    if self.sft and n_target is not None:
      limits.append(self.context - n_target - 1)
    return min(limits)


def check_prompts(job: Any, new_tokens: Optional[int], budget_field: str = "rl.max_new_tokens"
                  ) -> tuple[Any, dict[str, Any]]:
  """Checks the prompts of ``job.task`` against ``job.model_config``'s context; see the module docstring.

  Args:
    job: a job while it builds (``config``, ``task``, ``tokenizer``, ``model_config``, ``encode_prompt``).
    new_tokens: the sampler's new-token budget (``rl.max_new_tokens``); None for a job that does not sample.
    budget_field: the setting ``new_tokens`` comes from (``env.max_tokens`` for multi-turn episodes).

  Returns:
    ``(task, report)``: the task to use (the same one, or a dataset task with rows skipped or
    truncated) and :class:`LongPrompts` as a dict.

  Raises:
    ConfigError: a row does not fit and ``data.long_prompts='error'`` (or it cannot be
      skipped or truncated), naming it.
  """
  c = job.config
  action = c.data.long_prompts
  if action not in LONG_PROMPT_ACTIONS:
    raise ConfigError(f"data.long_prompts={action!r}: expected one of {LONG_PROMPT_ACTIONS}")
  sft = c.sft.steps > 0 or (new_tokens is not None and c.data.sft_mix == "task")
  rule = _Rule(int(job.model_config.max_position_embeddings), new_tokens, sft, budget_field)
  if new_tokens is None and not sft:  # nothing is sampled and no reference answer is trained on
    return job.task, LongPrompts(action=action, checked=0).as_dict()
  encode_target = lambda text: job.tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
  task = job.task
  if callable(getattr(task, "examples", None)) and callable(getattr(task, "with_examples", None)):
    return _check_dataset(task, rule, action, job.encode_prompt, encode_target, job.tokenizer)
  return task, _check_generated(task, rule, action, c, job.encode_prompt, encode_target).as_dict()


def _where(task: Any, example: Any, kind: str, index: int) -> str:
  meta = example.meta or {}
  if meta.get("source") and meta.get("line"):
    return f"{meta['source']}:{meta['line']}"
  return f"task {task.name!r} {kind} example {index} ({str(example.prompt)[:60]!r})"


def _fail(found: list[tuple[str, str]], total: int, rule: _Rule, action: str, whole: bool, extra: str = "") -> None:
  where, problem = found[0]
  others = ", ".join(w for w, _ in found[1:1 + _SHOWN]) + (", ..." if len(found) > 1 + _SHOWN else "")
  verb = "does" if len(found) == 1 else "do"
  count = (f"{len(found)} of {total} rows {verb} not fit" if whole
           else f"{len(found)} of the {total} prompts checked (a sample of a generated task) {verb} not fit")
  fixes = "shorten them, raise model.max_position_embeddings"
  if rule.new_tokens is not None:
    fixes += f" or lower {rule.budget_field}"
  if whole and action == "error":
    fixes += ", or set data.long_prompts='skip' (drop such rows) or 'truncate' (keep each prompt's last tokens)"
  raise ConfigError(f"{where}: {problem}. {count}{' (also: ' + others + ')' if others else ''}; {fixes}.{extra}")


def _check_dataset(task: Any, rule: _Rule, action: str, encode: Callable, encode_target: Callable,
                   tokenizer: Any) -> tuple[Any, dict[str, Any]]:
  train, held_out = task.examples()
  report = LongPrompts(action=action, checked=len(train) + len(held_out))
  found: list[tuple[str, str]] = []
  kept: dict[str, list] = {"train": [], "eval": []}
  for kind, examples in (("train", train), ("eval", held_out)):
    for i, example in enumerate(examples):
      n_target = len(encode_target(task.sft_target(example))) if kind == "train" and rule.sft else None
      problem = rule.problem(len(encode(example.prompt)), n_target)
      if not problem:
        kept[kind].append(example)
        continue
      where = _where(task, example, kind, i)
      found.append((where, problem))
      if action == "truncate":
        shorter = _truncate(example, rule.budget(n_target), encode, tokenizer)
        if shorter is None:
          raise ConfigError(f"{where}: {problem}; data.long_prompts='truncate' cannot make it fit (its reference "
                            "answer alone, or the chat template around the prompt, leaves no room); shorten the row "
                            "or set data.long_prompts='skip'")
        kept[kind].append(shorter)
        report.truncated += 1
      else:
        report.skipped += 1
  report.too_long = len(found)
  if not found:
    return task, report.as_dict()
  if action == "error":
    _fail(found, report.checked, rule, action, whole=True)
  if not kept["train"]:
    _fail(found, report.checked, rule, action, whole=True, extra=" data.long_prompts='skip' left no training row.")
  done = "skipped" if action == "skip" else "truncated to their last tokens"
  log.warning("data.long_prompts=%r: %d of %d rows do not fit the context of %d tokens and are %s (first: %s)",
              action, len(found), report.checked, rule.context, done, found[0][0])
  return task.with_examples(kept["train"], kept["eval"]), report.as_dict()


def _truncate(example: Any, budget: int, encode: Callable, tokenizer: Any) -> Any:
  """``example`` whose prompt text keeps its last tokens so that ``encode(prompt)`` has at most ``budget``; None
  when no suffix fits."""
  if not isinstance(example.prompt, str) or budget < 1:
    return None
  ids = tokenizer.encode(example.prompt, add_special_tokens=False)
  keep = min(len(ids), budget - (len(encode(example.prompt)) - len(ids)))  # room left by the template's own tokens
  while keep > 0:
    text = tokenizer.decode(ids[len(ids) - keep:])
    excess = len(encode(text)) - budget
    if excess <= 0 and text.strip():
      return dataclasses.replace(example, prompt=text)
    keep -= max(1, excess)
  return None


def _check_generated(task: Any, rule: _Rule, action: str, c: Any, encode: Callable,
                     encode_target: Callable) -> LongPrompts:
  streams = [("train", c.seed)]  # the RL prompts (PromptSource); then Job.run_warm_start's and DemonstrationStream's
  if c.sft.steps > 0:
    streams.append(("warm-start", c.seed + 1000))
  if rule.new_tokens is not None and c.data.sft_mix == "task":
    streams.append(("demonstration", c.seed + 2000))
  samples: list[tuple[str, int, Any, bool]] = []
  for kind, seed in streams:
    stream = task.train_prompts(seed)
    samples += [(kind, i, next(stream), rule.sft) for i in range(SAMPLE)]
  samples += [("held-out", i, e, False) for i, e in enumerate(task.eval_prompts(c.task.eval_size, seed=c.seed))]
  found = []
  for kind, i, example, with_target in samples:
    n_target = len(encode_target(task.sft_target(example))) if with_target else None
    problem = rule.problem(len(encode(example.prompt)), n_target)
    if problem:
      found.append((_where(task, example, kind, i), problem))
  report = LongPrompts(action=action, checked=len(samples), whole=False, too_long=len(found))
  if found:
    extra = "" if action == "error" else (f" data.long_prompts={action!r} applies to dataset tasks (jsonl), whose "
                                          "rows are known at start-up; a generated task's settings bound its prompts.")
    _fail(found, len(samples), rule, action, whole=False, extra=extra)
  return report
