"""A reward worker process: ``python -m lib.rewards.worker READ_FD WRITE_FD CUSTOM_SPEC [MODE]``. With MODE
``tools`` it runs tool calls instead (CUSTOM_SPEC names the tools; lib/multi_turn/tools.py).

Receives chunks of samples ``[(index, data_source, text, ground_truth, extra_info, columns), ...]`` and sends one result
per sample, ``(index, score, extras, answer, kind, message)``, as soon as it is scored, so the pool can tell
which sample a worker is on when it runs past the time limit. Before its first chunk it sends ``None``, once: it
has started and loaded the scorer (or the tools), so the pool starts the time limit of its samples from then, not
from its spawn (Python's start-up and a slow import are no sample's time). A rule that loads what a row needs (a
library, a dataset: lib.rewards.PREPARE) sends ``LOADING`` first and ``None`` once loaded: the clock stops between. Exits, quietly, when the pool closes its
end or is gone.
"""

from __future__ import annotations

import signal
import sys
from multiprocessing.connection import Connection

from lib.multi_turn.tools import ToolHost
from lib.rewards import LOADING, keyword_columns, load_custom, needs_load, prepare, result_of, rule_for


def score_one(custom, data_source, text, ground_truth, extra_info, columns=None):
    """``columns``: the row's other columns; a custom function gets those it takes as keyword arguments."""
    try:
        if custom is not None:
            columns = columns or {}
            more = {k: columns[k] for k in keyword_columns(custom, columns)}
            out = custom(data_source=data_source, solution_str=text, ground_truth=ground_truth,
                         extra_info=extra_info, **more)
        else:
            out = rule_for(data_source)(text, ground_truth, extra_info)
    except SystemExit as e:
        return 0.0, {}, None, "exits", f"the scorer called sys.exit({e.code!r})"
    except BaseException as e:  # noqa: BLE001 - the scorer's failure costs its sample only
        return 0.0, {}, None, "errors", f"the scorer raised {type(e).__name__}: {e}"
    return result_of(out)


def main(argv: list[str]) -> None:
    # a stop signal is the trainer's to handle (it closes the pool): schedulers send it to every process of a job
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)
    inbox, outbox = Connection(int(argv[0]), writable=False), Connection(int(argv[1]), readable=False)
    mode = argv[3] if len(argv) > 3 else "score"
    custom = None
    if mode == "tools":
        handle = ToolHost(argv[2])
    else:
        custom = load_custom(argv[2]) if len(argv) > 2 and argv[2] else None
        handle = lambda *sample: score_one(custom, *sample)  # noqa: E731
    try:
        outbox.send(None)  # ready
        while True:
            try:
                chunk = inbox.recv()
            except (EOFError, OSError):
                return
            for index, *sample in chunk:
                if custom is None and mode == "score" and needs_load(sample[0], sample[3]):
                    outbox.send(LOADING)  # the clock stops: the rule's load (a library, a dataset) is no sample's time
                    prepare(sample[0], sample[3])
                    outbox.send(None)  # ready again
                outbox.send((index, *handle(*sample)))
    except (BrokenPipeError, ConnectionResetError):
        # the pool's end is gone: its rank left (a refusal or stop before the pool was closed, or a crash, whose
        # own traceback is the one to read)
        return


if __name__ == "__main__":
    main(sys.argv[1:])
