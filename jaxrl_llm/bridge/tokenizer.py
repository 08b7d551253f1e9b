"""A small tokenizer wrapper over the ``tokenizers`` library, plus char-level tokenizers.

:class:`Tokenizer` loads a Hugging Face tokenizer folder (``tokenizer.json``,
``tokenizer_config.json`` for special tokens and the chat template, or
``chat_template.jinja`` / ``chat_template.json``), encodes and decodes (single
and batch, defaults as in transformers: ``add_special_tokens=True`` on encode,
``skip_special_tokens=False`` on decode), renders chat templates
(:mod:`jaxrl_llm.bridge.chat_template`) and fingerprints itself so that
sampler and learner can prove they tokenise identically
(:mod:`jaxrl_llm.bridge.fingerprint`).

Padding id (pad must never equal EOS: the stop token is sampled and trained,
padding is masked), first rule that applies:
  1. ``pad_token=`` given to the constructor / :meth:`Tokenizer.from_folder`;
  2. ``pad_token`` of tokenizer_config.json (or special_tokens_map.json) when
     its id differs from EOS;
  3. the added special token with the lowest id whose text contains ``pad``
     (e.g. Llama 3.1 ``<|finetune_right_pad_id|>``, Qwen ``<|fim_pad|>``) and
     is neither EOS nor BOS;
  4. the highest id of the vocabulary that is neither EOS nor BOS.
Asking explicitly for a pad token equal to EOS is an error.

:func:`build_char_tokenizer` makes an in-memory char-level tokenizer (ids: pad
0, eos 1, bos 2, then one id per character, then ``<unk>`` when asked) for the built-in tasks. Char-level
tokenizers (built here or loaded from a folder saved by :meth:`Tokenizer.save`)
take a pure-python fast path for encode/decode that gives the same ids as the
library, except that an unknown character raises ValueError (the library gives
it the ``<unk>`` id when there is one, and otherwise drops it silently: either
would corrupt task rewards).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any, Mapping, Optional, Sequence

import tokenizers
from tokenizers import AddedToken, decoders, models

from jaxrl_llm.bridge.chat_template import render_chat_template

DEFAULT_CHAR_SPECIALS = ("<pad>", "<eos>", "<bos>")
DEFAULT_CHAR_CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}")
_SPECIAL_NAMES = ("bos_token", "eos_token", "pad_token", "unk_token")


def _token_text(value: Any) -> Optional[str]:
  """tokenizer_config stores special tokens as strings or AddedToken dicts."""
  if value is None or isinstance(value, str):
    return value
  if isinstance(value, Mapping) and "content" in value:
    return value["content"]
  raise ValueError(f"cannot read a special token from {value!r}")


def _sha256(text: str) -> str:
  return hashlib.sha256(text.encode("utf-8")).hexdigest()


def _char_fast_path(tok_json: Mapping[str, Any]) -> Optional[tuple[dict[str, int], list[Any]]]:
  """(char -> id, added tokens) when the tokenizer is a plain char-level BPE, else None."""
  model = tok_json.get("model") or {}
  if (model.get("type") != "BPE" or model.get("merges") or model.get("byte_fallback")
      or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix")
      or model.get("dropout") or tok_json.get("normalizer") is not None
      or tok_json.get("pre_tokenizer") is not None or tok_json.get("post_processor") is not None
      or (tok_json.get("decoder") or {}).get("type") != "Fuse"):
    return None
  added = tok_json.get("added_tokens") or []
  if any(t.get("lstrip") or t.get("rstrip") or t.get("single_word") or t.get("normalized")
         for t in added):
    return None
  added_text = {t["content"] for t in added}
  chars = {}
  for text, idx in model.get("vocab", {}).items():
    if text in added_text:
      continue
    if len(text) != 1:
      return None
    chars[text] = int(idx)
  return chars, added


class Tokenizer:
  """Encode/decode, special ids, chat template and fingerprint of one tokenizer.

  Args:
    tokenizer: a ``tokenizers.Tokenizer``.
    chat_template: jinja2 chat template text, or None.
    bos_token / eos_token / pad_token / unk_token: special-token strings
      (EOS is required; pad follows the rules in the module docstring).
    model_max_length: recorded in tokenizer_config.json on save.
    source: where it came from (used in error messages).
    strict_pad: a ``pad_token`` equal to EOS is an error (True) or, as for a
      pad read from tokenizer_config.json, replaced by the fallback rules.
  """

  def __init__(self, tokenizer: tokenizers.Tokenizer, *, chat_template: Optional[str] = None,
               bos_token: Optional[str] = None, eos_token: Optional[str] = None,
               pad_token: Optional[str] = None, unk_token: Optional[str] = None,
               model_max_length: Optional[int] = None, source: str = "<in-memory tokenizer>",
               strict_pad: bool = True):
    self._tok = tokenizer
    self.chat_template = chat_template
    self.source = source
    self.model_max_length = model_max_length
    self._json = json.loads(tokenizer.to_str())
    if eos_token is None:
      raise ValueError(f"{source}: no eos_token (set 'eos_token' in tokenizer_config.json)")
    self.eos_token, self.bos_token, self.unk_token = eos_token, bos_token, unk_token
    self.eos_id = self._require_id(eos_token, "eos_token")
    self.bos_id = self._require_id(bos_token, "bos_token") if bos_token is not None else None
    self.pad_token, self.pad_id = self._resolve_pad(pad_token, strict_pad)
    self._special_ids = frozenset(t["id"] for t in self._json.get("added_tokens", []) if t.get("special"))
    fast = _char_fast_path(self._json)
    self._char_to_id: Optional[dict[str, int]] = None
    if fast is not None:
      chars, added = fast
      self._char_to_id = chars
      self._added_to_id = {t["content"]: int(t["id"]) for t in added}
      self._id_to_text = {i: c for c, i in chars.items()}
      self._id_to_text.update({i: c for c, i in self._added_to_id.items()})
      ordered = sorted(self._added_to_id, key=len, reverse=True)
      self._added_re = re.compile("|".join(re.escape(t) for t in ordered)) if ordered else None

  # ----------------------------------------------------------------- loading
  @classmethod
  def from_folder(cls, folder: str | os.PathLike, *, pad_token: Optional[str] = None) -> "Tokenizer":
    """Loads ``tokenizer.json`` (+ tokenizer_config.json, chat_template.jinja) from a folder."""
    folder = os.fspath(folder)
    path = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(path):
      raise FileNotFoundError(f"{folder}: no tokenizer.json")
    tok = tokenizers.Tokenizer.from_file(path)
    config: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):
      p = os.path.join(folder, name)
      if os.path.isfile(p):
        with open(p, encoding="utf-8") as f:
          config.update({k: v for k, v in json.load(f).items() if v is not None})
    template = config.get("chat_template")
    if isinstance(template, list):
      by_name = {t.get("name"): t.get("template") for t in template}
      if "default" not in by_name:
        raise ValueError(f"{folder}/tokenizer_config.json: chat_template list has no 'default' entry "
                         f"(names: {sorted(by_name)})")
      template = by_name["default"]
    jinja_path = os.path.join(folder, "chat_template.jinja")
    json_path = os.path.join(folder, "chat_template.json")
    if os.path.isfile(jinja_path):
      with open(jinja_path, encoding="utf-8") as f:
        template = f.read()
    elif template is None and os.path.isfile(json_path):
      with open(json_path, encoding="utf-8") as f:
        template = json.load(f).get("chat_template")
    explicit = pad_token is not None
    return cls(tok, chat_template=template,
               bos_token=_token_text(config.get("bos_token")),
               eos_token=_token_text(config.get("eos_token")),
               pad_token=pad_token if explicit else _token_text(config.get("pad_token")),
               unk_token=_token_text(config.get("unk_token")),
               model_max_length=config.get("model_max_length"), source=folder,
               strict_pad=explicit)

  from_pretrained = from_folder

  def _require_id(self, token: str, field: str) -> int:
    idx = self._tok.token_to_id(token)
    if idx is None:
      raise ValueError(f"{self.source}: {field}={token!r} is not in the vocabulary")
    return int(idx)

  def _resolve_pad(self, pad_token: Optional[str], explicit: bool) -> tuple[str, int]:
    avoid = {self.eos_id} | ({self.bos_id} if self.bos_id is not None else set())
    if pad_token is not None:
      pad_id = self._require_id(pad_token, "pad_token")
      if pad_id != self.eos_id:
        return pad_token, pad_id
      if explicit:
        raise ValueError(f"{self.source}: pad_token={pad_token!r} has the EOS id {pad_id}; padding must "
                         "have its own id so that the stop token stays trainable")
    specials = sorted((t["id"], t["content"]) for t in self._json.get("added_tokens", [])
                      if t.get("special") and "pad" in t["content"].lower())
    for idx, text in specials:
      if idx not in avoid:
        return text, int(idx)
    for idx in range(self.vocab_size - 1, -1, -1):
      if idx not in avoid:
        return self._tok.id_to_token(idx), idx
    raise ValueError(f"{self.source}: no id is free for padding")

  # -------------------------------------------------------------- properties
  @property
  def vocab_size(self) -> int:
    """Number of ids, added tokens included."""
    return self._tok.get_vocab_size(with_added_tokens=True)

  @property
  def backend(self) -> tokenizers.Tokenizer:
    """The underlying ``tokenizers.Tokenizer``."""
    return self._tok

  @property
  def is_char_level(self) -> bool:
    """True when encode/decode take the pure-python char fast path."""
    return self._char_to_id is not None

  def token_to_id(self, token: str) -> Optional[int]:
    return self._tok.token_to_id(token)

  def id_to_token(self, idx: int) -> Optional[str]:
    return self._tok.id_to_token(idx)

  def special_tokens(self) -> dict[str, Optional[str]]:
    """{bos_token, eos_token, pad_token, unk_token} strings (template variables)."""
    return {name: getattr(self, name) for name in _SPECIAL_NAMES}

  # -------------------------------------------------------- encode / decode
  def _encode_chars(self, text: str) -> list[int]:
    table = self._char_to_id
    try:
      if self._added_re is None or self._added_re.search(text) is None:
        return [table[c] for c in text]
      ids: list[int] = []
      pos = 0
      for match in self._added_re.finditer(text):
        ids.extend(table[c] for c in text[pos:match.start()])
        ids.append(self._added_to_id[match.group()])
        pos = match.end()
      ids.extend(table[c] for c in text[pos:])
      return ids
    except KeyError as e:
      raise ValueError(f"{self.source}: character {e.args[0]!r} in {text!r} is not in the "
                       f"alphabet {''.join(sorted(table))!r}") from None

  def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of ``text`` (post-processor specials, e.g. BOS, when asked)."""
    if not isinstance(text, str):
      raise TypeError(f"encode expects a str, got {type(text).__name__}")
    if self._char_to_id is not None:
      return self._encode_chars(text)
    return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

  def encode_batch(self, texts: Sequence[str], add_special_tokens: bool = True) -> list[list[int]]:
    """Token ids of each text."""
    if self._char_to_id is not None:
      return [self.encode(t) for t in texts]
    return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=add_special_tokens)]

  def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
    """Text of ``ids`` (optionally without special tokens)."""
    ids = [int(i) for i in ids]
    if self._char_to_id is not None:
      table = self._id_to_text
      try:
        if skip_special_tokens:
          return "".join(table[i] for i in ids if i not in self._special_ids)
        return "".join(table[i] for i in ids)
      except KeyError as e:
        raise ValueError(f"{self.source}: id {e.args[0]} is outside the vocabulary "
                         f"(size {self.vocab_size})") from None
    return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

  def decode_batch(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = False) -> list[str]:
    """Text of each id sequence."""
    return [self.decode(ids, skip_special_tokens) for ids in batch]

  # ------------------------------------------------------------ chat template
  def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
                          tokenize: bool = False, **kwargs: Any) -> str | list[int]:
    """Renders ``messages`` with the chat template (then encodes without extra specials).

    Args:
      messages: list of {"role", "content"} dicts.
      add_generation_prompt: append the assistant-turn header.
      tokenize: return ids instead of text (``add_special_tokens=False``, as
        transformers does, since templates write BOS themselves).
      **kwargs: template variables (tools=, enable_thinking=, ...).
    """
    if self.chat_template is None:
      raise ValueError(f"{self.source}: no chat template (tokenizer_config.json 'chat_template' or "
                       "chat_template.jinja)")
    text = render_chat_template(self.chat_template, messages, add_generation_prompt=add_generation_prompt,
                                special_tokens=self.special_tokens(), **kwargs)
    return self.encode(text, add_special_tokens=False) if tokenize else text

  # -------------------------------------------------------------- fingerprint
  def fingerprint_parts(self) -> dict[str, str]:
    """sha256 hex digests of {tokenizer, chat_template, special_ids}."""
    canonical = json.dumps(self._json, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    ids = json.dumps({"bos": self.bos_id, "eos": self.eos_id, "pad": self.pad_id}, sort_keys=True)
    return {"tokenizer": _sha256(canonical), "chat_template": _sha256(self.chat_template or ""),
            "special_ids": _sha256(ids)}

  def fingerprint(self) -> str:
    """One stable hex digest of tokenizer.json content, chat template and special ids."""
    return _sha256(json.dumps(self.fingerprint_parts(), sort_keys=True))

  # ---------------------------------------------------------------- saving
  def save(self, folder: str | os.PathLike) -> str:
    """Writes tokenizer.json and tokenizer_config.json (loadable by transformers too)."""
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    self._tok.save(os.path.join(folder, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "bos_token": self.bos_token, "eos_token": self.eos_token, "pad_token": self.pad_token,
              "unk_token": self.unk_token, "chat_template": self.chat_template}
    if self.model_max_length is not None:
      config["model_max_length"] = self.model_max_length
    with open(os.path.join(folder, "tokenizer_config.json"), "w", encoding="utf-8") as f:
      json.dump(config, f, indent=2, ensure_ascii=False)
    return folder


def build_char_tokenizer(alphabet: str, special: Sequence[str] = DEFAULT_CHAR_SPECIALS, *,
                         chat_template: Optional[str] = DEFAULT_CHAR_CHAT_TEMPLATE,
                         unk_token: Optional[str] = None) -> Tokenizer:
  """An in-memory char-level tokenizer: specials first, then one id per character[, then ``unk_token``].

  Args:
    alphabet: the characters, each once (ids len(special), len(special)+1, ...).
    special: (pad, eos, bos[, more...]) special tokens, ids 0, 1, 2, ...
    chat_template: jinja2 template; the default writes BOS, each message's
      content, and EOS after assistant turns.
    unk_token: e.g. ``"<unk>"``: one more id, last, that the saved tokenizer
      (``transformers``, vLLM) gives a character outside the alphabet; this class still
      raises on one. None (default, what the built-in tasks use): no unknown token, and
      the saved tokenizer drops such a character silently. The default stays None
      because the extra id changes the model's shape, and with it every figure measured
      on the built-in tasks.

  Returns:
    A :class:`Tokenizer` with pad id 0, eos id 1, bos id 2 (for the default
    ``special``).
  """
  if len(special) < 2:
    raise ValueError(f"special={tuple(special)}: expected at least (pad, eos[, bos])")
  if len(set(special)) != len(special):
    raise ValueError(f"special={tuple(special)}: duplicate special tokens")
  if not alphabet:
    raise ValueError("alphabet is empty")
  seen = set()
  for c in alphabet:
    if c in seen:
      raise ValueError(f"alphabet {alphabet!r} repeats the character {c!r}")
    seen.add(c)
  specials = tuple(special) + ((unk_token,) if unk_token is not None else ())
  clash = [s for s in specials if s in seen]
  if clash:
    raise ValueError(f"special tokens {clash} are also alphabet characters")
  if unk_token in special:
    raise ValueError(f"unk_token={unk_token!r} is also in special={tuple(special)}")
  vocab = {s: i for i, s in enumerate(special)}
  vocab.update({c: len(special) + i for i, c in enumerate(alphabet)})
  if unk_token is not None:
    vocab[unk_token] = len(vocab)
  tok = tokenizers.Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=unk_token, fuse_unk=False))
  tok.decoder = decoders.Fuse()
  tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
  return Tokenizer(tok, chat_template=chat_template, pad_token=special[0], eos_token=special[1],
                   bos_token=special[2] if len(special) > 2 else None, unk_token=unk_token,
                   source=f"char tokenizer {alphabet!r}")
