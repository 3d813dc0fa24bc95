"""The tests' forked launcher (tests/forked_torchrun.py) fails as torchrun does. That it computes what torchrun's
ranks compute: tests/test_e2e.py::test_golden_run_is_reproduced."""

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.helpers import ROOT, forked_torchrun, processes


@pytest.mark.slow
def test_a_rank_that_raises_shows_its_rank_and_stage_and_the_launch_fails(tmp_path):
    """Rank 1 raises at the start of step 1's update: its own traceback, prefixed by the run's excepthook with the rank
    and the stage (as a rank of torchrun's prints it), the launcher's report of exit code 1, the launch failing; rank 0,
    left waiting in the update's collective, ends too. Before, the launcher's multiprocessing caught the error: no
    prefix, the traceback only in the launcher's report."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": "",
           "SPMD_RL_TEST_FAULT": "raise:step/update:1:1:0", "FORK_SERVER_DIR": ""}  # (this launcher alone)
    out = subprocess.run(forked_torchrun(2, os.path.join(ROOT, "train_grpo.py"), "--trainer.output_root",
                                         str(tmp_path), "--trainer.run_name", "run", "--trainer.total_steps", "2",
                                         "--trainer.val_every", "0"),
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)  # a hang's guard
    text = out.stdout + out.stderr
    assert out.returncode == 1, text[-4000:]
    assert "[rank 1 in stage step/update] " in out.stderr, text[-4000:]  # then torch's own "[rank1]: " on each line
    assert "RuntimeError: a fault injected by SPMD_RL_TEST_FAULT" in out.stderr, text[-4000:]
    assert "ChildFailedError" in out.stderr and "exitcode  : 1" in out.stderr, text[-4000:]


AGENT_AND_RANK = """
import os, signal, sys, time
sys.path.insert(0, sys.argv[1])
from tests.forked_torchrun import _held_while_the_agent_lives
gone_first = sys.argv[2] == "gone"
agent = os.fork()
if agent == 0:  # the agent: forks its rank, then dies outright (at once, or once the rank is held)
    r, w = os.pipe()
    if os.fork() == 0:  # the rank: its main returned; held as torch holds it
        me = os.getppid()
        while gone_first and os.getppid() == me:
            time.sleep(0.01)
        _held_while_the_agent_lives(me)
        os.write(w, b"held")
        time.sleep(600)  # torch's wait for the agent's reading
        os._exit(0)
    print(os.getpid(), flush=True)
    if not gone_first:
        os.read(r, 4)  # the rank held: its agent's death is what must end it
    os.kill(os.getpid(), signal.SIGKILL)
os.waitpid(agent, 0)
"""


@pytest.mark.parametrize("when", ["gone", "later"])
def test_a_rank_held_after_its_main_ends_with_its_killed_agent(when):
    """A forked rank whose main returned is held until the agent reads its result (torch's fork start); an agent
    killed outright never reads it. The rank ends by SIGTERM, whether the agent was gone when it returned or dies
    while it is held. Before, it waited for ever, holding the launch's streams (stop 89's CI: the child-KILL case below
    timed out so, its ranks stopped by one parent-death SIGINT, saved, and held; where two came, as the agent's threads
    died one after another, the second raised KeyboardInterrupt in the pause and the ranks ended)."""
    proc = subprocess.run([sys.executable, "-c", AGENT_AND_RANK, ROOT, when], capture_output=True, text=True,
                          timeout=300)  # a hang's guard: a held rank never ends and keeps stdout open
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stderr[-3000:]


@pytest.fixture
def fs(tmp_path):
    """A folder for the test's fork servers, which end with the test (not a minute idle after it)."""
    yield tmp_path / "fs"
    subprocess.run(["pkill", "-f", f"{tmp_path / 'fs'}/"], check=False)


def _launch_env(server_dir, **extra) -> dict:
    """The launches' environment, through the fork server in ``server_dir`` ("": each launch imports for itself)."""
    from tests.test_resume import env

    return {**env(), "FORK_SERVER_DIR": str(server_dir), **extra}


def _served(server_dir) -> list[str]:
    """The server logs' lines that name a launch, one log a server."""
    logs = [os.path.join(server_dir, f) for f in os.listdir(server_dir) if f.endswith(".log")]
    return [[line for line in open(p) if line.startswith("launch ")] for p in logs]


