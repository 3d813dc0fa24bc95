"""Faults on purpose, for the tests of restarts and the watchdog (nothing happens without the variable).

``SPMD_RL_TEST_FAULT`` holds comma-separated faults ``KIND:STAGE:STEP:RANK:ATTEMPT[:TIMES]``: at the start of stage
STAGE (its full path, as ``step/update``) of step STEP (as metrics.jsonl numbers steps, from 1), rank RANK, in the
launch's attempt ATTEMPT (0: the first start, n: the n-th restart; ``*``: every attempt), the first TIMES times the
rank comes there (default 1; ``*``: every time), does KIND:

- ``kill``: SIGKILL to itself (the OOM killer, a lost node);
- ``stop``: SIGSTOP to itself (a frozen process: only a SIGKILL or a SIGCONT acts on it);
- ``hang``: sleeps for ever where it stands (a collective the other ranks wait in, a call that ignores its timeout);
- ``raise``: a RuntimeError (a crash with a traceback).

The faults are real (the signal is sent, the process sleeps): only where and when they strike is chosen.
"""

from __future__ import annotations

import os
import signal
import time

from lib.restarts import attempt

ENV = "SPMD_RL_TEST_FAULT"
_step = [0]
_struck: dict[str, int] = {}  # times each fault struck in this process


def next_step(step: int) -> None:
    """The step (numbered from 1) the rank starts now."""
    _step[0] = step


def at(stage: str) -> None:
    """Strike where the variable says, at the start of ``stage``."""
    spec = os.environ.get(ENV)
    if not spec:
        return
    rank = os.environ.get("RANK", "0")
    for fault in spec.split(","):
        kind, where, step, who, when, *times = fault.split(":")
        if (where, int(step), who) != (stage, _step[0], rank) or when not in ("*", str(attempt())):
            continue
        if times != ["*"] and _struck.get(fault, 0) >= int((times or ["1"])[0]):
            continue
        _struck[fault] = _struck.get(fault, 0) + 1
        if kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif kind == "hang":
            while True:
                time.sleep(3600)
        elif kind == "raise":
            raise RuntimeError(f"a fault injected by {ENV} in stage {stage} of step {step}")
