"""Which engines of this process are awake, and the order they woke and slept in.

Engines that take turns on one device (the policy's rollout engine and a judge model, lib/judges/local.py) must
never hold their weights there at the same time: each engine reports its wakes and sleeps here under its name, and
one that must wake alone asks ``others`` first. ``EVENTS`` keeps the latest of them, for tests and for an error
that shows what was awake.
"""

from __future__ import annotations

from collections import deque

EVENTS: deque[tuple[str, str]] = deque(maxlen=4096)
"""(engine name, "wake" or "sleep"), oldest first."""
_awake: set[str] = set()


def woke(name: str) -> None:
    _awake.add(name)
    EVENTS.append((name, "wake"))


def slept(name: str) -> None:
    _awake.discard(name)
    EVENTS.append((name, "sleep"))


def others(name: str) -> set[str]:
    """The engines awake now, ``name`` left out."""
    return _awake - {name}


def overlaps(events: list[tuple[str, str]]) -> list[tuple[int, set[str]]]:
    """Where in ``events`` two or more engines were awake at once: (index of the event, the engines awake)."""
    up: set[str] = set()
    found = []
    for i, (name, what) in enumerate(events):
        (up.add if what == "wake" else up.discard)(name)
        if len(up) > 1:
            found.append((i, set(up)))
    return found
