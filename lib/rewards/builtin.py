"""Rule-based scorers: GSM8K (#### answers), MATH (boxed answers), and the embedded toy task.

Each takes (solution_str, ground_truth, extra_info) and returns a float or a dict with a "score" key
(the other keys are logged as metrics).
"""

from __future__ import annotations

import re
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
    """strict: the number after the last '#### '; flexible: the last number anywhere in the text."""
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


def normalize_math(s: str) -> str:
    """The usual MATH string normalisation (Hendrycks et al. 2021 style), enough for exact-match grading."""
    s = s.strip()
    for old, new in (("\\left", ""), ("\\right", ""), ("\\!", ""), ("\\,", ""), ("\\;", ""), ("\\:", ""),
                     ("dfrac", "frac"), ("tfrac", "frac"), ("^\\circ", ""), ("^{\\circ}", ""), ("\\$", ""),
                     ("$", ""), ("\\%", ""), ("%", ""), ("\\text{ }", ""), ("mbox", "text")):
        s = s.replace(old, new)
    s = re.sub(r"\\text\{\s*([^}]*)\}", r"\1", s)
    s = s.replace(" ", "")
    if s.startswith("."):
        s = "0" + s
    s = re.sub(r"\\frac(\d)(\d)", r"\\frac{\1}{\2}", s)
    s = re.sub(r"\\sqrt(\d)", r"\\sqrt{\1}", s)
    if re.fullmatch(r"[a-zA-Z]=.*", s):  # "x=5" -> "5"
        s = s.split("=", 1)[1]
    if s.endswith(".0") and s[:-2].lstrip("-").isdigit():
        s = s[:-2]
    return s.rstrip(".")


def math_answer(solution_str: str, ground_truth: str, extra_info: Any = None) -> dict:
    pred = last_boxed(solution_str)
    gt = last_boxed(ground_truth) or ground_truth
    correct = False
    if pred is not None:
        try:  # math-verify handles equivalent forms (1/2 vs 0.5, sets, intervals) when installed
            from math_verify import parse, verify

            correct = bool(verify(parse(f"${gt}$"), parse(f"${pred}$")))
        except ImportError:
            correct = False
        correct = correct or normalize_math(pred) == normalize_math(gt)
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
