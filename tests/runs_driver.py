"""torchrun entry for several trainer runs in the same ranks, one after another: tests whose runs would each start
the ranks anew (the zoo's models, the recipes of the README and docs/, the presets) pay the ranks' start-up once
(~6 s of imports a rank). Each run is train_grpo.py's or train_ppo.py's own main with its own arguments, in the same
default process group (each run makes its own meshes in it). Creating the default group again in the same ranks races on the
rendezvous keys (a rank can read its peer's address from the previous group: "Connection refused"), so the runs'
teardown leaves it up and the driver ends it. A run that fails ends the launch; the line ``== run NAME`` printed
before each run names the one it was.

    torchrun --nproc-per-node 2 tests/runs_driver.py PLAN.json    # PLAN: [[name, script, [argument, ...]], ...]
"""

import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch.distributed as dist  # noqa: E402

import train_grpo  # noqa: E402
import train_ppo  # noqa: E402

SCRIPTS = {"train_grpo.py": train_grpo.main, "train_ppo.py": train_ppo.main}


def main(argv: list[str]) -> None:
    with open(argv[0]) as f:
        plan = json.load(f)
    destroy, dist.destroy_process_group = dist.destroy_process_group, lambda *args, **kwargs: None
    lead = os.environ.get("RANK", "0") == "0"
    for name, script, args in plan:
        began = time.monotonic()
        if lead:
            print(f"== run {name}", flush=True)
        SCRIPTS[script](args)
        if lead:  # what each run of a launch costs, in its log
            print(f"== run {name} ended after {time.monotonic() - began:.1f} s", file=sys.stderr, flush=True)
    destroy()


if __name__ == "__main__":
    main(sys.argv[1:])
