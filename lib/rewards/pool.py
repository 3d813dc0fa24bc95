"""A pool of reward worker processes with a per-sample time limit.

Samples go out in chunks; each worker reports every sample as it finishes it, so the pool knows which sample a
worker is on. A worker's clock starts when it reports itself ready (started, scorer or tools loaded): a fresh
worker's start-up, slow on a loaded machine, is no sample's time. A worker that runs past ``timeout_s`` on one
sample (Python or C code alike) is killed, the sample
counts as a timeout, the rest of its chunk goes back to the queue and a fresh worker takes its place. A worker that
dies (``os._exit``, a segfault) costs its current sample the same way ("crashes"); one found dead when a chunk
is sent to it is replaced and the chunk goes to the queue again. Workers ignore the stop signals (SIGTERM, SIGUSR1,
SIGINT, SIGHUP): a scheduler signals every process of a job, and stopping is the trainer's to do.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections import deque
from multiprocessing.connection import Connection, wait
from typing import Any

from lib.multi_turn.tools import failed
from lib.rewards import LOADING

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

Result = tuple[float, dict, Any, str, str]  # score, numeric extras, answer, failure kind, message


def spawn(module: str, *args: str, cwd: str = ROOT) -> tuple[subprocess.Popen, Connection, Connection]:
    """``module``'s ``main([READ_FD, WRITE_FD, *args])`` in a process of its own, a pipe each way (the reward
    workers, the agent workers), in ``cwd`` with this project first on its path (before ``cwd``, which may hold a
    ``lib`` of its own): returns the process, what it sends (its inbox here) and what it reads (its outbox)."""
    parent_read, child_write = os.pipe()
    child_read, parent_write = os.pipe()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    start = f"import sys; sys.path.insert(0, {ROOT!r}); from {module} import main; main(sys.argv[1:])"
    proc = subprocess.Popen([sys.executable, "-c", start, str(child_read), str(child_write), *args],
                            pass_fds=(child_read, child_write), env=env, cwd=cwd, stdin=subprocess.DEVNULL)
    os.close(child_read)
    os.close(child_write)
    return proc, Connection(parent_read, writable=False), Connection(parent_write, readable=False)


class _Worker:
    def __init__(self, custom: str, mode: str = "score"):
        self.proc, self.inbox, self.outbox = spawn("lib.rewards.worker", custom, mode)
        self.chunk: deque = deque()  # indices sent and not yet reported, in order
        self.since = 0.0  # when the current sample started (the last report, the send, or the ready report)
        self.ready = False  # the worker said it has started (its first message)

    def send(self, items: list) -> None:
        self.chunk.extend(item[0] for item in items)
        self.since = time.monotonic()
        self.outbox.send(items)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.inbox.close()
        self.outbox.close()


def _score_failed(kind: str, message: str) -> Result:
    return 0.0, {}, None, kind, message


class RewardPool:
    """``mode`` score: samples are (data_source, text, ground_truth, extra_info[, columns]) -> a Result each. ``mode``
    tools: ``custom`` is a tools spec (lib/multi_turn/tools.py) and items are tool calls (name, arguments, bound
    keyword arguments) -> (observation text, failure kind, message) each; a killed call is answered by
    ``tools.failed``."""

    def __init__(self, custom: str = "", timeout_s: float = 10.0, num_workers: int = 2, mode: str = "score"):
        self.custom, self.timeout_s, self.mode = custom, timeout_s, mode
        if mode == "tools":

            self.failed, self.what, self.limit = failed, "tool", "multi_turn.tool_timeout_s"
        else:
            self.failed, self.what, self.limit = _score_failed, "scorer", "reward.timeout_s"
        self.workers = [_Worker(custom, mode) for _ in range(max(1, num_workers))]

    def score(self, items: list[tuple], pin: list[int] | None = None) -> list[Any]:
        """One result per item, in order (see the class docstring); also how tool calls are run. ``pin``: a key per
        item; items of one key go to one worker (key modulo the number of workers), in order, in one chunk (an
        environment's state lives in its worker). A lost worker's place, and its items, go to a fresh one."""
        results: list[Result | None] = [None] * len(items)
        if pin is None:  # one queue all workers take from, a few chunks per worker to balance the load
            size = max(1, -(-len(items) // (4 * len(self.workers))))
            queues = [deque((i, *items[i]) for i in range(len(items)))] * len(self.workers)
        else:
            size = len(items)
            queues = [deque() for _ in self.workers]
            for i, key in enumerate(pin):
                queues[key % len(self.workers)].append((i, *items[i]))
        idle = list(self.workers)
        busy: dict[Connection, _Worker] = {}
        while any(queues) or busy:
            for worker in list(idle):
                queue = queues[self.workers.index(worker)]
                if not queue:
                    continue
                idle.remove(worker)
                chunk = [queue.popleft() for _ in range(min(size, len(queue)))]
                try:
                    worker.send(chunk)
                except OSError:  # the worker died while idle (BrokenPipeError): its chunk never started
                    queue.extendleft(reversed(chunk))
                    idle.append(self._fresh(worker))
                    continue
                busy[worker.inbox] = worker
            if not busy:
                continue
            now = time.monotonic()
            started = [w.since for w in busy.values() if w.ready]
            timeout = max(0.0, min(started) + self.timeout_s - now) if started else None
            for conn in wait(list(busy), timeout=timeout):
                worker = busy[conn]
                try:
                    message = conn.recv()
                    if message is None:  # ready: its current sample's clock starts now
                        worker.ready, worker.since = True, time.monotonic()
                        continue
                    if message == LOADING:  # a rule's load (lib.rewards.PREPARE): no sample's time
                        worker.ready = False
                        continue
                    index, *result = message
                except (EOFError, OSError):  # the worker died on its current sample
                    try:
                        code = worker.proc.wait(timeout=5)
                    except subprocess.TimeoutExpired:
                        code = None
                    self._replace(worker, busy, idle, queues, results, items, "crashes",
                                  f"the {self.what}'s worker process died (exit code {code})")
                    continue
                results[index] = tuple(result)
                worker.chunk.popleft()
                worker.since = time.monotonic()
                if not worker.chunk:
                    del busy[conn]
                    idle.append(worker)
            now = time.monotonic()
            for worker in [w for w in busy.values() if w.ready and now - w.since > self.timeout_s]:
                self._replace(worker, busy, idle, queues, results, items, "timeouts",
                              f"the {self.what} ran past {self.limit}={self.timeout_s:g} s")
        return results  # type: ignore[return-value]

    def _replace(self, worker: _Worker, busy: dict, idle: list, queues: list[deque], results: list, items: list,
                 kind: str, message: str) -> None:
        """Kill a worker, fail its current sample, requeue the rest of its chunk, start a fresh worker."""
        del busy[worker.inbox]
        current, *rest = worker.chunk
        results[current] = self.failed(kind, message)
        queues[self.workers.index(worker)].extendleft(reversed([(i, *items[i]) for i in rest]))
        idle.append(self._fresh(worker))

    def _fresh(self, worker: _Worker) -> _Worker:
        """A new worker in a lost one's place."""
        worker.kill()
        fresh = _Worker(self.custom, self.mode)
        self.workers[self.workers.index(worker)] = fresh
        return fresh

    def close(self) -> None:
        for worker in self.workers:
            worker.kill()
        self.workers = []
