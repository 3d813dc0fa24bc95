"""An agent worker process (``agent.workers``): ``python -m lib.agents.worker READ_FD WRITE_FD ENTRY``.

Loads ``agent.entry`` once, then plays each episode it is sent, ``(name, row, base_url)``, in a thread of its own (an
agent waits for the endpoint most of its time) and sends ``(name, kind, value)`` as each ends: kind "" and what the
agent returned, or the failure's kind and why. The agents' own Python (their SDK's requests and replies) runs here,
off the rank's interpreter, which serves the endpoint and drives the engine. Ignores the stop signals, as the reward
workers do (stopping is the trainer's: it closes the pool); exits when the rank closes its end or is gone.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from multiprocessing.connection import Connection

from lib.agents import load_agent, play


def main(argv: list[str]) -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    inbox, outbox = Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False)
    fn = load_agent(argv[2])
    lock = threading.Lock()

    def run(name: str, row: dict, url: str) -> None:
        kind, out = play(fn, row, url)
        with lock:
            try:
                outbox.send((name, kind, out))
            except OSError:  # the rank is gone
                pass
            except Exception as e:  # noqa: BLE001 - a return value that cannot be pickled
                outbox.send((name, "invalid", f"the agent returned a {type(out).__name__}, which cannot be sent back "
                                              f"from its worker process ({type(e).__name__}: {e}); return a number "
                                              f"or a dict"))

    while True:
        try:
            task = inbox.recv()
        except (EOFError, OSError):
            os._exit(0)  # the agents still running end with the process (their episodes are over)
        threading.Thread(target=run, args=task, daemon=True, name=f"agent-{task[0]}").start()


if __name__ == "__main__":
    main(sys.argv[1:])
