"""Scoring responses: a rule per ``data_source``, a custom function, or a reward model -> token_level_scores.

Rule and custom scorers run in worker processes (``lib/rewards/pool.py``), each sample under a time limit that
also stops code busy in C. A scorer that raises, returns no usable score (None, NaN, a string, a dict without
``score``), exits, crashes its worker or runs past the limit costs its sample only: it scores 0 and is counted by
kind in ``reward/<kind>``; the first message of each kind is printed once. Extra numeric keys a scorer returns
(acc, format, ...) are averaged into the metrics as ``reward/<key>``; an ``answer`` (or ``pred``) key is the
extracted answer validation's maj@N votes on.

This module stays free of torch: the workers import it.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
import numbers
import os
from typing import Any, Callable

from lib.rewards import builtin, reasoning_gym, verifiers_score
from lib.rewards.optional import Preload

ScoreFn = Callable[..., Any]

RULES: dict[str, ScoreFn] = {
    "openai/gsm8k": builtin.gsm8k, "gsm8k": builtin.gsm8k,
    "lighteval/MATH": builtin.math_answer, "DigitalLearningGmbH/MATH-lighteval": builtin.math_answer,
    "math": builtin.math_answer, "HuggingFaceH4/MATH-500": builtin.math_answer,
    "hiyouga/geometry3k": builtin.math_answer,
    "toy": builtin.toy,
}


PREFIX_RULES: dict[str, ScoreFn] = {reasoning_gym.SOURCE_PREFIX: reasoning_gym.score,
                                    verifiers_score.SOURCE_PREFIX: verifiers_score.score}
"""Data sources scored by prefix: ``reasoning_gym/<task>`` for every task of reasoning-gym
(lib/rewards/reasoning_gym.py), ``verifiers/<env id>`` for a verifiers environment's rows
(lib/rewards/verifiers_score.py)."""


PREPARE: dict[str, Preload] = {reasoning_gym.SOURCE_PREFIX: reasoning_gym.PRELOAD,
                               verifiers_score.SOURCE_PREFIX: verifiers_score.PRELOAD}
"""A prefix rule's load of what a row needs (a library, a dataset), run by the reward worker with the sample's clock
stopped, so the first row of a task is not timed on an import (seconds, on a loaded machine). A load that hangs is
not timed out."""
LOADING = "loading"
"""The reward worker's message: a load starts; the sample's clock stops until the next ready (None)."""


def by_prefix(table: dict[str, Any], source: object) -> Any:
    """The value of ``table`` whose key (a data source prefix) starts ``source``; None if none does."""
    if isinstance(source, str):
        for prefix, value in table.items():
            if source.startswith(prefix):
                return value
    return None


def _preload(data_source: object) -> Preload | None:
    return by_prefix(PREPARE, data_source)


def needs_load(data_source: object, extra_info: Any) -> bool:
    preload = _preload(data_source)
    return preload is not None and not preload.loaded(extra_info)


def prepare(data_source: object, extra_info: Any) -> None:
    """Load what scoring the row needs (a failure is left to the score, which reports it as the sample's)."""
    preload = _preload(data_source)
    if preload is not None:
        try:
            preload.prepare(extra_info)
        except Exception:  # noqa: BLE001 - the score raises it again, as the sample's own failure
            pass


def prefix_rule(source: object) -> ScoreFn | None:
    return by_prefix(PREFIX_RULES, source)


class Sources(frozenset):
    """The data sources a rule scores: RULES' names and PREFIX_RULES' prefixes."""

    def __contains__(self, source: object) -> bool:
        return frozenset.__contains__(self, source) or prefix_rule(source) is not None


RULE_SOURCES = Sources([*RULES, *(f"{prefix}<name>" for prefix in PREFIX_RULES)])

FAILURE_KINDS = ("errors", "invalid", "exits", "crashes", "timeouts")
"""How a sample's scoring can fail: the scorer raised; returned no usable score; called sys.exit; killed its
worker process; ran past reward.timeout_s."""


def load_object(spec: str, what: str = "custom reward") -> Any:
    """``path/to/file.py:name`` -> that object of the file (checked before any model loads). A relative path that is
    not found from the working directory is looked up from the project's root (``lib/toy.py:lookup``)."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"{what} {spec!r} must look like path/to/file.py:function_name")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    if not os.path.isfile(path) and not os.path.isabs(path) and os.path.isfile(os.path.join(root, path)):
        path = os.path.join(root, path)
    if not os.path.isfile(path):
        raise ValueError(f"{what} file {path!r} does not exist")
    module_spec = importlib.util.spec_from_file_location(f"custom_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - user code: any failure to import is a config error
        raise ValueError(f"{what} file {path} failed to import: {type(e).__name__}: {e}") from None
    if not hasattr(module, name):
        raise ValueError(f"{path} has no function {name!r}")
    return getattr(module, name)


def load_custom(spec: str) -> ScoreFn:
    """``path/to/file.py:function`` -> the function (checked before any model loads)."""
    fn = load_object(spec)
    if not callable(fn):
        raise ValueError(f"custom reward {spec}: {type(fn).__name__} is not a function")
    return fn


FIXED_ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")


@functools.cache
def _keywords(fn: ScoreFn) -> tuple[bool, frozenset[str]]:
    """(takes **kwargs, its parameter names), read once per function: workers ask for every sample."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: pass nothing extra
        return False, frozenset()
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()), frozenset(params)


