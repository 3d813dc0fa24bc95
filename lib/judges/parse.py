"""A judge's answer -> a score, or why there is none.

Three ways a judge writes its verdict: a JSON object with a named field (``{"score": 7, "why": "..."}``), a
``\\boxed{7}``, or a line ``Score: 7`` (``7/10`` too). A reasoning judge's ``<think>...</think>`` block is dropped
first (a number inside it is thinking, not the verdict; an unclosed block is a verdict never reached). The last
verdict in the text counts. A score outside the judge's scale, a text with none, and an answer cut by the judge's
token limit are not scores: they come back as ``None`` with the reason, and the sample is masked from the update,
never rewarded 0.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

OK, UNPARSED, TRUNCATED, ERROR, DEADLINE, OVER_BUDGET = "ok", "unparsed", "truncated", "error", "deadline", "over_budget"
"""A verdict's status: scored, or the reason the sample has no score."""

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL)
_BOXED = re.compile(r"\\boxed\{\s*([-+]?\d+(?:\.\d+)?)\s*(?:/\s*\d+(?:\.\d+)?)?\s*\}")
_SCORE = re.compile(r"score\s*[:=]\s*\**\s*([-+]?\d+(?:\.\d+)?)(?:\s*/\s*\d+(?:\.\d+)?)?", re.IGNORECASE)
_NUMBER = (int, float)


@dataclass(frozen=True)
class Verdict:
    score: float | None  # in the reward range; None: no score (status says why)
    status: str
    text: str = ""


def strip_think(text: str) -> tuple[str, bool]:
    """The text without its think blocks, and whether a block was left open (the verdict never came)."""
    text = _THINK.sub("", text)
    start = text.rfind("<think>")
    return (text[:start], True) if start >= 0 else (text, False)


def _json_value(text: str, field: str) -> float | None:
    """The numeric ``field`` of the last JSON object in ``text`` that has it."""
    found = None
    for start in [i for i, c in enumerate(text) if c == "{"]:
        try:
            obj, _ = json.JSONDecoder().raw_decode(text[start:])
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict) and isinstance(obj.get(field), _NUMBER) and not isinstance(obj.get(field), bool):
            found = float(obj[field])
    return found


def _last(pattern: re.Pattern, text: str) -> float | None:
    hits = pattern.findall(text)
    return float(hits[-1]) if hits else None


def raw_score(text: str, how: str = "auto", field: str = "score") -> float | None:
    """The judge's score on its own scale: ``how`` json (``field`` of a JSON object), boxed, score ("Score: N"), or
    auto (the three in that order)."""
    ways = {"json": lambda t: _json_value(t, field), "boxed": lambda t: _last(_BOXED, t),
            "score": lambda t: _last(_SCORE, t)}
    if how != "auto":
        return ways[how](text)
    for way in ("json", "boxed", "score"):
        if (value := ways[way](text)) is not None:
            return value
    return None


def verdict(text: str, truncated: bool, how: str, field: str, scale: tuple[float, float],
            reward: tuple[float, float]) -> Verdict:
    """``text`` judged: its score on ``scale`` (low, high) mapped linearly onto ``reward`` (low, high), or None with
    the reason. ``truncated``: the judge stopped at its token limit (its finish reason)."""
    body, unclosed = strip_think(text)
    if truncated or unclosed:
        return Verdict(None, TRUNCATED, text)
    value = raw_score(body, how, field)
    low, high = scale
    if value is None or not low <= value <= high:
        return Verdict(None, UNPARSED, text)
    return Verdict(reward[0] + (value - low) / (high - low) * (reward[1] - reward[0]), OK, text)


def verdict_schema(field: str, low: float, high: float) -> dict:
    """The OpenAI ``response_format`` that makes the server decode a JSON verdict, ``{"<field>": N}`` with N on the
    judge's scale (guided decoding: vLLM's and SGLang's servers and hosted APIs take this form). An endpoint that
    does not is refused by the start-up probe, which sends it too."""
    number = {"type": "number", "minimum": low, "maximum": high}
    return {"type": "json_schema", "json_schema": {"name": "verdict", "strict": True, "schema": {
        "type": "object", "properties": {field: number}, "required": [field], "additionalProperties": False}}}
