"""An optional library, imported where first used: its absence is one error that names the pip command."""

from __future__ import annotations

import importlib
from typing import Any, Callable


class Preload:
    """What a prefix rule loads for a row (a library, a dataset), once a process per key: ``key(extra_info)`` names it
    (None: the row names nothing to load), ``load(*key)`` loads it. The reward worker loads it with the sample's clock
    stopped (lib/rewards/worker.py)."""

    def __init__(self, key: Callable[[Any], tuple | None], load: Callable[..., Any]):
        self.key, self.load, self.done = key, load, set()

    def loaded(self, extra_info: Any) -> bool:
        key = self.key(extra_info)
        return key is None or key in self.done

    def prepare(self, extra_info: Any) -> None:
        key = self.key(extra_info)
        if key is not None:
            self.load(*key)
            self.done.add(key)


def optional(module: str, what: str, install: str) -> Any:
    """``module`` imported, or ValueError: ``what`` needs it, and ``install`` adds it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{what}, which is not installed: {install}") from None
