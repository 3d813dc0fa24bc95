"""The CUDA device API as lib/ reads it, faked on a CPU, so that code which runs only where CUDA is available runs
in the CPU tests too (the first GPU run crashed in such a branch: lib/runlog.py's stage bookkeeping).

What is faked, and nothing else: ``torch.cuda.is_available`` (True), the allocator's counters
(``memory_allocated``, ``max_memory_allocated``, ``reset_peak_memory_stats``), ``mem_get_info``,
``get_device_properties``, ``synchronize`` and ``empty_cache``. Tensors stay on the CPU: a run under the fake forces
``trainer.device cpu``, so the branches that read the Topology's device take their CPU side, and those of our own
code that ask ``torch.cuda.is_available()`` take their GPU side (the libraries below us are told the truth: their
CUDA side would touch a device).

The allocator behaves as CUDA's does: ``reset_peak_memory_stats`` sets the peak to what is allocated now, an
allocation raises it, a free lowers only the current count. Code under the fake allocates nothing through it, so
each reset also starts a burst: the work after the k-th reset allocates ``k * burst_bytes`` and frees it, so each
stage peaks higher than the one before it and falls back after (the pattern that made an inner stage's peak equal
its outer stage's on the GPU). Tests that want exact figures call ``alloc``/``free`` with ``burst_bytes=0``.

``install()`` patches the running process; ``ENV`` set to 1 in a child's environment installs it there too
(``tests/child_hooks/sitecustomize.py``, put on the child's PYTHONPATH), for runs through torchrun.
"""

from __future__ import annotations

import sys
from types import SimpleNamespace
from typing import Any, Callable

import torch

OURS = ("lib", "tests", "bench", "__main__", "train_grpo", "train_ppo")
"""The modules (top-level package names) that see the fake's ``is_available``."""
ENV = "RL_FAKE_CUDA"
GIB = 2**30


class FakeDevice:
    """One GPU's memory counters. ``total_bytes``: the device's size; ``base_bytes``: allocated at the start;
    ``burst_bytes``: what the k-th stage's work adds to its peak, times k."""

    def __init__(self, total_bytes: int = 80 * GIB, base_bytes: int = 1 * GIB, burst_bytes: int = GIB // 4):
        self.total, self.current, self.burst = total_bytes, base_bytes, burst_bytes
        self.peak = base_bytes
        self.resets = 0
        self.calls: dict[str, int] = {}
        self._real_is_available = torch.cuda.is_available

    # ---- what the code under test allocates (tests only)

    def alloc(self, num_bytes: int) -> None:
        self.current += num_bytes
        self.peak = max(self.peak, self.current)

    def free(self, num_bytes: int) -> None:
        self.current -= num_bytes

    # ---- torch.cuda's functions

    def _count(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def is_available(self) -> bool:
        """True for the project's own code (lib/, the scripts, tests), False for the libraries under it: their CUDA
        side would touch real devices (torch's checkpoint writer opens CUDA streams when CUDA is available)."""
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if caller.split(".")[0] not in OURS:
            return self._real_is_available()
        self._count("is_available")
        return True

    def reset_peak_memory_stats(self, device: Any = None) -> None:
        self._count("reset_peak_memory_stats")
        self.resets += 1
        self.peak = self.current
        # the stage's work: allocated and freed again before anyone reads the counters
        self.alloc(self.resets * self.burst)
        self.free(self.resets * self.burst)

    def max_memory_allocated(self, device: Any = None) -> int:
        self._count("max_memory_allocated")
        return self.peak

    def memory_allocated(self, device: Any = None) -> int:
        self._count("memory_allocated")
        return self.current

    def mem_get_info(self, device: Any = None) -> tuple[int, int]:
        self._count("mem_get_info")
        return self.total - self.current, self.total

    def get_device_properties(self, device: Any = None) -> Any:
        self._count("get_device_properties")
        return SimpleNamespace(total_memory=self.total, name="fake CUDA device (CPU)", major=9, minor=0)

    def synchronize(self, device: Any = None) -> None:
        self._count("synchronize")

    def empty_cache(self) -> None:
        self._count("empty_cache")


PATCHED = ("is_available", "reset_peak_memory_stats", "max_memory_allocated", "memory_allocated", "mem_get_info",
           "get_device_properties", "synchronize", "empty_cache")


def install(fake: FakeDevice | None = None, setattr_fn: Callable[[Any, str, Any], None] = setattr) -> FakeDevice:
    """Put ``fake`` (a new one if None) in place of torch.cuda's functions above. ``setattr_fn``: pytest's
    ``monkeypatch.setattr`` to undo it after a test; plain ``setattr`` for a whole process."""
    fake = fake or FakeDevice()
    for name in PATCHED:
        setattr_fn(torch.cuda, name, getattr(fake, name))
    return fake
