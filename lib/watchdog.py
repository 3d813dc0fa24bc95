"""The hang watchdog: a thread on every rank that ends the job when no rank has made progress for
``trainer.hang_timeout_s``, so that the restart policy (lib/restarts.py) resumes it, where a hung collective would
otherwise wait for gloo's or NCCL's own timeout (half an hour) and a stopped process forever.

Progress is a beat (``beat()``: a clock read into a global, cheap enough for every decoded token): every stage's start
and end (lib.runlog.stage), every decoding step of the HF engine and of vLLM's stepped generation, every micro-batch
of an update, every phase of a checkpoint; and, seen by the watchdog's own thread each period, a main thread whose
innermost frames changed since the last look (Python code running: a long vLLM generate, a reward function, a
loop with no beat of its own), where a thread blocked in one call (a collective, a socket read, a sleep) shows the
same frames every time. A rank that waits in a collective for a slower rank makes no progress of its own, so the test is the job's:
each rank's thread writes, every ``period`` seconds, its stage and how long it has been idle into the run folder
(``watchdog/rank<r>.json``), and a rank fires only when every rank has been idle for the timeout; a rank whose file has
not been written for that long is not responding at all (stopped, frozen, killed) and counts as idle since its last
write. A slow step that progresses (a long generation, the first step's compile, a large save) never fires it.

Firing, every rank whose thread runs: its Python stacks (all threads) go to ``hangs/attempt<a>-rank<r>.txt``; the
cause goes where the restart reads it (lib/restarts.py); rank 0 prints which rank was where; the process exits
``HUNG`` (torchrun counts a failure and restarts the ranks, killing one that cannot act on its SIGTERM after 30 s).

Nothing here imports torch or another room of lib: the stage is read through the function ``start`` is given.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from typing import Callable

HUNG = 4
"""A rank's exit code when the watchdog ends it: a failure, restarted as any other."""

_last = [time.monotonic()]
_thread: list[threading.Thread] = []
_stop = threading.Event()


def beat() -> None:
    """This rank made progress."""
    _last[0] = time.monotonic()


def idle_ranks(states: dict[int, dict], world: int, now: float, timeout: float, since: float
               ) -> dict[int, float] | None:
    """How long each rank has been idle, given the states their files hold (``idle_s`` when written, ``written``
    the wall time of the write): None while any rank has been idle for less than ``timeout`` (the job progresses).
    A rank with no file counts as idle since ``since`` (when this rank's watchdog started)."""
    idle = {}
    for r in range(world):
        s = states.get(r)
        idle[r] = s["idle_s"] + (now - s["written"]) if s else now - since
    return idle if all(v >= timeout for v in idle.values()) else None


def _read(folder: str, world: int) -> dict[int, dict]:
    states = {}
    for r in range(world):
        try:
            with open(os.path.join(folder, f"rank{r}.json")) as f:
                states[r] = json.load(f)
        except (OSError, ValueError):  # none yet, or one being replaced
            continue
    return states


def silent(states: dict[int, dict], world: int, now: float, period: float) -> list[int]:
    """The ranks whose watchdog has not written for three periods (or never): stopped, frozen or killed."""
    return [r for r in range(world) if r not in states or now - states[r]["written"] > 3 * period + 1]


def describe(idle: dict[int, float], states: dict[int, dict], now: float, period: float) -> str:
    """One clause per rank: its stage and idle time, or that it stopped answering."""
    parts = []
    gone = silent(states, len(idle), now, period)
    for r, secs in idle.items():
        s = states.get(r)
        if s is None:
            parts.append(f"rank {r} never reported")
        elif r in gone:
            parts.append(f"rank {r} not responding for {now - s['written']:.0f} s (stopped, frozen or killed; last "
                         f"in stage {s['stage'] or '-'})")
        else:
            parts.append(f"rank {r} idle {secs:.0f} s in stage {s['stage'] or '-'}")
    return "; ".join(parts)


