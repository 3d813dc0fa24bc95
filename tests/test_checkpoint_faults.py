"""A checkpoint is complete or ignored: a save killed at any point of its write, a checkpoint damaged afterwards, a
disk that fills during a save (tests/checkpoint_driver.py: a small model and its optimizer saved a step at a time
through lib/checkpoint.py, in gloo ranks). Each fault is real: SIGKILL of the saving process, bytes cut from a
shard, a tmpfs filled up."""

import os
import re
import shutil
import subprocess
import sys


from lib.runfolder import damage, resumable, step_dir

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, "tests", "checkpoint_driver.py")
KILL_POINTS = ("shards", "trainer", "manifest", "rename", "marker")


def drive(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, DRIVER, *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""})


def digests(out: subprocess.CompletedProcess) -> dict[str, str]:
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return dict(re.findall(r"^(\S+) digest (\w+)$", out.stdout, re.M))


def test_a_save_killed_or_a_checkpoint_damaged_resumes_from_the_last_whole_one(tmp_path):
    """SIGKILL at each point of step 2's save: the resume takes step 1 (or step 2 where the folder was complete before
    the kill: the ``latest`` marker alone missed) and the run ends with the weights of a run never killed. A step 3
    cut short or missing a file is passed over for step 2, naming what is wrong; the redone step 3 replaces it."""
    runs = {point: tmp_path / point for point in KILL_POINTS}
    cut, lost, straight = tmp_path / "cut", tmp_path / "lost", tmp_path / "straight"
    out = drive(3, *(f"{folder}@{point}" for point, folder in runs.items()), cut, lost)
    digests(out)
    for point, folder in runs.items():
        assert f"{folder} killed" in out.stdout, (point, out.stdout)  # killed, not ended
        assert resumable(str(folder)) == (2 if point == "marker" else 1, []), point
        assert open(folder / "checkpoints" / "latest").read() == "1", point
    shard = os.path.join(step_dir(str(cut), 3), "__0_0.distcp")
    size = os.path.getsize(shard)
    os.truncate(shard, size // 2)
    os.remove(os.path.join(step_dir(str(lost), 3), ".metadata"))
    assert resumable(str(cut)) == (2, [f"{step_dir(str(cut), 3)}: __0_0.distcp holds {size // 2} bytes, not the "
                                       f"{size} written"])
    assert resumable(str(lost)) == (2, [f"{step_dir(str(lost), 3)}: .metadata is missing"])
    out = drive(4, *runs.values(), cut, lost, straight)
    found = digests(out)
    assert set(found.values()) == {found[str(straight)]} and len(found) == len(runs) + 3, found
    for folder in (cut, lost):
        assert f"{folder} resumed 2" in out.stdout
        assert damage(step_dir(str(folder), 3)) is None  # redone whole
    assert f"{runs['marker']} resumed 2" in out.stdout and f"{runs['shards']} resumed 1" in out.stdout


def _small_disk(folder) -> bool:
    """A 4 MiB tmpfs at ``folder``; False where mounting is not allowed."""
    os.makedirs(folder)
    return subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(folder)],
                          capture_output=True).returncode == 0


def test_a_full_disk_fails_the_save_on_every_rank_and_loses_nothing(tmp_path):
    """Two ranks; the disk fills while the last rank writes its own file of step 2's checkpoint: both ranks fail the
    save together (no rank waits for the other; the first rank from the last's report, or from its own write where
    the last one's file took the room first), the partial folder is removed, step 1 and the marker are untouched and
    step 1 resumes. On a tmpfs filled up to the room step 2's shards need where mounting is allowed; else with the
    last rank's file size limited (RLIMIT_FSIZE), a write refused the same way."""
    disk = tmp_path / "disk"
    mounted = _small_disk(disk)
    run = disk / "run"
    try:
        digests(drive(1, run, "--world", 2))
        limit = []
        if mounted:
            step1 = sum(os.path.getsize(os.path.join(step_dir(str(run), 1), f)) for f in
                        os.listdir(step_dir(str(run), 1)))
            with open(disk / "filler", "wb") as f:  # room for step 2's shards and a little more, not the 8 MiB file
                f.write(b"\0" * (shutil.disk_usage(disk).free - step1 - (256 << 10)))
        else:
            limit = ["--fsize", 256 << 10]
        out = drive(3, run, "--world", 2, "--full-disk", *limit)
        assert out.returncode == 0, out.stderr[-3000:]
        reason = "No space left on device" if mounted else "File too large"
        assert re.search(rf"rank 1 SAVE FAILED: writing the shards of step 2 failed: OSError: \[Errno \d+\] {reason}",
                         out.stdout), out.stdout
        # rank 0 learns it from rank 1, or, where rank 1's file took the disk's last room before rank 0's shards were
        # written (the order of two processes' writes: the load's), from its own write: either way it fails the save
        assert re.search(rf"rank 0 SAVE FAILED: writing the shards of step 2 failed( on another rank|: OSError: "
                         rf"\[Errno \d+\] {reason})", out.stdout), out.stdout
        assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_1"]
        assert open(run / "checkpoints" / "latest").read() == "1" and resumable(str(run)) == (1, [])
    finally:
        if mounted:
            subprocess.run(["umount", str(disk)], capture_output=True)


