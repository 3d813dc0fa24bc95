"""An agent worker process (``agent.workers``; started by lib/agents/pool.py, arguments READ_FD WRITE_FD ENTRY).

Loads ``agent.entry`` once (and warms the openai SDK: lib.agents.warm) and says so (``("ready",)``), then plays each
episode it is sent, ``(name, row, base_url)``, in a thread of its own (an agent waits for the endpoint most of its
time): the thread says ``("began", name, when)`` first (the episode's time limit counts from then) and ``("ended",
name, kind, value, when)`` last: kind "" and what the agent returned, or the failure's kind and why. The agents'
own Python (their SDK's requests and replies) runs here, off the rank's interpreter, which serves the endpoint and
drives the engine. Ignores the stop signals, as the reward workers do (stopping is the trainer's: it closes the
pool); exits when the rank closes its end or is gone.
"""

from __future__ import annotations

import os
import pickle
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection

from lib.agents import load_agent, play, warm


def main(argv: list[str]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    inbox, outbox = Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False)
    fn = load_agent(argv[2])
    warm()  # the SDK's first use, before the episodes' clocks start
    lock = threading.Lock()
    outbox.send(("ready",))  # the agent loaded

    def say(*message: object) -> None:
        with lock:
            try:
                outbox.send(message)
            except OSError:  # the rank is gone
                pass

    def run(name: str, row: dict, url: str) -> None:
        say("began", name, time.monotonic())  # the machine's one monotonic clock: the rank's too
        kind, out = play(fn, row, url)
        try:
            pickle.loads(pickle.dumps(out))  # what the rank could not read back would cost the rollout, not this
        except Exception as e:  # noqa: BLE001 - the user's return value: whatever pickling raised
            kind, out = "invalid", (f"the agent returned a {type(out).__name__}, which cannot be sent back from its "
                                    f"worker process ({type(e).__name__}: {e}); return a number or a dict")
        say("ended", name, kind, out, time.monotonic())

    while True:
        try:
            task = inbox.recv()
        except (EOFError, OSError):
            os._exit(0)  # the agents still running end with the process (their episodes are over)
        threading.Thread(target=run, args=task, daemon=True, name=f"agent-{task[0]}").start()


if __name__ == "__main__":
    main(sys.argv[1:])
