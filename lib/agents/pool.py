"""Function agents in worker processes of the rank (``agent.workers``; the processes: lib/agents/worker.py).

Episodes go to the workers in turn, in the order they start (the rank decides it, between the endpoint's rounds);
each worker plays many at once, a thread each. ``ended`` is asked between rounds, on the rank's main thread: the
episodes whose agents returned since, and those of a worker found dead (an agent that called ``os._exit``, a
segfault), which fail as errors; a fresh worker takes the dead one's place. An agent past its time limit is left to
end in its worker (a thread cannot be killed); what it returns then is dropped.
"""

from __future__ import annotations

import os
from multiprocessing.connection import wait
from typing import Any

from lib.rewards.pool import spawn


class AgentPool:
    def __init__(self, entry: str, workers: int):
        self.entry = entry
        self.workers = [self._spawn() for _ in range(workers)]
        self.placed: dict[str, int] = {}  # the episodes playing: their worker
        self.sent = 0

    def _spawn(self) -> tuple:
        return spawn("lib.agents.worker", self.entry, cwd=os.getcwd())  # agent.entry's path as the rank reads it

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

    def ended(self) -> list[tuple[str, str, Any]]:
        """(name, kind, value) of the episodes ended since the last call: kind "" and the agent's return, or the
        failure's kind and why."""
        out = []
        inboxes = [w[1] for w in self.workers]
        for conn in wait(inboxes, timeout=0):
            try:
                while conn.poll():
                    name, kind, value = conn.recv()
                    self.placed.pop(name, None)
                    out.append((name, kind, value))
            except (EOFError, OSError):  # a dead worker's pipe: below
                pass
        for k, (proc, inbox, outbox) in enumerate(self.workers):
            code = proc.poll()
            if code is None:
                continue
            for name in [n for n, j in self.placed.items() if j == k]:
                del self.placed[name]
                out.append((name, "error", f"the agent's worker process died (exit code {code}), and the episodes "
                                           f"it was playing with it: an agent that exits or crashes its process"))
            inbox.close()
            outbox.close()
            self.workers[k] = self._spawn()
        return out

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
