"""An optional library, imported where first used: its absence is one error that names the pip command."""

from __future__ import annotations

import importlib
from typing import Any


def optional(module: str, what: str, install: str) -> Any:
    """``module`` imported, or ValueError: ``what`` needs it, and ``install`` adds it."""
    try:
        return importlib.import_module(module)
    except ImportError:
        raise ValueError(f"{what}, which is not installed: {install}") from None
