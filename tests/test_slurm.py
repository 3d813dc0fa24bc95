"""The SLURM template under a real SLURM: a local single-host cluster (munge, slurmctld, two slurmd: nodes n1 and n2,
tests/slurm/cluster.sh), and ``sbatch slurm/train.sbatch ...`` as the README gives it. One node and two nodes
complete; scancel (SIGTERM to every process of the job) and the pre-emption warning (SIGUSR1 to every process, from
the template's --signal=USR1@180 or scancel --signal=USR1) each end with a checkpoint, the warning with exit 0; the
same command resumes to the numbers of a run never interrupted.

Runs with SLURM_TESTS=1 (.ci/run sets it) as root where Debian's slurmd, slurmctld, slurm-client and munge are
installed or can be (apt-get); elsewhere it skips, saying why."""

import glob
import json
import os
import re
import shutil
import socket
import subprocess
import time

import pytest

from lib.dist import free_port
from tests.helpers import apt_install
from tests.test_resume import ROOT, TIMING

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
PACKAGES = ("slurmd", "slurmctld", "slurm-client", "munge")
CLUSTER = os.path.join(ROOT, "tests", "slurm", "cluster.sh")
ARGS = ("--trainer.total_steps", "8", "--trainer.train_batch_size", "16", "--actor.mini_batch_size", "128",
        "--trainer.val_every", "0", "--trainer.save_every", "0")
DONE = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
        "DEADLINE")


def _why_not() -> str:
    if os.environ.get("SLURM_TESTS") != "1":
        return "SLURM_TESTS=1 runs the tests under a local SLURM (.ci/run sets it)"
    if os.geteuid() != 0:
        return "a local SLURM cluster (slurmd) needs root"
    if all(shutil.which(b) for b in ("slurmd", "slurmctld", "sbatch", "munged", "mungekey")):
        return ""
    return apt_install(PACKAGES)


