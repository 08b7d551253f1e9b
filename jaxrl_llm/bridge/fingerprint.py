"""Sampler / learner agreement: tokenizer, chat template, special ids and model.

Asynchronous RL goes wrong silently when the sampler tokenises or templates
differently from the learner, or runs another model revision: the behaviour
log-probabilities then refer to other tokens. Each side builds a
:class:`Fingerprint` and :func:`check_fingerprints` compares them, naming every
part that differs.

Parts (sha256 hex digests):
  tokenizer       canonical JSON of tokenizer.json (the ``tokenizers`` model)
  chat_template   the jinja2 template text
  special_ids     bos / eos / pad ids
  model           architecture fields of the ModelConfig (family, sizes, heads,
                  head_dim, RoPE, norm eps, max positions, tying, bias, q/k norm,
                  pad / eos / bos ids) plus the revision string. Runtime choices
                  (dtypes, remat, batch_invariant) and the learner-only value /
                  reward heads are left out, so a bf16 sampler matches an fp32
                  learner.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Mapping, Optional, Union

from jaxrl_llm.bridge import hf_config
from jaxrl_llm.models.config import ModelConfig

MODEL_FIELDS = ("family", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                "num_kv_heads", "rope_theta", "rope_scaling", "rms_norm_eps", "max_position_embeddings",
                "tie_word_embeddings", "attention_bias", "qk_norm", "pad_token_id", "eos_token_id",
                "bos_token_id")
_PART_NAMES = {"tokenizer": "tokenizer", "chat_template": "chat template",
               "special_ids": "special token ids", "model": "model config/revision"}


class FingerprintMismatchError(ValueError):
  """Raised when two fingerprints differ; ``parts`` lists the differing part keys."""

  def __init__(self, message: str, parts: list[str]):
    super().__init__(message)
    self.parts = parts


def model_fingerprint(model: Union[ModelConfig, Mapping[str, Any], str, os.PathLike],
                      revision: Optional[str] = None) -> str:
  """sha256 hex digest of the architecture of ``model`` and its revision.

  Args:
    model: a ModelConfig, a HF config dict, or a HF folder / config.json path
      (converted with :func:`hf_config.config_from_hf`).
    revision: e.g. a commit hash or a learner policy version tag.
  """
  config = model if isinstance(model, ModelConfig) else hf_config.config_from_hf(model)
  fields: dict[str, Any] = {name: getattr(config, name) for name in MODEL_FIELDS}
  if config.rope_scaling is not None:
    fields["rope_scaling"] = dataclasses.asdict(config.rope_scaling)
  fields["head_dim"] = config.resolved_head_dim
  fields["revision"] = revision
  return hashlib.sha256(json.dumps(fields, sort_keys=True).encode("utf-8")).hexdigest()


@dataclasses.dataclass(frozen=True)
class Fingerprint:
  """Digests of everything sampler and learner must share (see module docstring)."""

  tokenizer: str
  chat_template: str
  special_ids: str
  model: str

  def digest(self) -> str:
    """One hex digest of all parts."""
    return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode("utf-8")).hexdigest()

  def to_dict(self) -> dict[str, str]:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, str]) -> "Fingerprint":
    missing = [k for k in _PART_NAMES if k not in d]
    if missing:
      raise ValueError(f"fingerprint dict lacks {missing}")
    return cls(**{k: str(d[k]) for k in _PART_NAMES})


def make_fingerprint(tokenizer: Any, model: Union[ModelConfig, Mapping[str, Any], str, os.PathLike],
                     revision: Optional[str] = None) -> Fingerprint:
  """Fingerprint of a :class:`~jaxrl_llm.bridge.tokenizer.Tokenizer` and a model."""
  parts = tokenizer.fingerprint_parts()
  return Fingerprint(tokenizer=parts["tokenizer"], chat_template=parts["chat_template"],
                     special_ids=parts["special_ids"], model=model_fingerprint(model, revision))


def check_fingerprints(expected: Fingerprint, actual: Fingerprint, *, expected_name: str = "learner",
                       actual_name: str = "sampler") -> None:
  """Raises :class:`FingerprintMismatchError` naming each part that differs.

  Args:
    expected: e.g. the learner's fingerprint.
    actual: e.g. a sampler's fingerprint.
    expected_name / actual_name: labels used in the message.
  """
  differing = [k for k in _PART_NAMES if getattr(expected, k) != getattr(actual, k)]
  if differing:
    details = "; ".join(f"{_PART_NAMES[k]} differs ({expected_name} {getattr(expected, k)[:12]}, "
                        f"{actual_name} {getattr(actual, k)[:12]})" for k in differing)
    raise FingerprintMismatchError(f"{expected_name} and {actual_name} disagree: {details}", differing)


def check_tokenizer_matches_config(tokenizer: Any, config: ModelConfig) -> None:
  """Raises ValueError when the tokenizer's ids disagree with the config.

  eos and pad must be equal; bos only when both sides define one (Qwen
  configs name a bos id that their tokenizers never add); the tokenizer may
  have fewer ids than the embedding (Qwen pads its vocabulary), never more.
  """
  problems = []
  for name, tok_id, cfg_id in (("eos", tokenizer.eos_id, config.eos_token_id),
                               ("pad", tokenizer.pad_id, config.pad_token_id),
                               ("bos", tokenizer.bos_id, config.bos_token_id)):
    if tok_id != cfg_id and not (name == "bos" and None in (tok_id, cfg_id)):
      problems.append(f"{name}: tokenizer {tok_id}, ModelConfig {cfg_id}")
  if tokenizer.vocab_size > config.vocab_size:
    problems.append(f"tokenizer has {tokenizer.vocab_size} ids but ModelConfig.vocab_size is "
                    f"{config.vocab_size}")
  if problems:
    raise ValueError("tokenizer and ModelConfig disagree (pass pad_token_id=tokenizer.pad_id etc. to "
                     "config_from_hf): " + "; ".join(problems))
