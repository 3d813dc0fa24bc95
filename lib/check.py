"""Check a run's input in one process before torchrun starts the ranks (launch.sh calls it):

    python -m lib.check SCRIPT WORLD_SIZE [script arguments...]

A bad config, path, data row or custom reward prints one message naming the fix and exits 2, before any rank
(and any model) starts; nothing is written but the toy task's assets and the rows made from a name
(reasoning_gym:..., verifiers:...). Exit 0: the ranks may start (they run the same checks again, for users who call
torchrun directly). A script other than the two below is not checked here.
"""

from __future__ import annotations

import os
import sys

from lib import config, preflight, stops
from lib.runfolder import run_dir
from lib.inputs import check_inputs, resolve_generated, resolve_toy

OUT_ENV = "SPMD_RL_CHECK_OUT"
"""A file lib.check writes the run's trainer.max_restarts into, for launch.sh's torchrun (nothing: no restarts)."""
SCRIPTS = {"train_grpo.py": ("tiny_cpu_grpo", False), "train_ppo.py": ("tiny_cpu_ppo", True)}
"""Script -> (its default preset, whether it trains a critic)."""


def main(argv: list[str]) -> int:
    script, world_size, args = argv[0], int(argv[1]), argv[2:]
    stops.hold_for_a_test("check")
    if os.path.basename(script) not in SCRIPTS:
        return 0
    if any(a in ("-h", "--help") for a in args):
        return 0  # the script prints the help
    preset, need_critic = SCRIPTS[os.path.basename(script)]
    cfg = config.parse(args, default_preset=preset, prog=os.path.basename(script))  # a command-line error: tyro's message, exit 2
    try:
        resolve_generated(cfg)  # first: its refusals come before the embedded task is built
        resolve_toy(cfg)
        preflight.resolve(cfg, need_critic)
        path = run_dir(cfg.trainer.output_root, cfg.trainer.run_name, config.to_dict(cfg), script)
        check_inputs(cfg, world_size, need_critic, path)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 2
    if os.environ.get(OUT_ENV):  # what launch.sh passes to torchrun
        with open(os.environ[OUT_ENV], "w") as f:
            f.write(f"{cfg.trainer.max_restarts}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
