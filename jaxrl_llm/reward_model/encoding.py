"""Token sequences a reward model reads, and right-padded pair batches.

One rule for training and for scoring RL samples, so the reward model sees at
RL time exactly the layout it was trained on::

  prompt ids | response ids | EOS

The prompt is encoded as the RL run encodes it: with ``task.use_chat_template``
the tokenizer's chat template renders it (a string becomes one user message; a
list of messages is rendered as given) with the assistant-turn header appended,
then it is encoded without extra special tokens. The response is encoded
without special tokens and the EOS id is appended (a truncated RL sample, which
has no EOS, is scored without it: see :mod:`.eos`).

:class:`PairStream` reads the training pairs batch by batch (its position is
checkpointed) and :func:`held_out_batches` batches the held-out pairs, for every
job that trains on pairs (the reward model; DPO, IPO and SimPO).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable, NamedTuple, Optional, Sequence, Union

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from jaxrl_llm.bridge import Tokenizer
from jaxrl_llm.reward_model.preferences import Messages, PreferenceData, PreferencePair

log = logging.getLogger("jaxrl_llm")


def encode_prompt(tokenizer: Tokenizer, prompt: Union[str, Messages], use_chat_template: bool,
                  where: str = "prompt") -> list[int]:
  """Prompt ids: chat template (optional) then ``encode(add_special_tokens=False)``.

  Args:
    tokenizer: the model's tokenizer.
    prompt: text, or a sequence of ``{"role", "content"}`` messages.
    use_chat_template: render with the tokenizer's chat template.
    where: named in errors (e.g. the pair's ``file:line``).

  Raises:
    ValueError: a message list without ``use_chat_template``.
  """
  if not isinstance(prompt, str):
    if not use_chat_template:
      raise ValueError(f"{where}: the prompt is a list of chat messages but task.use_chat_template=False; "
                       "set it to True (or give the prompt as text)")
    text = tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True)
  elif use_chat_template:
    text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
  else:
    text = prompt
  return tokenizer.encode(text, add_special_tokens=False)


class EncodedPair(NamedTuple):
  """Token ids of one pair: ``prompt | response | EOS`` on both sides, and the prompt length."""

  chosen: list[int]
  rejected: list[int]
  prompt_length: int


class PairEncoder:
  """Encodes prompt + response (+ EOS) with one tokenizer and one length limit.

  Args:
    tokenizer: the reward model's tokenizer.
    use_chat_template: render prompts with the chat template.
    max_length: longest sequence the model takes (``max_position_embeddings``).
  """

  def __init__(self, tokenizer: Tokenizer, use_chat_template: bool, max_length: int):
    self.tokenizer = tokenizer
    self.use_chat_template = bool(use_chat_template)
    self.max_length = int(max_length)

  def _response(self, text: str, eos: bool) -> list[int]:
    ids = self.tokenizer.encode(text, add_special_tokens=False)
    return ids + [self.tokenizer.eos_id] if eos else ids

  def sequence(self, prompt: Union[str, Messages], response: str, eos: bool = True, where: str = "prompt"
               ) -> list[int]:
    """``prompt ids + response ids (+ [eos_id])``; may exceed ``max_length`` (see :meth:`fits`)."""
    return encode_prompt(self.tokenizer, prompt, self.use_chat_template, where) + self._response(response, eos)

  def fits(self, ids: Sequence[int]) -> bool:
    return 0 < len(ids) <= self.max_length

  def pair(self, pair: PreferencePair) -> Optional[EncodedPair]:
    """Both sequences with EOS, or None when either exceeds ``max_length``."""
    prompt = encode_prompt(self.tokenizer, pair.prompt, self.use_chat_template, pair.source or "pair")
    chosen = prompt + self._response(pair.chosen, True)
    rejected = prompt + self._response(pair.rejected, True)
    if not (self.fits(chosen) and self.fits(rejected)):
      return None
    return EncodedPair(chosen, rejected, len(prompt))


@struct.dataclass
class PreferenceBatch:
  """Right-padded pairs; B counts pairs, both sides share one width T.

  Attributes:
    chosen_bt: int32 [B, T] prompt + chosen response + EOS, then padding.
    chosen_mask_bt: bool [B, T] real tokens of the chosen sequence.
    rejected_bt: int32 [B, T] prompt + rejected response + EOS, then padding.
    rejected_mask_bt: bool [B, T] real tokens of the rejected sequence.
    chosen_target_mask_bt: bool [B, T] the chosen response and its EOS (the
      optional language-model term's targets; DPO's chosen log-probability).
    rejected_target_mask_bt: bool [B, T] the rejected response and its EOS (DPO's
      rejected log-probability).
    margin_b: float32 [B] margin of each pair.
    valid_b: bool [B] False on padding pairs (they add nothing to loss or metrics).
  """

  chosen_bt: jax.Array
  chosen_mask_bt: jax.Array
  rejected_bt: jax.Array
  rejected_mask_bt: jax.Array
  chosen_target_mask_bt: jax.Array
  rejected_target_mask_bt: jax.Array
  margin_b: jax.Array
  valid_b: jax.Array


def pad_rows(rows: Sequence[Sequence[int]], pad_id: int, num_rows: int, width: int
             ) -> tuple[np.ndarray, np.ndarray]:
  """Right-pads token rows into ``([num_rows, width] int32, [num_rows, width] bool)``."""
  if len(rows) > num_rows:
    raise ValueError(f"pad_rows: {len(rows)} rows do not fit in {num_rows}")
  tokens = np.full((num_rows, width), pad_id, np.int32)
  mask = np.zeros((num_rows, width), bool)
  for i, row in enumerate(rows):
    if len(row) > width:
      raise ValueError(f"pad_rows: row {i} has {len(row)} tokens, more than the width {width}")
    tokens[i, :len(row)] = row
    mask[i, :len(row)] = True
  return tokens, mask


def bucket_width(longest: int, bucket: int, limit: int) -> int:
  """``longest`` rounded up to a multiple of ``bucket``, at most ``limit`` (few shapes, few compilations)."""
  return max(1, min(int(limit), -(-int(longest) // bucket) * bucket))


def collate_pairs(encoded: Sequence[EncodedPair], margins: Sequence[float], pad_id: int,
                  num_pairs: int, max_length: int, bucket: int = 16) -> PreferenceBatch:
  """Builds a :class:`PreferenceBatch` of ``num_pairs`` rows (the first ``len(encoded)`` valid).

  Args:
    encoded: :class:`EncodedPair` per pair (each side <= ``max_length`` tokens).
    margins: one margin per pair.
    pad_id: padding id.
    num_pairs: rows of the batch (>= len(encoded); the rest are padding pairs).
    max_length: upper bound of the width.
    bucket: the width is the longest row rounded up to a multiple of this.
  """
  if len(margins) != len(encoded):
    raise ValueError(f"collate_pairs: {len(margins)} margins for {len(encoded)} pairs")
  longest = max([len(s) for pair in encoded for s in pair[:2]] or [1])
  width = bucket_width(longest, bucket, max_length)
  chosen, chosen_mask = pad_rows([p.chosen for p in encoded], pad_id, num_pairs, width)
  rejected, rejected_mask = pad_rows([p.rejected for p in encoded], pad_id, num_pairs, width)
  targets, rejected_targets = chosen_mask.copy(), rejected_mask.copy()
  for i, p in enumerate(encoded):
    targets[i, :p.prompt_length] = False
    rejected_targets[i, :p.prompt_length] = False
  margin = np.zeros(num_pairs, np.float32)
  margin[:len(encoded)] = margins
  valid = np.arange(num_pairs) < len(encoded)
  return PreferenceBatch(jnp.asarray(chosen), jnp.asarray(chosen_mask), jnp.asarray(rejected),
                         jnp.asarray(rejected_mask), jnp.asarray(targets), jnp.asarray(rejected_targets),
                         jnp.asarray(margin), jnp.asarray(valid))


# --------------------------------------------------------------------------- streams of pair batches

# Consecutive training pairs that do not fit the context before the run gives up.
MAX_CONSECUTIVE_TOO_LONG = 1000


@dataclasses.dataclass
class PairStream:
  """Position in the training pairs (checkpointed: a resumed run reads the pairs it would have).

  Shared by the jobs that train on pairs (the reward model, DPO / IPO / SimPO).
  """

  position: int = 0
  seen: int = 0
  skipped_too_long: int = 0

  def get_state(self) -> dict:
    return dataclasses.asdict(self)

  def set_state(self, state: dict) -> None:
    for k, v in state.items():
      setattr(self, k, v)

  def metrics(self) -> dict[str, float]:
    """``data/pairs_seen`` and ``data/skipped_too_long`` (logged with every step)."""
    return {"data/pairs_seen": float(self.seen), "data/skipped_too_long": float(self.skipped_too_long)}

  def next_batch(self, data: PreferenceData, encoder: PairEncoder, size: int, pad_id: int,
                 margin_of: Callable[[PreferencePair], float]) -> PreferenceBatch:
    """The next ``size`` training pairs of ``data`` that fit the context (skips counted).

    Raises:
      ValueError: after :data:`MAX_CONSECUTIVE_TOO_LONG` pairs in a row that do not fit.
    """
    encoded, margins, too_long = [], [], 0
    while len(encoded) < size:
      pair = data.train_pair(self.position)
      self.position += 1
      enc = encoder.pair(pair)
      if enc is None:
        too_long += 1
        self.skipped_too_long += 1
        if too_long >= MAX_CONSECUTIVE_TOO_LONG:
          raise ValueError(f"{too_long} consecutive training pairs (last: {pair.source}) exceed the context of "
                           f"{encoder.max_length} tokens (model.max_position_embeddings)")
        continue
      too_long = 0
      encoded.append(enc)
      margins.append(margin_of(pair))
    self.seen += size
    return collate_pairs(encoded, margins, pad_id, size, encoder.max_length)


def held_out_batches(pairs: Sequence[PreferencePair], encoder: PairEncoder, size: int, pad_id: int,
                     margin_of: Callable[[PreferencePair], float]
                     ) -> tuple[list[tuple[PreferenceBatch, list[str]]], int]:
  """Held-out pairs as batches of ``size`` rows, each with its pairs' kinds; too-long pairs are left out.

  Returns:
    ``(batches, too_long)``: ``[(batch, kinds)]`` (the last batch padded with invalid pairs) and the
    number of pairs left out.

  Raises:
    ValueError: when no pair fits the context.
  """
  encoded, margins, kinds, too_long = [], [], [], 0
  for pair in pairs:
    enc = encoder.pair(pair)
    if enc is None:
      too_long += 1
      continue
    encoded.append(enc)
    margins.append(margin_of(pair))
    kinds.append(pair.kind)
  if too_long:
    log.warning("%d held-out pairs exceed the context (%d tokens) and are not evaluated", too_long,
                encoder.max_length)
  if not encoded:
    raise ValueError("no held-out preference pair fits the model's context; check reward_model.eval_data / "
                     "eval_fraction and model.max_position_embeddings")
  return [(collate_pairs(encoded[i:i + size], margins[i:i + size], pad_id, size, encoder.max_length),
           kinds[i:i + size]) for i in range(0, len(encoded), size)], too_long
