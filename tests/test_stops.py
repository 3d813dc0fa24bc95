"""Stops that reach other processes than the ranks, through the real entry point (launch.sh): SIGTERM to torchrun
alone (kill, docker stop), and SIGUSR1 or SIGTERM to every process of the run at once (SLURM's pre-emption warning,
scancel). Each ends with a checkpoint (the warning with exit 0), and the same command resumes to the numbers of a
run never interrupted."""

import json
import os
import signal
import subprocess
import time

import pytest

from tests.helpers import forked_torchrun
from tests.test_resume import ROOT, TIMING, children, pause_at, wait_for_pause

ARGS = ("--trainer.total_steps", "4", "--trainer.train_batch_size", "16", "--actor.mini_batch_size", "64",
        "--trainer.save_every", "0", "--trainer.val_every", "0")


def launch(tmp_path, name):
    return ["bash", "launch.sh", "train_grpo.py", "--trainer.output_root", str(tmp_path), "--trainer.run_name", name,
            *ARGS]


def env():
    return {**os.environ, "NPROC": "2", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}


def rows(path):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(TIMING)} for line in open(path)]


def descendants(pid):
    found = []
    for child in children(pid):
        found += [child] + descendants(child)
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    root = tmp_path_factory.mktemp("whole")
    # the run never interrupted, on forked ranks (tests/forked_torchrun.py): its launch is not what the file tests
    whole = forked_torchrun(2, os.path.join(ROOT, "train_grpo.py"), "--trainer.output_root", str(root),
                            "--trainer.run_name", "whole", *ARGS)
    out = subprocess.run(whole, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    return rows(root / "whole" / "metrics.jsonl")


def cmdline(pid):
    try:
        return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError:
        return ""


@pytest.mark.slow
@pytest.mark.parametrize("target,sig", [("torchrun", signal.SIGTERM), ("all", signal.SIGUSR1), ("all", signal.SIGTERM)],
                         ids=["TERM-to-torchrun", "USR1-to-all", "TERM-to-all"])
def test_a_stop_reaching_any_process_ends_in_a_checkpoint(tmp_path, reference, target, sig):
    marker = tmp_path / "paused"
    proc = subprocess.Popen(launch(tmp_path, "run"), cwd=ROOT, env={**env(), **pause_at(2, marker)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_pause(marker, proc)  # the run waits at the end of step 2 for the signal: it can never come too late
    everyone = [proc.pid] + descendants(proc.pid)
    torchrun = [p for p in everyone if "torchrun" in cmdline(p) and "train_grpo.py" in cmdline(p)
                and not any(p in children(q) for q in everyone if "torchrun" in cmdline(q) and q != p)]
    workers = [p for p in everyone if "lib.rewards.worker" in cmdline(p)]
    assert len(torchrun) == 1 and workers, [cmdline(p) for p in everyone]
    for pid in (torchrun if target == "torchrun" else everyone):
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    out, err = proc.communicate(timeout=600)
    text = out + err
    assert f"stopped by {sig.name} after step" in text, text[-4000:]
    if sig == signal.SIGUSR1:  # a pre-emption warning: the job must not end FAILED
        assert proc.returncode == 0, text[-4000:]
    step = int(open(tmp_path / "run" / "checkpoints" / "latest").read())
    assert step == 2 and "BrokenPipeError" not in text
    again = subprocess.run(launch(tmp_path, "run"), cwd=ROOT, env=env(), capture_output=True, text=True, timeout=900)
    assert again.returncode == 0, again.stderr[-4000:]
    assert f"resumed from step {step}" in again.stdout
    assert rows(tmp_path / "run" / "metrics.jsonl") == reference


def wait_for_files(paths, proc, limit=600):
    """Until every path exists (the processes named by lib.stops.HOLD are held); fail at once if the run ended."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if all(os.path.isfile(p) for p in paths):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise TimeoutError(paths)


def wait_for_request(path, proc, limit=60):
    """Until launch.sh has kept a stop signal in ``path`` (lib.stops.REQUEST_ENV): it never did before issue 78."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if os.path.isfile(path) and open(path).read().strip():
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.1)
    raise AssertionError(f"launch.sh kept no stop signal in {path} within {limit} s: a warning it got while the ranks "
                         f"started would be lost (they ignore SIGUSR1 until their handlers are in)")


@pytest.mark.slow
@pytest.mark.parametrize("where", ["check", "start"])
def test_a_warning_before_the_ranks_can_take_it_is_kept(tmp_path, where):
    """SLURM sends its pre-emption warning once, when its clock says; on a loaded machine it can come while launch.sh
    checks the input (``check``) or while the ranks start, before their handlers are in place (``start``). The run
    is held there (lib.stops.HOLD) and every process of it gets SIGUSR1, as from SLURM. Before issue 78's fix the
    first killed launch.sh (no trap yet: exit 138, the job FAILED) and the second was ignored (the ranks inherit
    torchrun's SIG_IGN): the run went on into the job's time limit. Now it stops after its first step, exit 0."""
    hold, request = tmp_path / "hold", tmp_path / "request"
    hold.write_text("")
    proc = subprocess.Popen(launch(tmp_path, "run"), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**env(), "SPMD_RL_TEST_HOLD": f"{where}:{hold}",
                                            "SPMD_RL_STOP_REQUEST": str(request)})
    arrived = [f"{hold}.check"] if where == "check" else [f"{hold}.rank0", f"{hold}.rank1"]
    wait_for_files(arrived, proc)
    for pid in [proc.pid] + descendants(proc.pid):  # every process of the job, as SLURM signals a job step
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    if where == "start":  # the ranks go on once launch.sh has taken the signal (else its copy could come after them)
        wait_for_request(request, proc)
    hold.unlink()  # at "check", launch.sh takes it once lib.check has ended (bash runs a trap between commands)
    out, err = proc.communicate(timeout=600)
    text = out + err
    assert proc.returncode == 0, text[-4000:]
    assert "stopped by SIGUSR1 after step 1:" in text, text[-4000:]
    assert int(open(tmp_path / "run" / "checkpoints" / "latest").read()) == 1
