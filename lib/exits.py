"""How a rank ends a run on purpose, and how launch.sh hears of it.

Exit codes: 2, a refusal (bad input found inside the ranks: the start-up self-check, a checkpoint of another base);
3, a stop (the canary, or too many bad steps); a pre-emption warning's stop (``preempted``) exits 0. Every rank calls ``leave`` together, after rank 0 has printed the one
message. Under torchrun alone the ranks exit with that code, and torchrun reports a failure. Under launch.sh, which
sets ``STOP_FILE_ENV``, the ranks write the code to that file and exit 0: torchrun then prints no traceback of its
own and no failures table, and launch.sh exits with the code (SLURM's requeue logic reads it). A rank that crashes
still fails torchrun as before, with everything torchrun shows.
"""

from __future__ import annotations

import os
from typing import NoReturn

FAILED, REFUSED, STOPPED = 1, 2, 3
"""FAILED: the same failure twice in a row (lib/restarts.py), not restarted again: the job failed, as torchrun's own
exit 1 says."""
STOPS = ("bad_steps", "logp_mismatch", "env_failures", "agent_failures", "save_failed", "engine_failures")
"""The ``run.stopped`` reasons that exit STOPPED: too many bad steps, the canary (rollout.logp_diff_limit), failing
environments (env.max_failed_share), a checkpoint that could not be written, a generation that failed past
rollout.max_engine_failures. A signal's stop exits 0."""
STOP_FILE_ENV = "SPMD_RL_STOP_FILE"


PREEMPTED = "0 preempted"
"""What the ranks write to launch.sh's file when SIGUSR1 (SLURM's pre-emption warning) stopped the run before its
end, with its checkpoint: launch.sh exits 0 and, with SPMD_RL_REQUEUE=1 under SLURM, puts the job back in the queue."""


def preempted() -> None:
    """Tell launch.sh that the run stopped on the pre-emption warning, to be continued (a no-op without it)."""
    path = os.environ.get(STOP_FILE_ENV)
    if path:
        with open(path, "w") as f:
            f.write(PREEMPTED)


def leave(code: int) -> NoReturn:
    """End this rank with ``code`` (FAILED, REFUSED or STOPPED), telling launch.sh where it listens."""
    path = os.environ.get(STOP_FILE_ENV)
    if path:
        with open(path, "w") as f:  # every rank writes the same code
            f.write(str(code))
        raise SystemExit(0)
    raise SystemExit(code)