def keyword_columns(fn: ScoreFn, columns: Any) -> list[str]:
    """The row columns (besides the standard four) ``fn`` takes as keyword arguments, as TRL passes a dataset's
    columns to its reward functions: every one with ``**kwargs``, else those it names."""
    any_kw, params = _keywords(fn)
    return [c for c in columns if c not in FIXED_ARGUMENTS and (any_kw or c in params)]


def check_truth_source(fn: ScoreFn, spec: str, truths: Any, columns: Any) -> None:
    """Refuse a custom scorer that would see no ground truth at all: no row has reward_model.ground_truth and the
    function takes none of the rows' other columns (it would get ground_truth=None for every sample)."""
    if any(t is not None for t in truths):
        return
    names = sorted({k for row in columns for k in row})
    if keyword_columns(fn, names):
        return
    raise ValueError(f"no data row has reward_model.ground_truth, and --reward.custom_fn {spec} takes none of the "
                     f"rows' other columns {names} as a keyword argument: it would get ground_truth=None for every "
                     f"sample. Add the column as a parameter (def fn(..., {names[0] if names else 'solution'}=None)) "
                     f"or **kwargs, or put each row's answer in reward_model.ground_truth")


def rule_for(data_source: Any) -> ScoreFn:
    if data_source in RULES:
        return RULES[data_source]
    if (fn := prefix_rule(data_source)) is not None:
        return fn
    raise ValueError(f"no scorer for data_source {data_source!r}; known: {sorted(RULE_SOURCES)}, or set "
                     f"--reward.custom_fn path/to/file.py:function")


def result_of(out: Any) -> tuple[float, dict[str, float], Any, str, str]:
    """A scorer's return value -> (score, numeric extras, answer, failure kind or "", message)."""
    score, extras, answer, kind = interpret(out)
    message = f"the scorer returned {type(out).__name__} {str(out)[:80]!r}, not a finite score" if kind else ""
    return score, extras, answer, kind, message


def interpret(out: Any) -> tuple[float, dict[str, float], Any, str]:
    """A scorer's return value -> (score, numeric extras, answer, failure kind or ""). A real number (bools and
    numpy scalars count), or a dict with a finite numeric ``score``; anything else is "invalid"."""
    info = dict(out) if isinstance(out, dict) else {"score": out}
    answer = info.pop("answer", info.pop("pred", None))
    score = info.pop("score", None)
    if not isinstance(score, numbers.Real) or not math.isfinite(score):
        return 0.0, {}, None, "invalid"
    extras = {k: float(v) for k, v in info.items() if isinstance(v, numbers.Real) and math.isfinite(v)}
    return float(score), extras, (None if answer is None else str(answer)), ""
