"""Rule-based scorers: GSM8K (#### answers), MATH (boxed answers), and the embedded toy task.

Each takes (solution_str, ground_truth, extra_info) and returns a float or a dict with a "score" key
(the other keys are logged as metrics).
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_NUMBER = re.compile(r"-?[\d,]*\.?\d+")


def _clean_number(s: str) -> str:
    s = s.replace(",", "").replace("$", "").strip().rstrip(".")
    try:
        f = float(s)
    except ValueError:
        return s
    return str(int(f)) if f == int(f) else str(f)


def gsm8k_answer(text: str, method: str = "strict") -> str | None:
    """strict: the number after the last '####'; flexible: the last number anywhere in the text.

    Where strict differs from verl's strict GSM8K scorer: verl needs '#### ' with one space and takes the number
    with its trailing period, so '####1500' (no space) and '#### 1500.' (a sentence's full stop) score 0 there and
    1 here; any run of spaces is taken here, and a trailing period is dropped. Commas and '$' are removed on both."""
    if method == "strict":
        found = re.findall(r"####\s*(-?[\d,]*\.?\d+)", text)
        return _clean_number(found[-1]) if found else None
    found = [m for m in _NUMBER.findall(text) if m not in ("", ".")]
    return _clean_number(found[-1]) if found else None


def gsm8k(solution_str: str, ground_truth: str, extra_info: Any = None, method: str = "strict",
          format_score: float = 0.0) -> dict:
    answer = gsm8k_answer(solution_str, method)
    correct = answer is not None and answer == _clean_number(str(ground_truth))
    score = 1.0 if correct else (format_score if answer is not None else 0.0)
    return {"score": score, "acc": float(correct), "answer": answer}


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} (or \\fbox{...}), braces balanced."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = text.find("{", start)
    if i < 0:
        rest = text[start:].split(" ", 1)  # "\boxed 5"
        return rest[1].split("$")[0].strip() if len(rest) > 1 else None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1:j]
    return None


# unit words dropped after a number (a subset of the list verl's DAPO MATH scorer removes)
_UNITS = ("square units", "sq units", "units", "unit", "cm", "centimeters", "meters", "m", "km", "inches", "inch",
          "feet", "foot", "ft", "miles", "mph", "degrees", "degree", "cents", "dollars", "hours", "hour", "minutes",
          "seconds", "days", "points", "students", "ways", "people")


def normalize_math(s: str) -> str:
    """MATH answer normalisation for exact-match grading, used where math-verify is not installed: what verl's
    MATH scorer (Hendrycks et al. 2021) strips (\\left/\\right, spacing commands, dfrac/tfrac, degrees, dollars,
    percent, units, "x=" prefixes, a/b as \\frac{a}{b}, 0.5-style decimals) plus thousands separators, trailing
    zeros and braces around one-character exponents and subscripts."""
    s = s.strip()
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\:", ""),
                     ("\\ ", ""), ("dfrac", "frac"), ("tfrac", "frac"), ("^\\circ", ""), ("^{\\circ}", ""),
                     ("\\circ", ""), ("\\degree", ""), ("\\$", ""), ("$", ""), ("\\%", ""), ("%", ""),
                     ("\\text{ }", ""), ("mbox", "text"), ("\\displaystyle", "")):
        s = s.replace(old, new)
    s = re.sub(r"(\d)\s*\\(?:text|mathrm)\{\s*[a-zA-Z][a-zA-Z ]*\}\s*$", r"\1", s)  # "5\text{ cm}" -> "5"
    s = re.sub(r"\\(?:text|mathrm)\{\s*([^}]*)\}", r"\1", s)
    s = re.sub(r"(\d)\s*(?:" + "|".join(_UNITS) + r")\s*(?:\^\{?[23]\}?)?$", r"\1", s)
    s = s.replace(" ", "")
    s = re.sub(r"(?<![\d.])(\d{1,3})((?:,\d{3})+)(?![\d])", lambda m: m.group(1) + m.group(2).replace(",", ""), s)
    if s.startswith("."):
        s = "0" + s
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\frac\{([^{}]*)\}(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\w)", r"\\sqrt{\1}", s)
    s = re.sub(r"([\^_])\{(\w)\}", r"\1\2", s)  # x^{2} -> x^2
    if re.fullmatch(r"[a-zA-Z]\w?=.*", s):  # "x=5" -> "5"
        s = s.split("=", 1)[1]
    s = re.sub(r"^(-?\d+)/(\d+)$", r"\\frac{\1}{\2}", s)  # a/b
    s = re.sub(r"(\d+\.\d*?)0+(?!\d)", r"\1", s)  # trailing zeros: 2.50 -> 2.5, 3.0 -> 3.
    s = re.sub(r"(\d)\.(?!\d)", r"\1", s)
    return s


def _exact_number(s: str) -> Fraction | None:
    """A normalised answer as an exact rational: an integer, a decimal, or \\frac{a}{b} (signed)."""
    m = re.fullmatch(r"(-?)\\frac\{(-?\d+)\}\{(-?\d+)\}", s)
    try:
        if m:
            value = Fraction(int(m.group(2)), int(m.group(3)))
            return -value if m.group(1) else value
        if re.fullmatch(r"-?\d+(\.\d+)?", s):
            return Fraction(s)
    except (ValueError, ZeroDivisionError):
        return None
    return None


def math_equal(pred: str, truth: str) -> bool:
    """Our fallback grading: normalised strings equal, or both exact numbers of the same value."""
    a, b = normalize_math(pred), normalize_math(truth)
    if a == b:
        return True
    x, y = _exact_number(a), _exact_number(b)
    return x is not None and x == y


def math_answer(solution_str: str, ground_truth: str, extra_info: Any = None) -> dict:
    """The last \\boxed{} answer graded with math-verify (a dependency: equivalent forms, sets, intervals), or
    with ``math_equal`` where it cannot be imported; either way a normalised exact match also counts."""
    pred = last_boxed(solution_str)
    gt = last_boxed(ground_truth) or ground_truth
    correct = False
    if pred is not None:
        try:
            from math_verify import parse, verify

            correct = bool(verify(parse(f"${gt}$"), parse(f"${pred}$")))
        except ImportError:
            correct = False
        correct = correct or math_equal(pred, gt)
    return {"score": float(correct), "acc": float(correct), "answer": pred}


def toy(solution_str: str, ground_truth: str, extra_info: Any = None) -> dict:
    """The toy task's dense reward: the length of the correct prefix over the longer of answer and response,
    so trailing extra characters cost as much as missing ones (the policy must also learn to stop)."""
    expected = str(ground_truth)
    got = solution_str.strip()
    prefix = 0
    for a, b in zip(got, expected):
        if a != b:
            break
        prefix += 1
    exact = got == expected
    return {"score": prefix / max(len(expected), len(got), 1), "acc": float(exact)}
