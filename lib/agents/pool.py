"""Function agents in worker processes of the rank (``agent.workers``; the processes: lib/agents/worker.py).

Episodes go to the workers in turn, in the order they start (the rank decides it, between the endpoint's rounds);
each worker plays many at once, a thread each. ``ended`` is asked between rounds, on the rank's main thread: the
episodes whose agents returned since, and those of a worker found dead (an agent that called ``os._exit``, a
segfault), which fail as errors; a fresh worker takes the dead one's place. An episode's time limit counts from when
its thread began in its worker (the worker says so): a worker's start-up, and the time an episode waited there for a
thread while the worker's others ran, are no episode's time. An agent past its time limit is left to end in its
worker (a thread cannot be killed); what it returns then is dropped.
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import wait
from typing import Any

from lib.rewards.pool import spawn


class AgentPool:
    def __init__(self, entry: str, workers: int):
        self.entry = entry
        self.workers = [self._spawn() for _ in range(workers)]
        self.ready = [False] * workers  # whether each worker has loaded the agent (its first message)
        self.placed: dict[str, int] = {}  # the episodes playing: their worker
        self.began: dict[str, float] = {}  # when each began in its worker (time.monotonic: one clock a machine)
        self.sent = 0

    def _spawn(self) -> tuple:
        # in the rank's folder: agent.entry's path, and the paths the agent opens, read as the rank reads them
        return spawn("lib.agents.worker", self.entry, cwd=os.getcwd())

    def start(self, name: str, row: dict, base_url: str) -> None:
        k = self.sent % len(self.workers)
        self.sent += 1
        self.placed[name] = k
        try:
            self.workers[k][2].send((name, row, base_url))
        except OSError:  # the worker is dead: ended() fails the episode and replaces it
            pass

    def running(self, name: str) -> bool:
        return name in self.placed

    def since(self, name: str) -> float | None:
        """When the episode ``name`` began to count against its time limit: when its thread began in its worker;
        None before."""
        return self.began.get(name)

    def ended(self) -> list[tuple[str, str, Any, float | None]]:
        """(name, kind, value, ran) of the episodes ended since the last call: kind "" and the agent's return, or
        the failure's kind and why; the seconds it ran in its worker (None: it never began)."""
        out: list = []
        inboxes = [w[1] for w in self.workers]
        for conn in wait(inboxes, timeout=0):
            self._read(inboxes.index(conn), out)
        for k, (proc, inbox, outbox) in enumerate(self.workers):
            code = proc.poll()
            if code is None:
                continue
            self._read(k, out)  # what it sent before it died
            if not self.ready[k]:
                raise RuntimeError(f"agent.workers: a worker process could not load agent.entry={self.entry!r} "
                                   f"(exit code {code}; its error is above)")
            for name in [n for n, j in self.placed.items() if j == k]:
                del self.placed[name]
                began = self.began.pop(name, None)
                out.append((name, "error", f"the agent's worker process died (exit code {code}), and the episodes "
                                           f"it was playing with it: an agent that exits or crashes its process",
                            None if began is None else time.monotonic() - began))
            inbox.close()
            outbox.close()
            self.workers[k] = self._spawn()
            self.ready[k] = False
        return out

    def _read(self, k: int, out: list) -> None:
        conn = self.workers[k][1]
        try:
            while conn.poll():
                what, *got = conn.recv()
                if what == "ready":
                    self.ready[k] = True
                elif what == "began":
                    self.began[got[0]] = got[1]
                else:  # ended
                    name, kind, value, when = got
                    self.placed.pop(name, None)
                    began = self.began.pop(name, None)
                    out.append((name, kind, value, None if began is None else when - began))
        except (EOFError, OSError):  # a dead worker's pipe: ended() fails what it still played
            pass

    def close(self) -> None:
        for proc, inbox, outbox in self.workers:
            outbox.close()  # the worker exits when its end closes
            inbox.close()
        for proc, _, _ in self.workers:
            try:
                proc.wait(timeout=10)
            except Exception:  # noqa: BLE001 - one that does not exit in time is killed
                proc.kill()
                proc.wait()
        self.workers = []
