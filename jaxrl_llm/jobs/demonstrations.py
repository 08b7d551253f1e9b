"""Demonstrations mixed into the RL batch with an SFT loss (``data.sft_mix``).

InstructGPT's PPO-ptx (Ouyang et al., arXiv:2203.02155) adds a supervised
term to the RL objective so the policy keeps what the demonstrations taught.
Here, every RL step appends ``data.sft_mix_rows`` demonstration rows to the
learner batch:

* tokens: prompt + demonstration response + EOS, laid out like sampled rows
  (prompt first, right-padded; T is the larger of the two parts');
* ``response_mask_bt`` and ``sft_mask_bt``: the response tokens (so the
  aggregation counts them like any other token and ``objectives.sft_loss``
  puts ``-coef * log pi`` on them);
* advantage 0 and lag 0: the policy term contributes nothing on them;
* behaviour log-probabilities: the learner's own log pi_k of the row (they were
  not sampled; with mu := pi_k the importance ratio of the row is 1 and it
  adds nothing to ratio statistics), computed by one forward on these rows.

Demonstrations come from the task's gold answers (``data.sft_mix='task'``, the
warm start's targets, on a stream of its own) or from a JSONL file of
``{"prompt": ..., "response": ...}`` objects, cycled in file order. The
stream's position is checkpointed.
"""

from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from jaxrl_llm.learner import sft
from jaxrl_llm.learner.rl_step import RLBatch
from jaxrl_llm.tasks.rows import read_rows

__all__ = ["DemonstrationStream", "mix_demonstrations"]


class DemonstrationStream:
  """Prompt/response pairs as token ids, from the task or a JSONL file.

  Args:
    source: "task" or a JSONL path.
    task: the run's task (for "task").
    seed: the stream's seed (for "task").
    encode_prompt: prompt text -> ids (chat template applied when configured).
    encode_response: response text -> ids (no special tokens).

  Raises:
    ValueError: ``path:line: ...`` for a JSONL row without a string prompt or response,
      or an empty file.
  """

  def __init__(self, source: str, task: Any, seed: int, encode_prompt: Callable[[str], list[int]],
               encode_response: Callable[[str], list[int]]):
    self.source = source
    self.encode_prompt, self.encode_response = encode_prompt, encode_response
    if source == "task":
      self.task = task
      self.stream = task.train_prompts(seed=seed)
      self.rows = None
    else:
      self.rows = []
      for lineno, row in read_rows(source):
        for field in ("prompt", "response"):
          if not isinstance(row.get(field), str):
            raise ValueError(f"{source}:{lineno}: data.sft_mix rows need a string {field!r} field; got "
                             f"{type(row.get(field)).__name__}")
        self.rows.append((row["prompt"], row["response"]))
      if not self.rows:
        raise ValueError(f"{source}: data.sft_mix file has no rows")
      self.position = 0

  def next_pairs(self, k: int) -> list[tuple[list[int], list[int]]]:
    """The next ``k`` (prompt ids, response ids) pairs."""
    if self.rows is None:
      examples = [next(self.stream) for _ in range(k)]
      return [(self.encode_prompt(e.prompt), self.encode_response(self.task.sft_target(e))) for e in examples]
    out = []
    for _ in range(k):
      prompt, response = self.rows[self.position % len(self.rows)]
      self.position += 1
      out.append((self.encode_prompt(prompt), self.encode_response(response)))
    return out

  def get_state(self) -> dict:
    return {"stream": self.stream.get_state()} if self.rows is None else {"position": self.position}

  def set_state(self, state: dict) -> None:
    if self.rows is None:
      self.stream.set_state(state["stream"])
    else:
      self.position = int(state["position"])


def _pad_columns(x: Any, width: int, value: Any) -> Any:
  x = jnp.asarray(x)
  return x if x.shape[1] == width else jnp.pad(x, ((0, 0), (0, width - x.shape[1])), constant_values=value)


def mix_demonstrations(batch: RLBatch, pairs: list[tuple[list[int], list[int]]], *, eos_id: int, pad_id: int,
                       max_length: int, logp: Callable) -> RLBatch:
  """``batch`` with the demonstration rows appended (see the module docstring).

  Args:
    batch: the RL batch, [B, T].
    pairs: D (prompt ids, response ids) pairs.
    eos_id, pad_id: the tokenizer's ids.
    max_length: the context length (a longer demonstration raises, naming it).
    logp: ``logp(tokens_bt, seq_mask_bt) -> float32 [D, T']`` under the current parameters.

  Returns:
    An RLBatch of B + D rows and T'' = max(T, T') columns, ``sft_mask_bt`` set.
  """
  demo = sft.collate([p for p, _ in pairs], [r for _, r in pairs], eos_id, pad_id, max_length, bucket=8)
  width = max(batch.tokens_bt.shape[1], demo.tokens_bt.shape[1])
  behaviour = jnp.where(demo.target_mask_bt, logp(demo.tokens_bt, demo.seq_mask_bt), 0.0)
  d = demo.tokens_bt.shape[0]
  zeros = jnp.zeros((d, width), jnp.float32)
  sft_mask = batch.sft_mask_bt if batch.sft_mask_bt is not None else np.zeros(batch.tokens_bt.shape, bool)
  columns = {
      "tokens_bt": (batch.tokens_bt, demo.tokens_bt, pad_id),
      "seq_mask_bt": (batch.seq_mask_bt, demo.seq_mask_bt, False),
      "response_mask_bt": (batch.response_mask_bt, demo.target_mask_bt, False),
      "behaviour_logp_bt": (batch.behaviour_logp_bt, behaviour, 0.0),
      "advantages_bt": (batch.advantages_bt, zeros, 0.0),
      "ref_logp_bt": (batch.ref_logp_bt, zeros, 0.0),
      "lag_bt": (batch.lag_bt, jnp.zeros((d, width), jnp.int32), 0),
      "old_values_bt": (batch.old_values_bt, zeros, 0.0),
      "returns_bt": (batch.returns_bt, zeros, 0.0),
      "sft_mask_bt": (sft_mask, demo.target_mask_bt, False),
  }
  out = {name: jnp.concatenate([_pad_columns(a, width, v), _pad_columns(b, width, v)])
         for name, (a, b, v) in columns.items()}
  return RLBatch(**out)
