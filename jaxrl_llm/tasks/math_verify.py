"""Final-answer extraction and numeric comparison for GSM8K-style math data.

Pipeline: ``extract_answer`` finds the final answer text in a solution, ``parse_number``
normalises it to an exact ``Fraction``, ``answers_match`` compares two answers
numerically with a tolerance (or as normalised strings when either is not a number).

Extraction order (the first rule that matches wins, and within a rule the LAST
occurrence in the text):
  1. GSM8K gold format ``#### 42`` (rest of that line);
  2. ``\\boxed{...}`` / ``\\fbox{...}`` (braces balanced, so ``\\boxed{\\frac{3}{4}}`` works);
  3. ``the (final) answer is ...`` / ``answer: ...``: the first number in the rest of
     that line, else the rest of the line;
  4. the last number in the text.

Normalisation: ``$`` and ``\\$``, thousands commas (``1,234``, LaTeX ``1{,}234``),
``\\text{...}``/``\\mbox{...}`` units, ``^\\circ``, a trailing ``.``, the Unicode minus,
``\\frac{a}{b}``/``\\dfrac``/``\\tfrac``/``\\frac34``, ``a/b``, decimals and exponents
(``1.5e3``), ``-.5``. Percentages: with ``percent="strip"`` (default, the GSM8K
convention where gold answers are bare numbers) ``50%`` means 50; with
``percent="either"`` it matches 50 or 0.5.

Bounded work. A model's answer is untrusted text, and exact rationals of it can be
astronomically large (``1e99999999999`` is 10^(10^11)). Before converting, a number
written with more than ``MAX_DIGITS`` (1000) digits or an exponent of more than
``MAX_EXPONENT`` (1000) in absolute value is *not a number*: it matches only an
identical (normalised) string, so as a prediction against a numeric gold answer it is
simply wrong. Comparisons are exact (no float conversion, which overflows above 1e308),
so every call finishes quickly and never raises for any response text.

This is our own implementation; the ``math-verify`` package is not a dependency.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Optional

PERCENT_MODES = ("strip", "either")
MAX_DIGITS = 1000  # more digits than this in one number: not a number (bounded work)
MAX_EXPONENT = 1000  # |exponent| above this (as in 1e1001): not a number

_NUMBER = (r"(?:(?<![\w.)])-\s*)?\$?\s*"
           r"(?:\\[dt]?frac\{[^{}]*\}\{[^{}]*\}|\\[dt]?frac\d\d"
           r"|(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+(?:\.\d+)?)?|\.\d+)"
           r"(?:\s*\\?%)?")
_NUMBER_RE = re.compile(_NUMBER)
_GSM8K_RE = re.compile(r"####\s*([^\n]*)")
_ANSWER_IS_RE = re.compile(r"(?:final\s+answer|answer)\s*(?:is|:|=)\s*:?\s*([^\n]*)", re.I)
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FRAC_RE = re.compile(r"^(-?)\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}$")
_FRAC_SHORT_RE = re.compile(r"^(-?)\\[dt]?frac(\d)(\d)$")
_PLAIN_RE = re.compile(r"^-?(?:\d+(?:\.\d*)?|\.\d+)(?:e[-+]?\d+)?$", re.I)
_SLASH_RE = re.compile(r"^(-?[\d.]+(?:e[-+]?\d+)?)/(-?[\d.]+(?:e[-+]?\d+)?)$", re.I)
_TEXT_RE = re.compile(r"\\(?:text|mbox|mathrm)\s*\{[^{}]*\}")


def _last_boxed(text: str) -> Optional[str]:
  """Contents of the last ``\\boxed{...}``, with nested braces balanced."""
  starts = [m.end() for m in _BOXED_RE.finditer(text)]
  for start in reversed(starts):
    depth = 1
    for i in range(start, len(text)):
      if text[i] == "{":
        depth += 1
      elif text[i] == "}":
        depth -= 1
        if depth == 0:
          return text[start:i].strip()
  return None


def _strip_sentence_end(text: str) -> str:
  return text.strip().rstrip(".").strip()


def extract_answer(text: str) -> Optional[str]:
  """Finds the final answer in a worked solution or a model response.

  Args:
    text: solution text, e.g. ``"... so 3 + 4 = 7.\\n#### 7"``.

  Returns:
    The answer text (not yet normalised), or None when nothing answer-like is found.

  Example:
    >>> extract_answer("So the total is \\\\boxed{\\\\frac{3}{4}}.")
    '\\\\frac{3}{4}'
  """
  if not isinstance(text, str):
    raise TypeError(f"extract_answer expects a str, got {type(text).__name__}")
  text = text.replace("\u2212", "-").replace("{,}", ",")
  gsm = _GSM8K_RE.findall(text)
  if gsm and gsm[-1].strip():
    return _strip_sentence_end(gsm[-1])
  boxed = _last_boxed(text)
  if boxed:
    return boxed
  said = _ANSWER_IS_RE.findall(text)
  if said and said[-1].strip():
    span = said[-1]
    number = _NUMBER_RE.search(span)
    return _strip_sentence_end(number.group(0) if number else span)
  numbers = _NUMBER_RE.findall(text)
  if numbers:
    return _strip_sentence_end(numbers[-1])
  return None


def _clean(text: str) -> str:
  text = text.strip().replace("\u2212", "-").replace("{,}", "")
  text = _TEXT_RE.sub("", text)
  for junk in ("\\$", "$", "\\!", "\\,", "\\;", "\\left", "\\right", "^\\circ", "^{\\circ}",
               "\\displaystyle"):
    text = text.replace(junk, "")
  text = text.strip()
  while text.endswith(".") or text.endswith(","):
    text = text[:-1].rstrip()
  return text


def _plain_fraction(text: str) -> Optional[Fraction]:
  """``Fraction(text)`` of a plain decimal, or None when it is too long or its exponent too large."""
  mantissa, _, exponent = text.lower().partition("e")
  if sum(ch.isdigit() for ch in mantissa) > MAX_DIGITS:
    return None
  if exponent:
    digits = exponent.lstrip("+-").lstrip("0")
    if len(digits) > len(str(MAX_EXPONENT)) or int(digits or "0") > MAX_EXPONENT:
      return None
  return Fraction(text)


def _to_fraction(text: str) -> Optional[Fraction]:
  text = text.replace(" ", "")
  if _PLAIN_RE.match(text):
    return _plain_fraction(text)
  for pattern in (_FRAC_RE, _FRAC_SHORT_RE):
    m = pattern.match(text)
    if m:
      num, den = _to_fraction(m.group(2)), _to_fraction(m.group(3))
      if num is None or den is None or den == 0:
        return None
      return -num / den if m.group(1) else num / den
  m = _SLASH_RE.match(text)
  if m:
    num, den = _to_fraction(m.group(1)), _to_fraction(m.group(2))
    if num is None or den is None or den == 0:
      return None
    return num / den
  if text.startswith("(") and text.endswith(")"):
    return _to_fraction(text[1:-1])
  return None


def parse_number(text: str) -> Optional[tuple[Fraction, bool]]:
  """Normalises an answer string to an exact number.

  Args:
    text: e.g. ``"$1,234.50"``, ``"\\dfrac{3}{4}"``, ``"-7/2"``, ``"50\\%"``.

  Returns:
    ``(value, is_percent)`` with ``value`` as written (``"50%"`` -> ``(50, True)``), or
    None when the text is not a number.
  """
  text = _clean(text)
  is_percent = text.endswith("%")
  if is_percent:
    text = text[:-1].rstrip().rstrip("\\").rstrip()
  if re.fullmatch(r"-?\d{1,3}(,\d{3})+(\.\d+)?", text):
    text = text.replace(",", "")
  value = _to_fraction(text)
  return None if value is None else (value, is_percent)


def _normalise_text(text: str) -> str:
  return re.sub(r"\s+", "", _clean(text)).lower()


def _close(a: Fraction, b: Fraction, rel_tol: float, abs_tol: float) -> bool:
  """``math.isclose`` in exact arithmetic (no float overflow for numbers above 1e308)."""
  if a == b:
    return True
  return abs(a - b) <= max(Fraction(rel_tol) * max(abs(a), abs(b)), Fraction(abs_tol))


def answers_match(pred: Optional[str], gold: Optional[str], *, rel_tol: float = 1e-6,
                  abs_tol: float = 1e-9, percent: str = "strip") -> bool:
  """Compares two extracted answers.

  Numbers match when ``|p - g| <= max(rel_tol * max(|p|, |g|), abs_tol)`` (exact
  rationals first, so ``3/4 == 0.75`` exactly). Non-numbers match when equal after
  normalisation (whitespace, ``$``, ``\\text{}``, trailing ``.``, case).

  Args:
    pred: predicted answer text (None never matches).
    gold: reference answer text (None never matches).
    rel_tol: relative tolerance.
    abs_tol: absolute tolerance.
    percent: ``"strip"`` (``50%`` is 50) or ``"either"`` (``50%`` is 50 or 0.5).

  Returns:
    True when the answers agree.
  """
  if percent not in PERCENT_MODES:
    raise ValueError(f"percent must be one of {PERCENT_MODES}, got {percent!r}")
  if pred is None or gold is None:
    return False
  p, g = parse_number(pred), parse_number(gold)
  if p is None or g is None:
    if p is None and g is None:
      return bool(_normalise_text(pred)) and _normalise_text(pred) == _normalise_text(gold)
    return False
  candidates_p = [p[0]] + ([p[0] / 100] if p[1] and percent == "either" else [])
  candidates_g = [g[0]] + ([g[0] / 100] if g[1] and percent == "either" else [])
  return any(_close(a, b, rel_tol, abs_tol) for a in candidates_p for b in candidates_g)


def verify(response: str, gold_solution: str, **kwargs) -> bool:
  """Extracts the final answers of a response and a gold solution and compares them.

  Args:
    response: model output.
    gold_solution: reference (GSM8K ``answer`` field with ``#### N``, or a bare answer).
    **kwargs: ``rel_tol``, ``abs_tol``, ``percent`` of ``answers_match``.

  Returns:
    True when the final answers agree.
  """
  return answers_match(extract_answer(response), extract_answer(gold_solution), **kwargs)