def start_cluster(d: str) -> dict:
    """A cluster whose files are under d, on four ports the system finds free now; the environment its commands
    take."""
    ports: list[int] = []
    while len(ports) < 4:  # the controller's, slurmd's default, the two nodes'
        port = free_port()
        if port not in ports:
            ports.append(port)
    out = subprocess.run(["bash", CLUSTER, d], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "PORTS": " ".join(map(str, ports))})
    if out.returncode != 0 or "ready" not in out.stdout:
        stop_cluster(d)  # what started of it (munged at least) ends with the test
        pytest.fail(out.stdout[-3000:] + out.stderr[-3000:])
    return {**os.environ, "SLURM_CONF": os.path.join(d, "slurm.conf"), "CUDA_VISIBLE_DEVICES": "",
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def stop_cluster(d: str) -> None:
    subprocess.run(["bash", CLUSTER, d, "stop"], timeout=120)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    why = _why_not()
    if why:
        pytest.skip(why)
    d = str(tmp_path_factory.mktemp("slurm"))
    env = start_cluster(d)
    yield env, d
    stop_cluster(d)


def test_a_former_clusters_ports_still_held_stop_no_new_cluster(cluster, tmp_path):
    """A test session killed part way leaves its cluster's daemons running (pytest's teardown never came); the next
    session's cluster was on the same fixed ports, so its controller could not listen and sinfo reached the former
    one ("slurm_load_partitions: Zero Bytes were transmitted or received": every test of the file an error). Here
    the former ports (16817-16822, what the cluster took before) held by listeners, as such daemons hold them: a
    second cluster starts, runs a job step and stops."""
    held = []
    for port in range(16817, 16823):
        s = socket.socket()
        try:
            s.bind(("", port))  # every address, as slurmctld and slurmd listen
            s.listen()
            held.append(s)
        except OSError:  # a former session's daemon holds it already
            s.close()
    try:
        d = str(tmp_path / "second")
        env = start_cluster(d)
        try:
            out = subprocess.run(["srun", "-N1", "true"], env=env, capture_output=True, text=True, timeout=120)
            assert out.returncode == 0, out.stderr
        finally:
            stop_cluster(d)
    finally:
        for s in held:
            s.close()


def submit(env, root, *sbatch_args, args=ARGS):
    """sbatch [resources] slurm/train.sbatch train_grpo.py ..., from the repository (the submit folder); the log
    goes next to the run (the template's default is slurm-<job id>.out in the submit folder)."""
    os.makedirs(root, exist_ok=True)
    out = subprocess.run(["sbatch", "--parsable", f"--output={root}/slurm-%j.out", *sbatch_args, "slurm/train.sbatch",
                          "train_grpo.py", "--trainer.output_root", str(root), *args], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def job(env, job_id):
    out = subprocess.run(["scontrol", "show", "job", job_id, "-o"], env=env, capture_output=True, text=True)
    state = re.search(r"JobState=(\S+)", out.stdout)
    code = re.search(r"ExitCode=(\S+)", out.stdout)
    return (state.group(1) if state else "?"), (code.group(1) if code else "?")


def wait(env, job_id, limit=900):
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        state, code = job(env, job_id)
        if state in DONE:
            return state, code
        time.sleep(1)
    raise TimeoutError(job_id)


def run_dir(root):
    found = glob.glob(os.path.join(str(root), "train_grpo-*"))
    return found[0] if len(found) == 1 else None


def rows(root):
    return [{k: v for k, v in json.loads(line).items() if not k.startswith(TIMING)}
            for line in open(os.path.join(run_dir(root), "metrics.jsonl"))]


def log(root, job_id):
    return open(os.path.join(str(root), f"slurm-{job_id}.out")).read()


def wait_for_pause(marker, env, job_id, limit=600):
    """Until the job's run waits at the step the test named (lib.resume.PAUSE); fail at once if the job ended."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < limit:
        if os.path.isfile(marker):
            return
        assert job(env, job_id)[0] not in DONE, job(env, job_id)
        time.sleep(0.5)
    raise TimeoutError(marker)


@pytest.fixture(scope="module")
def reference(cluster, tmp_path_factory):
    """One node and two nodes, run to completion at once; the one-node run is the uninterrupted reference."""
    env, _ = cluster
    one, two = tmp_path_factory.mktemp("one"), tmp_path_factory.mktemp("two")
    jobs = {submit(env, one): one, submit(env, two, "--nodes=2"): two}
    worlds = {}
    for job_id, root in jobs.items():
        assert wait(env, job_id) == ("COMPLETED", "0:0"), log(root, job_id)[-4000:]
        worlds[root] = int(re.search(r"Topology\(rank=0/(\d+)", log(root, job_id)).group(1))
    return rows(one), rows(two), worlds[one], worlds[two]


def test_one_and_two_nodes_complete(reference):
    one, two, world_one, world_two = reference
    assert [r["step"] for r in one] == [r["step"] for r in two] == list(range(1, 9))
    assert world_two == 2 * world_one  # the second node's ranks joined the first's


def test_a_stop_request_left_by_a_former_job_of_the_same_id_stops_nothing(cluster, reference, tmp_path):
    """A job id repeats (each test session's cluster counts from 1; a controller's reset does too), and a job killed
    before its launch.sh removed its stop-request file leaves it behind in the node's temporary folder. The template
    named that file by the job id alone: a new job of the same id read the old job's TERM and stopped after its first
    step (seen in a CI-like run, job 7, after a former session's cancelled job 7). Files of every id this cluster can
    have reached, each saying TERM, in the job's own TMPDIR: the job runs its 8 steps as the reference did."""
    env, _ = cluster
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    for job_id in range(1, 101):
        (tmpdir / f"spmd-rl-request.{job_id}.0").write_text("TERM\n")
    job_id = submit({**env, "TMPDIR": str(tmpdir)}, tmp_path)
    assert int(job_id) <= 100
    assert wait(env, job_id) == ("COMPLETED", "0:0"), log(tmp_path, job_id)[-4000:]
    assert "stopped by" not in log(tmp_path, job_id) and rows(tmp_path) == reference[0], log(tmp_path, job_id)[-4000:]


@pytest.mark.parametrize("how", ["usr1", "term"])
def test_scancel_ends_in_a_checkpoint_and_the_same_command_resumes(cluster, reference, tmp_path, how):
    """scancel --signal=USR1 (what the pre-emption warning sends) must end COMPLETED with exit 0; plain scancel
    (SIGTERM, then SIGKILL after KillWait) CANCELLED, both with a checkpoint the same command resumes from."""
    env, _ = cluster
    marker = tmp_path / "paused"
    job_id = submit({**env, "SPMD_RL_TEST_PAUSE": f"2:{marker}"}, tmp_path)
    wait_for_pause(marker, env, job_id)  # the 8-step run ended before the scancel came, on a loaded machine
    cmd = ["scancel", "--signal=USR1", job_id] if how == "usr1" else ["scancel", job_id]
    subprocess.run(cmd, env=env, check=True, timeout=60)
    state, code = wait(env, job_id)
    text = log(tmp_path, job_id)
    if how == "usr1":  # a pre-emption warning: --dependency=afterok chains and requeue logic go on
        assert (state, code) == ("COMPLETED", "0:0"), text[-4000:]
    else:
        assert state == "CANCELLED", text[-4000:]
    # the signal the user sent: launch.sh passes on the one it got, so both copies of it a rank may see are the same
    assert f"stopped by SIG{how.upper()} after step" in text and "BrokenPipeError" not in text, text[-4000:]
    step = int(open(os.path.join(run_dir(tmp_path), "checkpoints", "latest")).read())
    assert step == 2
    again = submit(env, tmp_path)
    assert wait(env, again) == ("COMPLETED", "0:0"), log(tmp_path, again)[-4000:]
    assert f"resumed from step {step}" in log(tmp_path, again)
    assert rows(tmp_path) == reference[0]


def test_the_templates_preemption_warning_stops_requeues_and_the_job_resumes(cluster, reference, tmp_path):
    """The template's --signal=USR1@180 with a 5-minute limit: SLURM sends the warning once, about two minutes in,
    whatever the job is doing then. The run waits at the end of step 1 until a stop signal has reached its ranks (or
    was kept for them, lib.stops), so the verdict follows the job's state, not the machine's speed: the warning may
    come while the ranks start or while they wait, and either way the run stops with step 1's checkpoint. With
    SPMD_RL_REQUEUE=1 launch.sh then requeues the job (the template's --requeue), and its next run resumes from step 1
    and completes, to the numbers of a run never interrupted (the same job id, its log appended).
    It ended FAILED, exit 138 (torchrun died of SIGUSR1); later TIMEOUT on a loaded machine: the warning came while the
    ranks were starting, they ignored it, and the run went on to step 497 (issue 78)."""
    env, _ = cluster
    marker = tmp_path / "paused"
    job_id = submit({**env, "SPMD_RL_TEST_PAUSE": f"1:{marker}", "SPMD_RL_REQUEUE": "1"}, tmp_path, "--time=5")
    state, code = wait(env, job_id, limit=1800)
    text = log(tmp_path, job_id)
    assert (state, code) == ("COMPLETED", "0:0"), text[-4000:]
    assert "stopped by SIGUSR1 after step 1:" in text, text[-4000:]
    assert f"launch.sh: job {job_id} requeued" in text and "resumed from step 1" in text, text[-4000:]
    assert rows(tmp_path) == reference[0]