def where_running(frame, depth: int = 8) -> tuple:
    """The innermost ``depth`` frames of a thread, by file, function and line: what changes while it runs Python."""
    out = []
    while frame is not None and len(out) < depth:
        out.append((frame.f_code.co_filename, frame.f_code.co_name, frame.f_lineno))
        frame = frame.f_back
    return tuple(out)


def start(run_path: str, rank: int, world: int, attempt: int, timeout: float, where: Callable[[], str],
          on_fire: Callable[[str], None]) -> None:
    """Start this rank's watchdog (timeout <= 0: none). ``where()``: the rank's stage now; ``on_fire(cause)``: keeps
    the cause for the restart, before the process exits."""
    if timeout <= 0 or _thread:
        return
    folder = os.path.join(run_path, "watchdog")
    os.makedirs(folder, exist_ok=True)
    period = min(max(timeout / 10, 0.5), 10.0)
    beat()
    _stop.clear()
    started = time.time()

    def write() -> None:
        tmp = os.path.join(folder, f".rank{rank}.json.tmp")
        with open(tmp, "w") as f:
            json.dump({"rank": rank, "pid": os.getpid(), "stage": where(), "attempt": attempt,
                       "idle_s": time.monotonic() - _last[0], "written": time.time()}, f)
        os.replace(tmp, os.path.join(folder, f"rank{rank}.json"))

    main, seen = threading.main_thread().ident, [()]
    write()  # now: a rank stopped before the thread's first period still has a file

    def watch() -> None:
        while not _stop.wait(period):
            frames = where_running(sys._current_frames().get(main))
            if frames != seen[0]:
                seen[0] = frames
                beat()
            try:
                write()
                states = _read(folder, world)
            except OSError:
                continue  # a run folder that refuses a write now is the save's to report, not a hang
            now = time.time()
            states = {r: s for r, s in states.items() if s.get("attempt") == attempt}  # not a former attempt's
            idle = idle_ranks(states, world, now, timeout, started)
            if idle is None or _stop.is_set():
                continue
            gone = silent(states, world, now, period)
            fire(describe(idle, states, now, period), [r for r in range(world) if r not in gone])

    def fire(ranks: str, responding: list[int]) -> None:
        reporter = min(responding)
        stage = where() or "-"
        cause = f"hang: no rank made progress for {timeout:g} s (trainer.hang_timeout_s); {ranks}"
        stacks_of = lambda r: os.path.join(run_path, "hangs", f"attempt{attempt}-rank{r}.txt")  # noqa: E731
        stacks = stacks_of(rank)
        try:
            os.makedirs(os.path.dirname(stacks), exist_ok=True)
            with open(stacks + ".tmp", "w") as f:
                f.write(f"rank {rank}, pid {os.getpid()}, stage {stage}, idle {time.monotonic() - _last[0]:.0f} s\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
            os.replace(stacks + ".tmp", stacks)  # whole when it has its name
            on_fire(cause)
            # the other responding ranks fire within a period of this one: their stacks are written before any rank
            # exits (a rank gone first ends the others' collectives, and they their run, before their watchdogs fire)
            deadline = time.monotonic() + 3 * period + 5
            while time.monotonic() < deadline and not all(os.path.exists(stacks_of(r)) for r in responding):
                time.sleep(0.1)
        finally:
            if rank == reporter:
                print(f"error: {cause}; every rank's Python stacks are in {os.path.dirname(stacks)} (a rank not "
                      f"responding writes none): the job ends here for the restart to resume it", file=sys.stderr,
                      flush=True)
            os._exit(HUNG)

    thread = threading.Thread(target=watch, name="spmd-rl-watchdog", daemon=True)
    _thread.append(thread)
    thread.start()


def stop() -> None:
    """End the watchdog (the loop is over: export and shut-down are not watched)."""
    _stop.set()
    if _thread:
        _thread.pop().join()
