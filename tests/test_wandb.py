"""The wandb logger end to end, offline: metrics and config reach the run files (read back), a run killed and
resumed continues the same wandb run and sends no step twice; a logger that cannot start is refused up front. The
trackio logger the same way, its local store read back."""

import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from lib.runlog import wandb_log_records
from tests.test_resume import ROOT, children, command, env, forked, pause_at, wait_for_pause

ARGS = ("--trainer.total_steps", "5", "--trainer.save_every", "2", "--trainer.val_every", "0",
        "--trainer.logger", "console", "jsonl", "wandb", "--trainer.train_batch_size", "16",
        "--actor.mini_batch_size", "128")


def finished(path):
    """Whether wandb has written a session's exit record (its service may write after ``finish()`` returns)."""
    from wandb.proto import wandb_internal_pb2

    for payload in wandb_log_records(path):
        r = wandb_internal_pb2.Record()
        r.ParseFromString(payload)
        if r.WhichOneof("record_type") == "exit":
            return True
    return False


def sessions(run, closed=False, limit=120):
    """(run id, config, {step: metrics}) per wandb session file in the run folder, oldest first. ``closed``: every
    session was closed by ``finish()``; wait until wandb has written each one's exit record (a state, not a time)."""
    from wandb.proto import wandb_internal_pb2

    paths = sorted(glob.glob(os.path.join(run, "wandb", "offline-run-*", "run-*.wandb")))
    t0 = time.monotonic()
    while closed and not all(map(finished, paths)):
        assert time.monotonic() - t0 < limit, f"wandb never finished writing {paths}"
        time.sleep(0.1)
    out = []
    for path in paths:
        run_id, config, history = None, {}, {}
        for payload in wandb_log_records(path):
            r = wandb_internal_pb2.Record()
            r.ParseFromString(payload)
            kind = r.WhichOneof("record_type")
            if kind == "run":
                run_id = r.run.run_id
                config = {i.key: json.loads(i.value_json) for i in r.run.config.update}
            elif kind == "history":
                row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
                if "_step" in row:
                    assert row["_step"] not in history, row  # a step twice in one session
                    history[row["_step"]] = row
        out.append((run_id, config, history))
    return out


