"""Final-answer extraction, normalisation and comparison (hand-checked cases)."""

from fractions import Fraction

import pytest

from jaxrl_llm.tasks.math_verify import answers_match, extract_answer, parse_number, verify

GSM8K_GOLD = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
              "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


@pytest.mark.parametrize("text,expected", [
    (GSM8K_GOLD, "72"),  # "####" wins over later/earlier numbers
    ("#### 1,000,000", "1,000,000"),
    ("#### $18.", "$18"),
    ("So the total is \\boxed{\\frac{3}{4}}.", "\\frac{3}{4}"),  # nested braces
    ("First \\boxed{1}, then \\boxed{2}", "2"),  # last box
    ("\\boxed{12 \\text{ apples}}", "12 \\text{ apples}"),
    ("The answer is $1,234.50.", "$1,234.50"),
    ("the final answer is: 3/4", "3/4"),
    ("The answer is 42 apples.\nWell done 7", "42"),  # "answer is" beats the last number
    ("Answer: \\dfrac{1}{2}", "\\dfrac{1}{2}"),
    ("She has 18 eggs left.", "18"),  # last number, sentence period dropped
    ("x = -5", "-5"),
    ("pages 3-4", "4"),  # a hyphen after a digit is not a minus sign
    ("1,2,3", "3"),  # not a thousands group
    ("that is 1{,}000", "1,000"),  # LaTeX thousands separator
    ("so \u22127", "-7"),  # Unicode minus
    ("I think 50%", "50%"),
    ("value -.5", "-.5"),
    ("no numbers here", None),
    ("\\boxed{}", None),
])
def test_extract_answer(text, expected):
  assert extract_answer(text) == expected


@pytest.mark.parametrize("text,value,is_percent", [
    ("72", Fraction(72), False),
    ("$1,234.50", Fraction(2469, 2), False),
    ("\\$12", Fraction(12), False),
    ("1,000,000", Fraction(10**6), False),
    ("3.0", Fraction(3), False),
    ("-7/2", Fraction(-7, 2), False),
    ("\\frac{3}{4}", Fraction(3, 4), False),
    ("-\\dfrac{1}{3}", Fraction(-1, 3), False),
    ("\\frac34", Fraction(3, 4), False),
    ("\\frac{1.5}{3}", Fraction(1, 2), False),
    ("50\\%", Fraction(50), True),
    ("12 \\text{ apples}", Fraction(12), False),
    ("90^\\circ", Fraction(90), False),
    ("1.5e3", Fraction(1500), False),
    ("(4)", Fraction(4), False),
    ("18.", Fraction(18), False),
])
def test_parse_number(text, value, is_percent):
  assert parse_number(text) == (value, is_percent)


@pytest.mark.parametrize("text", ["abc", "1/0", "\\frac{1}{0}", "1,2", "x=5", "", "3/"])
def test_parse_number_rejects(text):
  assert parse_number(text) is None


@pytest.mark.parametrize("pred,gold,expected", [
    ("0.75", "3/4", True),
    ("\\frac{3}{4}", "0.75", True),
    ("1234", "$1,234.00", True),
    ("72.0", "72", True),
    ("72.5", "72", False),
    ("50%", "50", True),  # percent="strip": 50% is 50
    ("50%", "0.5", False),
    ("0.3333333333", "1/3", True),  # within rel_tol=1e-6
    ("0.333", "1/3", False),
    ("-3", "3", False),
    ("Paris", "paris.", True),  # non-numeric: normalised string equality
    ("Paris", "3", False),
    (None, "3", False),
    ("3", None, False),
])
def test_answers_match(pred, gold, expected):
  assert answers_match(pred, gold) is expected


def test_answers_match_options():
  assert answers_match("50%", "0.5", percent="either")
  assert answers_match("0.5", "50%", percent="either")
  assert not answers_match("0.333", "1/3")
  assert answers_match("0.333", "1/3", rel_tol=1e-2)
  with pytest.raises(ValueError, match="percent"):
    answers_match("1", "1", percent="maybe")


def test_verify_end_to_end():
  assert verify("48 + 24 = 72. The answer is 72.", GSM8K_GOLD)
  assert verify("Thus the result is \\boxed{72}", GSM8K_GOLD)
  assert verify("so 72 clips\n#### 72", GSM8K_GOLD)
  assert not verify("The answer is 71.", GSM8K_GOLD)
  assert not verify("I don't know", GSM8K_GOLD)
  assert verify("The answer is $0.75", "#### 3/4")
  with pytest.raises(TypeError, match="str"):
    extract_answer(None)


PATHOLOGICAL = {"huge-exponent": "#### 1e99999999999", "overflow": "#### 1e400000", "5000-digits": "#### " + "7" * 5000,
                "slow-exponent": "#### 1e30000000", "tiny": "#### -1e-99999999999",
                "boxed-frac": "\\boxed{\\frac{1e99999}{3}}", "slash": "#### 1e99999/1e99999",
                "thousands": "#### " + ",".join(["123"] * 2000)}


@pytest.mark.parametrize("answer", list(PATHOLOGICAL.values()), ids=list(PATHOLOGICAL))
def test_pathological_answers_are_wrong_answers_quickly(answer):
  """Bounded work: huge exponents or digit counts are not numbers (no 10^(10^11), no OverflowError,
  no int-digits ValueError), so against a numeric gold answer they are simply wrong."""
  assert verify(answer, "#### 72") is False
  assert verify("#### 72", answer) is False
  assert verify(answer, answer) is True  # identical strings still match (normalised string equality)


def test_digit_and_exponent_limits():
  assert parse_number("1e1000") == (Fraction(10) ** 1000, False)  # at the limits: a number
  assert parse_number("1E-1000") == (Fraction(1, 10 ** 1000), False)
  assert parse_number("9" * 1000) == (Fraction(int("9" * 1000)), False)
  assert parse_number("1e1001") is None and parse_number("1e-1001") is None  # past them: not a number
  assert parse_number("1e0000000000000005") == (Fraction(100000), False)  # leading zeros of the exponent
  assert parse_number("9" * 1001) is None and parse_number("0." + "0" * 1000 + "1") is None
  assert answers_match("1e999", "1e999") and not answers_match("1e400", "1e401")  # above float range: exact
  assert answers_match("1e999", "1.0000000001e999")  # rel_tol, in exact arithmetic
