"""Run output on rank 0 (the run log: named apart from the standard library's logging): console progress,
metrics.jsonl, wandb, the resolved config, sample responses.

Per-stage wall time and peak memory come from ``stage(name, metrics)``, used around each RL stage.

wandb and the no-step-twice guarantee. A resumed run replays, bit for bit, the steps a killed run made past its last
checkpoint; wandb must hold each step once. An online run asks wandb itself: ``run.starting_step`` after
``wandb.init(id=..., resume="allow")`` is the server's next step, and rows of metrics.jsonl up to the checkpoint that
the server lacks are sent again. (wandb's rewind, ``resume_from=f"{id}?_step={step}"``, would discard and resend the
replayed steps; it needs the server, and the replay is identical, so skipping them is the same record.) An offline
run has no server to ask, and wandb offers no public reader of its offline files (``wandb.Api`` reads synced runs
only), so the steps it holds are read from its transaction log here: LevelDB's log format (documented and stable)
around wandb's ``Record`` protobuf, of which only the ``_step`` of history records is read. The simpler designs lose
the guarantee: counting what was handed to ``wandb.log`` misses what a killed wandb process never wrote (those steps
would be lost), and a fresh offline run per launch puts the replayed steps in twice once synced. tests/test_wandb.py
runs against the installed wandb, so a change of its format fails there, not in a user's run.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import resource
import secrets
import struct
import sys
import time
from typing import Any, Iterator

import torch
import yaml

from lib import inject, restarts, watchdog
from lib.samples import store as samples_store


STAGES: list[str] = []
"""The stages this rank is in now, outermost first: an error (a collective's timeout included) names them."""
FAILED_IN: list[str] = []


_OPEN: list[dict[str, float]] = []
"""The GPU peak seen so far by each open stage, outermost first (a nested stage resets the allocator's peak)."""


@contextlib.contextmanager
def stage(name: str, metrics: dict[str, float]) -> Iterator[None]:
    """Add the block's wall time to ``timing/<name>_s`` and raise ``memory/<name>_peak_gb`` to its peak (GPU
    allocator peak, or process RSS peak): a stage entered several times in a step (dynamic sampling's rounds)
    reports its total time. Stages nest: an inner stage resets the allocator's peak counter, and the peak reached
    before it is kept for every stage around it, so an outer stage's peak covers its inner stages."""
    cuda = torch.cuda.is_available()
    if cuda:
        _fold_peak()
        torch.cuda.reset_peak_memory_stats()
    mine = {"peak": 0.0}
    _OPEN.append(mine)
    t0 = time.perf_counter()
    STAGES.append(name)
    watchdog.beat()
    try:
        inject.at("/".join(STAGES))
        yield
    except BaseException:
        FAILED_IN[:] = FAILED_IN or ["/".join(STAGES)]  # the innermost stage the error left
        raise
    finally:
        STAGES.pop()
        watchdog.beat()
        if cuda:
            torch.cuda.synchronize()
            _fold_peak()
        # by identity: an inner stage's dict often equals its outer stage's ({"peak": p} after a fold), and
        # list.remove takes the first equal one (the GPU's step 1 crashed on it, 2026-11-26)
        del _OPEN[next(i for i, s in enumerate(_OPEN) if s is mine)]
    if cuda:
        peak = mine["peak"] / 2**30
    else:
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    key = f"memory/{name}_peak_gb"
    metrics[key] = max(metrics.get(key, 0.0), peak)
    key = f"timing/{name}_s"
    metrics[key] = metrics.get(key, 0.0) + time.perf_counter() - t0


def _fold_peak() -> None:
    """Every open stage keeps the allocator's peak since the last reset."""
    peak = float(torch.cuda.max_memory_allocated())
    for s in _OPEN:
        s["peak"] = max(s["peak"], peak)


def start_wandb(path: str, project: str, config: dict) -> tuple[Any, int]:
    """A wandb run for the run folder: offline unless WANDB_API_KEY or WANDB_MODE is set; its id is kept in the run
    folder, so a resumed run continues the same wandb run. Returns (run, the last step wandb already holds: in the
    folder's offline files, or the server's for an online run). A killed run's steps past its checkpoint come again,
    equal to the bit: those wandb holds are not sent twice, and rows it lost are sent again from metrics.jsonl."""
    import wandb  # deferred: a heavy optional package, imported only when the wandb logger is asked for

    if not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
        os.environ["WANDB_MODE"] = "offline"  # no key: keep the run on disk (wandb sync later)
    id_path = os.path.join(path, "wandb_id")
    if not os.path.isfile(id_path):
        with open(id_path, "w") as f:
            f.write("".join(secrets.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(8)))
    with open(id_path) as f:
        run_id = f.read().strip()
    done = max(offline_wandb_steps(path, run_id), default=-1)
    run = wandb.init(project=project, name=os.path.basename(path), dir=path, config=config, id=run_id,
                     resume="allow")
    return run, max(done, int(getattr(run, "starting_step", 0) or 0) - 1)


def start_trackio(path: str, project: str, config: dict) -> tuple[Any, int]:
    """A trackio run for the run folder: local, its store in the run folder (``trackio/``, unless TRACKIO_DIR is
    set), on a Hugging Face Space only with TRACKIO_SPACE_ID; named by the run folder, so a resumed run continues
    it. Returns (the trackio module, the last step its store holds): a killed run's steps past its checkpoint are
    not logged twice, and the rows it lacks are sent again from metrics.jsonl, as with wandb."""
    os.environ.setdefault("TRACKIO_DIR", os.path.join(path, "trackio"))  # read when trackio is imported
    import trackio  # deferred: an optional package, imported only when the trackio logger is asked for
    from trackio.sqlite_storage import SQLiteStorage

    name = os.path.basename(path)
    done = max((int(r["step"]) for r in SQLiteStorage.get_logs(project, name) if "step" in r), default=-1)
    run = trackio.init(project=project, name=name, config=config, resume="allow", space_id=os.environ.get(
        "TRACKIO_SPACE_ID") or None, auto_log_cpu=False, auto_log_gpu=False)
    # a Space's run keeps its logs there, not in the local store: its next step is the one it reports (0.43)
    return trackio, max(done, int(getattr(run, "_next_step", 0) or 0) - 1)


def offline_wandb_steps(path: str, run_id: str) -> list[int]:
    """The steps of every history record in the run folder's offline wandb files of ``run_id``."""
    from wandb.proto import wandb_internal_pb2  # deferred with wandb itself (above)

    steps = []
    for name in glob.glob(os.path.join(path, "wandb", f"offline-run-*-{run_id}", f"run-{run_id}.wandb")):
        for payload in wandb_log_records(name):
            record = wandb_internal_pb2.Record()
            try:
                record.ParseFromString(payload)
            except Exception:  # noqa: BLE001 - a record torn by a kill
                continue
            if record.WhichOneof("record_type") == "history":
                steps += [int(json.loads(i.value_json)) for i in record.history.item
                          if (i.key or "/".join(i.nested_key)) == "_step"]
    return steps


def wandb_log_records(path: str) -> Iterator[bytes]:
    """The records of a wandb transaction log (``run-<id>.wandb``): LevelDB's log format after a 7-byte file
    header (":W&B", version), 32 KiB blocks of records, each a 7-byte header (crc32, length, type: 1 whole,
    2 first, 3 middle, 4 last piece) and its payload. A file cut short by a kill ends at its last whole record."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:4] != b":W&B":
        return
    block, pos, parts = 32768, 7, b""
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a header is padding
            pos += room
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding (preallocated space)
            pos += room
            continue
        payload = data[pos + 7:pos + 7 + length]
        if len(payload) < length:
            return
        pos += 7 + length
        if kind == 1:
            yield payload
        elif kind == 2:
            parts = payload
        elif kind == 3:
            parts += payload
        elif kind == 4:
            yield parts + payload


class TrackerFailed(Exception):
    """A tracker of trainer.logger (wandb, trackio) that could not start: its name, and the fix to name."""

    FIXES = {"wandb": "set WANDB_MODE=offline (the run stays on disk; wandb sync later), check WANDB_API_KEY",
             "trackio": "check TRACKIO_DIR (the run folder's trackio/ by default) and TRACKIO_SPACE_ID"}

    def __init__(self, name: str, error: Exception):
        super().__init__(f"trainer.logger: {name} could not start ({type(error).__name__}: {str(error)[:300]}); "
                         f"{self.FIXES[name]}, or drop {name} from --trainer.logger")


TRACKERS = {"wandb": start_wandb, "trackio": start_trackio}
"""The trackers trainer.logger may name, each started by its function: (what logs, the last step it holds)."""


class RunLogger:
    """``start_step``: the step the run starts from (a resumed checkpoint's, or 0). Rows of metrics.jsonl after it
    (a killed run's steps past its last checkpoint, or everything on a fresh start) are dropped first, so no
    step is ever logged twice; a wandb or trackio run resumes by the run folder (its id, its name)."""

    def __init__(self, path: str, config: dict, total_steps: int, loggers: list[str], project: str,
                 is_main: bool, start_step: int = 0):
        self.path, self.total, self.is_main = path, total_steps, is_main
        self.loggers = set(loggers)
        self.start_time, self.start_step = time.time(), start_step
        self.trackers: dict[str, tuple[Any, int]] = {}
        """The trackers started: name -> (what logs: a wandb run, the trackio module; the last step it holds)."""
        if not is_main:
            return
        os.makedirs(path, exist_ok=True)
        for name, start in TRACKERS.items():  # first: a tracker that cannot start leaves the run folder as it was
            if name in self.loggers:
                try:
                    self.trackers[name] = start(path, project, config)
                except Exception as e:  # noqa: BLE001 - its own errors: the run cannot report, so it does not start
                    raise TrackerFailed(name, e) from e
        with open(os.path.join(path, "config.yaml"), "w") as f:
            yaml.safe_dump(config, f, sort_keys=False)
        metrics_path = os.path.join(path, "metrics.jsonl")
        keep_rows_through(metrics_path, start_step if start_step else -1)
        samples_store.keep_steps_through(path, start_step if start_step else -1)  # the same for the samples kept
        if os.path.isfile(metrics_path):
            # rows up to the checkpoint that a tracker does not hold (a killed run's wandb process had not written
            # them yet) go to it now, from metrics.jsonl; then each holds every step once
            with open(metrics_path) as f:
                for row in map(json.loads, f):
                    self._track(row["step"], {k: v for k, v in row.items() if k != "step"})
        self.jsonl = open(metrics_path, "a") if "jsonl" in self.loggers else None

    def _track(self, step: int, metrics: dict) -> None:
        """To each tracker that does not hold the step yet (a killed run's tracker may hold steps it redoes)."""
        for tracker, done in self.trackers.values():
            if step > done:
                tracker.log(metrics, step=step)

    def print(self, *args: Any) -> None:
        if self.is_main and "console" in self.loggers:
            print(*args, flush=True)

    def log(self, step: int, metrics: dict[str, float], samples: list[tuple[str, str, float]] = ()) -> None:
        if not self.is_main:
            return
        if self.jsonl is not None:
            self.jsonl.write(json.dumps({"step": step, **metrics}) + "\n")
            self.jsonl.flush()
        self._track(step, metrics)
        if "console" in self.loggers:
            done = step - self.start_step
            eta = (time.time() - self.start_time) / max(done, 1) * (self.total - step)
            width = 24
            filled = int(width * step / max(self.total, 1))
            bar = "#" * filled + "." * (width - filled)
            keys = [k for k in ("reward/mean", "val/mean@1", "val/score_mean", "actor/pg_loss", "actor/entropy",
                                "response/length_mean", "perf/tokens_per_s") if k in metrics]
            shown = "  ".join(f"{k.split('/')[-1]} {metrics[k]:.3g}" for k in keys)
            print(f"[{bar}] step {step}/{self.total}  eta {eta:5.0f}s  {shown}", flush=True)
            for prompt, response, score in samples:  # a NaN score: a sample the judge could not score (masked)
                verdict = "masked (no verdict)" if score != score else f"score {score:.2f}"
                print(f"    {prompt!r} -> {response!r}  {verdict}", flush=True)

    def table(self, step: int, name: str, rows: list[dict]) -> None:
        """A table of the step (the samples kept: lib/samples) for trackio, whose dashboard shows tables."""
        trackio, done = self.trackers.get("trackio", (None, step))
        if step > done and rows:
            columns = list(rows[0])
            trackio.log({name: trackio.Table(columns=columns, data=[[r[c] for c in columns] for r in rows])}, step=step)

    def close(self) -> None:
        if self.is_main and self.jsonl is not None:
            self.jsonl.close()
        for tracker, _ in self.trackers.values():
            tracker.finish()



def keep_rows_through(path: str, step: int) -> None:
    """Drop the rows of a metrics.jsonl after ``step`` (and a torn last line), atomically."""
    if not os.path.isfile(path):
        return
    kept = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:  # a line cut short by a kill
                continue
            if row.get("step", 0) <= step:
                kept.append(json.dumps(row) + "\n")
    with open(path + ".tmp", "w") as f:
        f.writelines(kept)
    os.replace(path + ".tmp", path)


def excepthook_rank(rank: int) -> None:
    """Prefix uncaught errors with the rank and the stage it was in, so a multi-rank traceback (a collective that
    timed out on one rank because another never reached it) says where each rank was."""
    previous = sys.excepthook

    def hook(kind, value, tb):
        stages = FAILED_IN[0] if FAILED_IN else "/".join(STAGES)
        where = f" in stage {stages}" if stages else ""
        restarts.keep(f"{kind.__name__}: {value}{where}")
        sys.stderr.write(f"[rank {rank}{where}] ")
        previous(kind, value, tb)

    sys.excepthook = hook