@pytest.mark.slow
def test_wandb_offline_run_resumes_without_a_step_twice(tmp_path):
    """The logger crashed every run at start with wandb 0.31 (wandb.util.generate_id is gone)."""
    e = {**env(), "WANDB_MODE": "offline"}
    run = tmp_path / "run"
    marker = tmp_path / "paused"
    proc = subprocess.Popen(command(tmp_path, *ARGS), cwd=ROOT, env={**e, **pause_at(3, marker)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_pause(marker, proc)  # at the end of step 3, whatever the load: it raced the run's end before
    for pid in children(proc.pid):  # kill -9 every rank: checkpoint 2 is the latest
        os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=300)
    again = subprocess.run(forked(tmp_path, *ARGS), cwd=ROOT, env=e, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resumed from step 2" in again.stdout
    got = sessions(str(run))
    assert len(got) == 2 and {s[0] for s in got} - {None} == {_run_id(run)}  # one wandb run, continued
    config = got[1][1]
    assert config["trainer"]["total_steps"] == 5 and config["actor"]["optim"]["lr"] > 0
    first, second = got[0][2], got[1][2]
    # every step once, whatever the killed run's wandb process had written (on CPU here: nothing; it buffers)
    assert not set(first) & set(second) and sorted({**first, **second}) == [1, 2, 3, 4, 5], (first, second)
    rows = {json.loads(line)["step"]: json.loads(line) for line in open(run / "metrics.jsonl")}
    for step, metrics in {**first, **second}.items():  # the same numbers as metrics.jsonl
        assert metrics["reward/mean"] == rows[step]["reward/mean"] and metrics["actor/lr"] == rows[step]["actor/lr"]


def _run_id(run):
    path = run / "wandb_id"
    return path.read_text().strip() if path.exists() else "none"


def test_a_wandb_logger_that_cannot_start_is_refused_up_front(tmp_path):
    out = subprocess.run(["bash", "launch.sh", "--trainer.output_root", str(tmp_path), "--trainer.logger", "console",
                          "wandb"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NPROC": "2", "WANDB_MODE": "bogus"})
    assert out.returncode == 2 and out.stderr.count("WANDB_MODE='bogus': use online, offline or disabled") == 1, \
        out.stderr[-2000:]
    assert not os.path.exists(tmp_path / "toy_assets" / ".." / "wandb")


def test_steps_wandb_already_holds_are_not_sent_again(tmp_path, monkeypatch):
    """A run stopped after wandb wrote steps 1-3 and resumed from checkpoint 2: step 3 comes again (equal to the bit)
    and must not reach wandb twice; a step wandb lost is sent again from metrics.jsonl."""
    from lib.runlog import RunLogger

    monkeypatch.setenv("WANDB_MODE", "offline")
    run = str(tmp_path / "run")
    log = RunLogger(run, {"a": 1}, 5, ["jsonl", "wandb"], "p", True)
    for step in (1, 2, 3):
        log.log(step, {"x": float(step)})
    log.close()
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:  # a row wandb never got (its process was killed)
        f.write(json.dumps({"step": 4, "x": 4.0}) + "\n")
    time.sleep(1.1)  # a session's folder is named by the second it started in
    log = RunLogger(run, {"a": 1}, 5, ["jsonl", "wandb"], "p", True, start_step=4)
    for step in (5,):
        log.log(step, {"x": float(step)})
    log.close()
    first, second = (h for _, _, h in sessions(run, closed=True))
    assert sorted(first) == [1, 2, 3] and sorted(second) == [4, 5] and second[4]["x"] == 4.0
    time.sleep(1.1)
    log = RunLogger(run, {"a": 1}, 5, ["jsonl", "wandb"], "p", True, start_step=3)  # resumed from checkpoint 3
    log.log(4, {"x": 4.0})
    log.log(5, {"x": 5.0})
    log.close()
    assert sorted(sessions(run, closed=True)[2][2]) == []  # wandb holds 1-5 already


TRACKIO = os.path.join(ROOT, ".venv", "trackio_pkgs")
"""trackio 0.43, installed apart by test.sh (its pillow pin would replace .venv's)."""


def test_trackio_run_resumes_without_a_step_twice_and_holds_the_samples_table(tmp_path):
    """--trainer.logger trackio: its store, in the run folder, holds every step's metrics once (the run killed with
    kill -9 after step 3 and resumed from checkpoint 2), the numbers of metrics.jsonl, and each step's samples kept
    as a table (lib/samples)."""
    if not os.path.isdir(os.path.join(TRACKIO, "trackio")):
        pytest.skip(f"trackio is not installed in {TRACKIO} (test.sh installs it there)")
    e = {**env(), "PYTHONPATH": os.pathsep.join(filter(None, [TRACKIO, os.environ.get("PYTHONPATH")]))}
    args = [a if a != "wandb" else "trackio" for a in ARGS] + ["--samples.share", "0.5"]
    run = tmp_path / "run"
    marker = tmp_path / "paused"
    proc = subprocess.Popen(command(tmp_path, *args), cwd=ROOT, env={**e, **pause_at(3, marker)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_pause(marker, proc)
    for pid in children(proc.pid):
        os.kill(pid, signal.SIGKILL)
    proc.communicate(timeout=300)
    again = subprocess.run(forked(tmp_path, *args), cwd=ROOT, env=e, capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]
    assert "resumed from step 2" in again.stdout
    read = subprocess.run([sys.executable, "-c", "import json, sys; from trackio.sqlite_storage import SQLiteStorage; "
                           "print(json.dumps(SQLiteStorage.get_logs('spmd-rl', 'run')))"], env={
                               **e, "TRACKIO_DIR": str(run / "trackio")}, capture_output=True, text=True, timeout=300)
    assert read.returncode == 0, read.stderr[-3000:]
    logs = json.loads(read.stdout.strip().splitlines()[-1])
    steps = [r["step"] for r in logs if "reward/mean" in r]
    assert steps == [1, 2, 3, 4, 5], steps  # once each, in order
    rows = {json.loads(line)["step"]: json.loads(line) for line in open(run / "metrics.jsonl")}
    for r in logs:
        if "reward/mean" in r:
            assert r["reward/mean"] == rows[r["step"]]["reward/mean"] and r["actor/lr"] == rows[r["step"]]["actor/lr"]
    tables = {r["step"]: r["samples"]["_value"] for r in logs if "samples" in r}
    assert sorted(tables) == [1, 2, 3, 4, 5], sorted(tables)
    from lib.samples import store

    for step, path in store.steps(str(run)).items():  # the table is the file's samples
        assert [(t["uid"], t["reward"]) for t in tables[step]] == [(r["uid"], r["reward"]) for r in
                                                                   store.read_step(path)]
