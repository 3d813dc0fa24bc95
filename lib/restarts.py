"""Restarts after a failure, as torchrun makes them (launch.sh passes ``--max-restarts trainer.max_restarts``): the
ranks of a failed attempt are stopped and started again, and every start after the first resumes from the newest
whole checkpoint, as a resubmission does.

What a restart knows of the attempt before it comes from the run folder: the last step that attempt logged
(metrics.jsonl, read before the logger cuts it back to the checkpoint) and the causes its ranks left (``faults/``: an
uncaught error's type, message and stage, written by the rank's excepthook; a hang's report, written by the watchdog).
A rank killed outright (SIGKILL: the OOM killer, a lost node) leaves none, and the record says so. Each restart is one
line of ``faults.jsonl``: the attempt, the cause, the step the failed attempt had logged last, the checkpoint resumed
from and the steps redone. A failure after the same step as the attempt before it is not restarted again: the job
ends with one message (exit 1, a failure), since the same command would meet it once more.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch.distributed as dist

from lib import exits

RESTART_ENV, MAX_ENV, RUN_ID_ENV = "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID"
LOST_PEER = ("by peer", "Broken pipe", "remote worker", "remote process")
"""Words of the errors a rank meets when another rank is gone (gloo's, NCCL's): a consequence, not a cause."""
_folder: list[str] = []  # where this rank's cause goes, once the run folder is known


def attempt() -> int:
    """0 for the launch's first start of the ranks, n for its n-th restart."""
    return int(os.environ.get(RESTART_ENV, "0") or 0)


def watch(run_path: str, rank: int, trainer: Any) -> None:
    """From here on an uncaught error of this rank is kept for the restart (``keep``); a first attempt clears the
    causes an earlier launch left, a restart turns ``trainer.resume`` on (it continues the run it failed in)."""
    trainer.resume = trainer.resume or attempt() > 0
    folder = os.path.join(run_path, "faults")
    _folder[:] = [folder, str(rank)]
    if attempt() == 0:
        try:
            os.remove(os.path.join(folder, f"rank{rank}.txt"))
        except OSError:
            pass


def keep(cause: str) -> None:
    """Keep this rank's cause of failure where the restart reads it (a no-op before ``watch``)."""
    if not _folder:
        return
    folder, rank = _folder
    try:
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"rank{rank}.txt"), "w") as f:
            json.dump({"rank": int(rank), "time": time.time(), "cause": cause[:2000]}, f)
    except OSError:
        pass  # a run folder that refuses the write: the log's traceback still names it


def last_logged(run_path: str) -> int:
    """The last step metrics.jsonl holds (-1: none), a line cut short by a kill aside."""
    last = -1
    try:
        with open(os.path.join(run_path, "metrics.jsonl")) as f:
            for line in f:
                try:
                    last = max(last, int(json.loads(line)["step"]))
                except (ValueError, KeyError, TypeError):
                    continue
    except OSError:
        pass
    return last


def records(run_path: str) -> list[dict]:
    """The restarts recorded in the run folder, oldest first."""
    try:
        with open(os.path.join(run_path, "faults.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip().endswith("}")]
    except OSError:
        return []


def causes(run_path: str) -> str:
    """What the failed attempt's ranks left, first written first; cleared as read."""
    folder, found = os.path.join(run_path, "faults"), []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        path = os.path.join(folder, name)
        try:
            with open(path) as f:
                found.append(json.load(f))
            os.remove(path)
        except (OSError, ValueError):
            continue
    found.sort(key=lambda c: c["time"])
    own = [c for c in found if not any(w in c["cause"] for w in LOST_PEER)]
    if not own:
        seen = f" (the others then lost it: rank {found[0]['rank']}: {found[0]['cause'][:200]})" if found else ""
        return ("no rank left an error of its own: a rank was killed outright (SIGKILL: the OOM killer, a kill -9) or "
                f"its node was lost; torchrun's log names the rank and its exit code{seen}")
    first = f"rank {own[0]['rank']}: {own[0]['cause']}"
    return first + (f" (and {len(found) - 1} more on other ranks)" if len(found) > 1 else "")


def on_restart(run_path: str, resumed_from: int | None, max_restarts: int) -> tuple[dict, str | None]:
    """Rank 0, at a restart's start (attempt() > 0), before the logger cuts metrics.jsonl: the restart's record,
    appended to faults.jsonl, and the message that stops the job instead (None: go on) when the failed attempt got no
    further than the attempt before it."""
    n, failed_after = attempt(), last_logged(run_path)
    start = resumed_from or 0
    record = {"restart": n, "of": int(os.environ.get(MAX_ENV, max_restarts)), "run_id": os.environ.get(RUN_ID_ENV, ""), "time": time.time(),
              "cause": causes(run_path), "failed_after_step": failed_after, "resumed_from": start,
              "steps_redone": max(failed_after - start, 0)}
    before = [r for r in records(run_path) if r.get("run_id") == record["run_id"] and r.get("restart") == n - 1]
    stop = None
    if before and before[-1]["failed_after_step"] == failed_after:
        record["stopped"] = True
        where = f"after step {failed_after}" if failed_after >= 0 else "before its first step"
        stop = (f"error: the run failed twice in a row {where} ({record['cause']}): not restarted again, the same "
                f"failure would repeat. Fix its cause, then run the same command: it resumes from "
                + (f"step {start}" if resumed_from else "the start") + " (run folder's faults.jsonl: the restarts)")
    with open(os.path.join(run_path, "faults.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")
    return record, stop


def at_start(run_path: str, is_main: bool, resumed_from: int | None, max_restarts: int) -> tuple[str, int]:
    """Every rank, once the step to resume from is known and before anything is logged: after a restart, rank 0
    records it; a failure that repeats stops every rank here (exit 3). Returns the log's line for the restart ("" on
    a first attempt) and the restarts the run folder has recorded."""
    out: list = ["", None, 0]
    if is_main:
        if attempt():
            record, out[1] = on_restart(run_path, resumed_from, max_restarts)
            out[0] = describe(record)
        out[2] = len(records(run_path))
    dist.broadcast_object_list(out, src=0)
    line, stop, count = out
    if stop:
        if is_main:
            print(stop, file=sys.stderr, flush=True)
        dist.destroy_process_group()
        exits.leave(exits.FAILED)
    return line, count


def describe(record: dict) -> str:
    """The log's line for a restart."""
    return (f"restart {record['restart']} of {record['of']} (trainer.max_restarts): the ranks failed after step "
            f"{record['failed_after_step']}: {record['cause']}; resuming from step {record['resumed_from']}, "
            f"{record['steps_redone']} step(s) redone")