def _stop_at_a_failed_save(run_path: str) -> tuple:
    """A rank's end of step 4 (save_every 2) whose save fails as checkpoint.save fails on every rank together."""
    from types import SimpleNamespace

    from lib import checkpoint, resume

    def save(*_):
        raise checkpoint.SaveFailed("writing the shards of step 4 failed: OSError: [Errno 28] No space left on device")

    resume.save = save
    printed = []
    run = SimpleNamespace(cfg=SimpleNamespace(trainer=SimpleNamespace(save_every=2, max_bad_steps=5, val_every=0),
                                              rollout=SimpleNamespace(logp_diff_limit=-1)),
                          total_steps=10, bad_steps=0, val=None, path=run_path,
                          logger=SimpleNamespace(print=printed.append),
                          carried_metrics={}, stopped=None)
    return resume.end_of_step(run, 3, {}, None, {}), run.stopped, printed


def test_a_save_that_fails_stops_the_run_saying_what_the_same_command_resumes(tmp_path):
    """The trainer's side of a failed save (lib/resume.py end_of_step): the run stops ("save_failed", which
    startup.finish exits 3 for) with one message naming the step, the failure and the checkpoint the same command
    resumes from (step 2 here, whole), never a traceback."""
    from lib.testing import run_distributed

    step2 = step_dir(str(tmp_path / "run"), 2)
    os.makedirs(step2)
    for name in ("trainer.json", ".metadata"):  # a checkpoint written before manifests: whole
        open(os.path.join(step2, name), "w").close()
    [(going_on, stopped, printed)] = run_distributed(_stop_at_a_failed_save, str(tmp_path / "run"), world_size=1)
    assert going_on is False and stopped == "save_failed"
    assert len(printed) == 1 and printed[0].startswith(
        "error: the checkpoint of step 4 could not be written (writing the shards of step 4 failed: OSError: [Errno "
        "28] No space left on device): its partial files are removed, nothing written before is touched; the last "
        f"checkpoint is step 2 ({step2}): the same command resumes from it"), printed


def test_a_disk_full_under_dcps_own_writes_names_the_disks_error(tmp_path):
    """No room left at all: DCP's shard writes fail, and DCP raises on every rank with each failed rank's exception
    and traceback (CheckpointException.failures). Each rank's message names the disk's error (before: the wrapped
    pair's type, "tuple"); step 1 stays the checkpoint. Needs a tmpfs (root's mount)."""
    import pytest

    disk = tmp_path / "disk"
    if not _small_disk(disk):
        pytest.skip("mounting a tmpfs is not allowed here: a full disk cannot be made without it")
    run = disk / "run"
    try:
        digests(drive(1, run, "--world", 2))
        with open(disk / "filler", "wb") as f:
            f.write(b"\0" * (shutil.disk_usage(disk).free - 4096))
        out = drive(3, run, "--world", 2)
        assert out.returncode == 0, out.stderr[-3000:]
        for rank in (0, 1):
            assert f"rank {rank} SAVE FAILED: writing the shards of step 2 failed: OSError: [Errno 28] No space left " \
                   f"on device" in out.stdout, out.stdout
        assert sorted(os.listdir(run / "checkpoints")) == ["latest", "step_1"] and resumable(str(run)) == (1, [])
    finally:
        subprocess.run(["umount", str(disk)], capture_output=True)
