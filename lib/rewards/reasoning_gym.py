"""reasoning-gym's answer check as a rule scorer: a row whose data_source is ``reasoning_gym/<task>`` is scored by the
library's own ``score_answer`` on the entry it was made from, which the row names (task, seed, size, the generator's
settings, index) in ``extra_info.reasoning_gym``. The entry is made again from those (every generator is a function
of its seed and index), so the score is the library's on the very entry the prompt shows, metadata included.

The answer is the text inside the response's last ``<answer>...</answer>`` (reasoning_gym.utils.extract_answer, the
format its system prompt asks for); a response without one scores what the library gives None (0 for every task).

Torch-free like the rest of lib/rewards: the reward workers import it. reasoning_gym itself is imported on first use
(pip install -e '.[reasoning-gym]').
"""

from __future__ import annotations

import functools
import json
from typing import Any

from lib.rewards.optional import Preload, optional

SOURCE_PREFIX = "reasoning_gym/"
INSTALL = "pip install -e '.[reasoning-gym]' (or pip install reasoning-gym==0.1.25)"


def library() -> Any:
    return optional("reasoning_gym", "reasoning_gym rows need the reasoning-gym package", INSTALL)


@functools.lru_cache(maxsize=64)
def dataset(task: str, seed: int, size: int, settings: str) -> Any:
    """The library's dataset of ``task`` (``settings``: its generator's keyword arguments as JSON)."""
    return library().create_dataset(task, seed=seed, size=size, **json.loads(settings))


def entry_of(where: dict) -> tuple[Any, dict]:
    """(dataset, entry) that ``extra_info.reasoning_gym`` names."""
    ds = dataset(where["task"], int(where["seed"]), int(where["size"]), where.get("settings", "{}"))
    return ds, ds[int(where["index"])]


def _key(extra_info: Any) -> tuple | None:
    where = extra_info.get("reasoning_gym") if isinstance(extra_info, dict) else None
    try:
        return (where["task"], int(where["seed"]), int(where["size"]), where.get("settings", "{}"))
    except (TypeError, KeyError, ValueError):
        return None


PRELOAD = Preload(_key, dataset)
"""The library and the row's dataset, loaded by the reward worker before the sample's time starts."""


def score(solution_str: str, ground_truth: Any = None, extra_info: Any = None) -> dict:
    """The library's score of the response's answer on the row's entry; ``acc`` is 1 for a full score."""
    where = extra_info.get("reasoning_gym") if isinstance(extra_info, dict) else None
    if not isinstance(where, dict):
        raise ValueError("a reasoning_gym row has no extra_info.reasoning_gym (task, seed, size, settings, index); "
                         "make the rows with --data.train_files reasoning_gym:TASK")
    ds, entry = entry_of(where)
    answer = library().utils.extract_answer(solution_str)
    value = float(ds.score_answer(answer, entry))
    return {"score": value, "acc": float(value == 1.0), "answer": answer}
