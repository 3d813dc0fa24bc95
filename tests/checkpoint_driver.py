"""Checkpoints under faults, for tests/test_checkpoint_faults.py: a small model and its Adam optimizer trained a step
at a time (each step's input fixed by its number) and saved after every step through lib/checkpoint.py, in gloo
ranks on the CPU. Each run folder resumes from what ``lib.runfolder.resumable`` picks, as the trainer does.

    python tests/checkpoint_driver.py STEPS RUN[@POINT] [RUN[@POINT] ...] [--world N] [--full-disk] [--fsize B]

``RUN@POINT`` runs in a child process forked for it (the imports paid once), which SIGKILLs itself at one point of
step 2's save (``shards``: DCP's first fsync of a shard; ``trainer``, ``manifest``: before writing trainer.json,
the manifest; ``rename``: before the folder takes its name; ``marker``: before the ``latest`` marker), and prints
``RUN killed`` when it died so. ``--full-disk``: step 2's per-rank file of the last rank is larger than the room
left (its disk filled by the test, or its file size limited to B bytes with RLIMIT_FSIZE); the failed save is
printed as ``rank R SAVE FAILED: ...``. Prints ``RUN resumed STEP`` and, at the end, ``RUN digest HEX`` of the
weights.
"""
import argparse
import functools
import hashlib
import os
import resource
import signal
import sys
import tempfile
from types import SimpleNamespace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch import nn  # noqa: E402

from lib import checkpoint  # noqa: E402
from lib.runfolder import resumable  # noqa: E402


def arm(point: str) -> None:
    """SIGKILL at ``point`` of the next save."""
    def die(*_):
        os.kill(os.getpid(), signal.SIGKILL)

    if point == "shards":
        os.fsync = die
    elif point in ("trainer", "manifest", "marker"):
        calls, write = [], checkpoint._write
        at = {"trainer": 1, "manifest": 2, "marker": 3}[point]

        def counted(path, text):
            calls.append(path)
            if len(calls) == at:
                die()
            write(path, text)
        checkpoint._write = counted
    elif point == "rename":
        replace = os.replace

        def renaming(src, dst):
            if str(src).endswith(".tmp") and os.path.basename(str(dst)).startswith("step_"):
                die()
            replace(src, dst)
        os.replace = renaming


def fill(rank: int, world: int, tmp: str) -> None:
    """A rank's own file in the checkpoint: the last rank's larger than the room left, the others' fitting."""
    with open(os.path.join(tmp, f"rank{rank}.bin"), "wb") as f:
        f.write(b"\0" * (8 << 20 if rank == world - 1 else 16))


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def run(rank: int, world: int, folder: str, kill: str, args) -> None:
    dist.init_process_group("gloo", init_method=f"file://{tempfile.mkdtemp()}/rendezvous" if world == 1 else
                            args.init, rank=rank, world_size=world)
    topo = SimpleNamespace(is_main=rank == 0)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 8))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    parts = {"policy": (model, optimizer)}
    start, _ = resumable(folder)
    if start is not None:
        checkpoint.load(folder, start, parts)
    if rank == 0:
        print(f"{folder} resumed {start or 0}", flush=True)
    for step in range((start or 0) + 1, args.steps + 1):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(16, 32, generator=g), torch.randn(16, 8, generator=g)
        loss = ((model(x) - y) ** 2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step == 2 and kill:
            arm(kill)
        filling = step == 2 and args.full_disk
        if filling and rank == world - 1 and args.fsize:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG, not a signal
            resource.setrlimit(resource.RLIMIT_FSIZE, (args.fsize, resource.RLIM_INFINITY))
        try:
            checkpoint.save(folder, step, parts, {"data_position": step}, topo, args.keep_last,
                            functools.partial(fill, rank, world) if filling else None)
        except checkpoint.SaveFailed as e:
            print(f"rank {rank} SAVE FAILED: {e}", flush=True)
            dist.destroy_process_group()
            return
    if rank == 0:
        print(f"{folder} digest {digest(model)}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("steps", type=int)
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--full-disk", action="store_true")
    parser.add_argument("--fsize", type=int, default=0, help="the last rank's file size limit at step 2 (bytes)")
    parser.add_argument("--keep-last", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for spec in args.runs:
        folder, _, kill = spec.partition("@")
        if args.world > 1:
            args.init = f"file://{tempfile.mkdtemp()}/rendezvous"
            torch.multiprocessing.start_processes(run, args=(args.world, folder, kill, args), nprocs=args.world,
                                                  start_method="fork")
        elif kill:
            pid = os.fork()
            if pid == 0:
                run(0, 1, folder, kill, args)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL:
                print(f"{folder} killed", flush=True)
        else:
            run(0, 1, folder, "", args)


if __name__ == "__main__":
    main()
