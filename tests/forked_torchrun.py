"""torchrun for the tests whose subject is the training rather than the launch: torchrun's own argument parsing,
launch configuration, elastic agent and rendezvous (``python -m torch.distributed.run``'s), each rank set up by the
agent with the same environment (RANK, WORLD_SIZE, MASTER_ADDR, ...), but forked from this process once it has
imported the scripts, where torchrun starts each rank as a fresh interpreter that imports torch, transformers and
lib again. On the 2-core machine CI runs on that import is ~10 s of a core a rank, and torchrun's own ~4 s more: a
2-step run of the default preset took 37 CPU-s under torchrun and 19 forked (2026-12-01), its metrics the same to the
bit (tests/test_e2e.py::test_golden_run_is_reproduced runs both).

The tests of the launch itself (signals to torchrun or a rank, killed and hung ranks, restarts, launch.sh, SLURM,
what bad input prints) run the real torchrun, and so does whatever a fork could hide: the ranks here share the
launcher's string hash seed (torchrun's draw one each), so an order of a set that differs between ranks shows only
there. CPU ranks only: a process that has touched CUDA cannot be forked, so with a GPU visible this refuses (the
callers use torchrun there).

    python tests/forked_torchrun.py --standalone --nnodes 1 --nproc-per-node 2 train_grpo.py ARGS...
    (tests/helpers.py: forked_torchrun(nproc, script, *args) is that command line)
"""

from __future__ import annotations

import os
import signal
import sys
import uuid

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
# torchrun sets this for its ranks before they import torch; here torch is imported once, below, for all of them
os.environ.setdefault("OMP_NUM_THREADS", "1")
if __name__ == "__main__" and os.environ.get("FORK_SERVER_DIR"):  # a warm parent forks it (tests/fork_server.py)
    from tests import fork_server

    fork_server.launch(sys.argv[1:])  # exits with the launch's status; returns where no server could start

from torch.distributed import run as torchrun  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import record  # noqa: E402
from torch.distributed.launcher.api import elastic_launch  # noqa: E402

import train_grpo  # noqa: E402
import train_ppo  # noqa: E402
from tests import runs_driver  # noqa: E402

MAINS = {"train_grpo.py": train_grpo.main, "train_ppo.py": train_ppo.main, "runs_driver.py": runs_driver.main}


def rank(script: str, args: list[str]) -> None:
    """A rank as torchrun starts one: the script's main with the command line its rank sees (run folders are named
    from it), the signals' default handlers (a forked child inherits the agent's, which raise an exception where a
    fresh interpreter would end), an uncaught error through sys.excepthook (the run's own, which names the rank and
    stage and keeps the fault: multiprocessing would print it in the launcher instead), and once main returns, SIGTERM
    ending the process (the launcher holds a finished rank until its peers end, and a peer's failure ends it so), as
    does the agent's death."""
    agent = os.getppid()
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [script, *args]
    try:
        MAINS[os.path.basename(script)](args)
    except SystemExit as e:
        if e.code:
            raise
    except BaseException as error:  # noqa: BLE001 - what an uncaught error does to a script: its excepthook, exit 1
        sys.excepthook(type(error), error, error.__traceback__)
        raise SystemExit(130 if isinstance(error, KeyboardInterrupt) else 1) from None
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    _held_while_the_agent_lives(agent)


def _held_while_the_agent_lives(agent: int) -> None:
    """A rank that returned waits until the agent has read its result (torch's fork start). An agent killed outright
    never does: its ranks (told by torch's parent-death signal, SIGINT, to stop and save) would wait for ever, holding
    the launch's streams. From here the agent's death ends the rank (SIGTERM), and an agent already gone ends it now."""
    from torch.multiprocessing import _prctl_pr_set_pdeathsig

    _prctl_pr_set_pdeathsig(signal.SIGTERM)
    if os.getppid() != agent:
        os.kill(os.getpid(), signal.SIGTERM)


@record
def main(argv: list[str]) -> None:
    if os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        raise SystemExit("tests/forked_torchrun.py forks CPU ranks only: set CUDA_VISIBLE_DEVICES='' (with a GPU, "
                         "run python -m torch.distributed.run)")
    args = torchrun.parse_args(argv)
    if args.standalone:  # what torchrun's own run() does with --standalone
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    config, _, _ = torchrun.config_from_args(args)
    config.start_method = "fork"
    elastic_launch(config, rank)(args.training_script, list(args.training_script_args))


if __name__ == "__main__":
    main(sys.argv[1:])
