"""Stop signals: SIGTERM, SIGUSR1 (SLURM's pre-emption warning, ``scancel --signal=USR1``) and SIGINT (Ctrl-C) let the
step in flight finish; lib.resume.end_of_step then has every rank agree to stop, save a checkpoint and exit 0.

A signal can come before a rank can take it: while launch.sh sets up and checks the input, or while the ranks start
(torchrun, and so every rank until ``install`` runs, ignores SIGUSR1, which would otherwise kill it). On a loaded
machine that window lasts minutes, and SLURM sends its warning once: a warning that came while the ranks loaded their
models was ignored, and the job ran on into its time limit (issue 78). So launch.sh keeps every stop signal it gets
in the file named by ``REQUEST_ENV`` before it passes the signal on to the ranks, and a rank reads that file right
after its own handlers are in place: a signal that came before is taken from the file, one that comes after reaches
the handler. None is lost between the two.

Nothing here imports torch: the handlers go in first thing, before the slow imports and loads of start-up.
"""

from __future__ import annotations

import os
import signal
import sys
import time

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
REQUEST_ENV = "SPMD_RL_STOP_REQUEST"
"""A file launch.sh writes a stop signal's name into (``USR1`` or ``TERM``) when the signal reaches it."""
HOLD = "SPMD_RL_TEST_HOLD"
"""Test hook, ``WHERE:FILE`` (WHERE: ``check`` for lib.check, ``start`` for the ranks): the process named waits there,
before it can take a signal, while FILE exists, having written ``FILE.<who>`` (``check``, ``rank0``, ...) to say it
arrived. A test signals the job while it is held: the state a warning meets on a loaded machine."""

_requested: list[int] = []  # the signals received, in order


def _on_signal(signum, _frame) -> None:
    if not _requested and os.environ.get("RANK", "0") == "0":
        print(f"{signal.Signals(signum).name}: finishing the step in flight, then saving a checkpoint",
              file=sys.stderr, flush=True)
    _requested.append(signum)
    if signum == signal.SIGINT:
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C aborts at once


def hold_for_a_test(where: str) -> None:
    """The ``HOLD`` hook (tests only; nothing happens without the variable)."""
    at, _, marker = os.environ.get(HOLD, "").partition(":")
    if at != where or not marker:
        return
    who = f"rank{os.environ.get('RANK', '0')}" if where == "start" else where
    with open(f"{marker}.{who}", "w") as f:
        f.write(f"{os.getpid()}\n")
    while os.path.exists(marker):
        time.sleep(0.05)


def install() -> None:
    """Take SIGTERM and SIGUSR1 from here on, and those launch.sh kept for this rank before (``REQUEST_ENV``); Ctrl-C
    still aborts at once until ``take_interrupts`` (a run that has loaded nothing has nothing to save)."""
    hold_for_a_test("start")
    _requested.clear()
    for s in (signal.SIGTERM, signal.SIGUSR1):
        signal.signal(s, _on_signal)
    path = os.environ.get(REQUEST_ENV)
    try:
        with open(path or os.devnull) as f:
            kept = f.read().split()
    except OSError:
        kept = []
    names = {signal.Signals(s).name: s for s in (signal.SIGTERM, signal.SIGUSR1)}
    for name in kept[:1]:
        if not _requested and f"SIG{name}" in names:  # one that reached the handler meanwhile is the same signal
            _on_signal(names[f"SIG{name}"], None)


def take_interrupts() -> None:
    """Ctrl-C (SIGINT) finishes the step in flight too, from here on (once the run has something to save)."""
    signal.signal(signal.SIGINT, _on_signal)


def requested() -> int:
    """The first stop signal received (0: none)."""
    return _requested[0] if _requested else 0