@pytest.mark.slow
def test_launches_through_the_fork_server_compute_the_launch_forked_here(tmp_path, fs):
    """Two launches through one fork server (tests/fork_server.py: the second forked from the same warm parent) and one
    that imports for itself: the same metrics to the bit, each launch's output on its own streams, exit 0."""
    from tests.test_resume import forked, rows

    outs = {}
    for name, server in (("first", fs), ("second", fs), ("alone", "")):
        out = subprocess.run(forked(tmp_path, "--trainer.total_steps", "2", "--trainer.val_every", "0", name=name),
                             cwd=ROOT, env=_launch_env(server),
                             capture_output=True, text=True, timeout=900)  # a hang's guard
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        outs[name] = out.stdout
    assert all(f"done: {tmp_path / name} " in outs[name] for name in outs), outs
    (served,) = _served(fs)  # one server, both launches
    assert [line.split(":")[0] for line in served] == ["launch 1", "launch 2"], served
    first, second, alone = (rows(tmp_path, n) for n in ("first", "second", "alone"))  # but times and memory
    assert first == second == alone and len(first) == 2


@pytest.mark.slow
def test_a_launch_through_the_fork_server_fails_as_it_fails_alone(tmp_path, fs):
    """Rank 1 raises (tests/test_forked_torchrun.py's first test, through the server): the client exits 1 with the
    rank's traceback and the launcher's report on its own stderr."""
    from tests.test_resume import forked

    env = _launch_env(fs, SPMD_RL_TEST_FAULT="raise:step/update:1:1:0")
    out = subprocess.run(forked(tmp_path, "--trainer.total_steps", "2", "--trainer.val_every", "0"), cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=900)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "[rank 1 in stage step/update] " in out.stderr and "ChildFailedError" in out.stderr, out.stderr[-4000:]
    assert [len(s) for s in _served(fs)] == [1]  # the server ran it


@pytest.mark.slow
@pytest.mark.parametrize("how", [signal.SIGTERM, signal.SIGKILL, "child"], ids=["TERM", "KILL", "child-KILL"])
def test_a_signal_to_the_fork_servers_client_reaches_its_launch(tmp_path, fs, how):
    """A run held after step 1 (lib.resume.PAUSE: a state, not a time) through the fork server. SIGTERM to the client
    (as to torchrun): relayed to the launch, whose agent stops the ranks: a checkpoint of step 1, as under
    torchrun. SIGKILL (nothing to relay): the client's socket closes and the launch's whole session (its agent and
    ranks) ends. The launch's process killed (SIGKILL to the server's child): the client ends by the same signal, as a
    launch's own process would."""
    from tests.test_resume import forked, pause_at, wait_for_pause

    marker = tmp_path / "paused"
    env = _launch_env(fs, **pause_at(1, marker))
    proc = subprocess.Popen(forked(tmp_path, "--trainer.total_steps", "50", "--trainer.save_every", "0",
                                   "--trainer.val_every", "0"), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for_pause(marker, proc)
    (served,) = _served(fs)
    session = int(served[0].split(": pid ")[1].split(":")[0])  # the launch's child: its own session
    if how == "child":
        os.kill(session, signal.SIGKILL)
        proc.communicate(timeout=600)
        assert proc.returncode == -signal.SIGKILL
        try:
            os.killpg(session, signal.SIGKILL)  # its ranks, where still held in the pause
        except ProcessLookupError:
            pass  # gone with their agent already
        return
    proc.send_signal(how)
    out, err = proc.communicate(timeout=600)
    if how == signal.SIGTERM:  # the agent ends on it as torchrun's does (exit 1), the ranks stopped and saved first
        assert proc.returncode == 1 and "got signal: 15" in err and "stopped by SIGTERM after step 1" in out, \
            (out[-3000:], err[-3000:])
        assert open(tmp_path / "run" / "checkpoints" / "latest").read().strip() == "1"
        return
    assert proc.returncode == -signal.SIGKILL

    def in_session() -> list[int]:
        return [pid for pid, fields in processes() if int(fields[3]) == session and fields[0] != "Z"]

    t0 = time.monotonic()
    while in_session():  # a state: every process of the launch gone
        assert time.monotonic() - t0 < 300, in_session()  # a hang's guard
        time.sleep(0.2)
