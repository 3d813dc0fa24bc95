"""The GPU acceptance run (issue 33): the in-process engine path's figures in one command, ready before a GPU is lent.

    python bench/gpu_acceptance.py --out DIR [--device cpu|cuda] [--budget-s 480] [--check-budget-s 300]
                                   [--only CHECK ...] [--mirror DIR2] [--grpo-steps N] [--lanes N] [--gpu-gib G]
                                   [--missing]

Each check runs in its own process (``--check NAME``), so a crash or an out-of-memory costs that check's rows only;
one that runs past its budget (``--check-budget-s``, and what is left of ``--budget-s``) is sent SIGTERM a grace
before its end, writes the rows of what it measured (a training run: its steps, its figures so far, its log's last
lines), and is killed at the end. The rooms: bench/acceptance/ (the checks, the schedule, the report).
The report: ``DIR/acceptance.md`` (figure, value, goal, pass/fail/void, the command), ``DIR/acceptance.json`` and
``DIR/evidence.tar.gz`` (every check's log, every run's log and metrics, the update's profile), written again after
every check (a run stopped from outside keeps what it measured) and copied to ``--mirror``. A timed row (a time or
a memory reading) of a check that ran beside another check, or beside the gpu-marked tests, is reported void. A check's
result stays in ``DIR/checks/NAME.json``: a later run into the same folder adds its checks to the report (the GPU
session runs the checks that need no vLLM while vLLM is still being staged: bench/gpu_session.sh), and one run
again replaces its earlier result.

Shapes: on a GPU a Qwen2.5-0.5B-shaped model (tied embeddings, GQA, vocabulary 151936) with random weights in bf16,
and a Qwen2.5-1.5B-shaped one for the update's throughput; on CPU (``--device cpu``, run by the test suite) tiny ones
of the same layout in fp32. Prompts and rewards are the embedded toy task's (lib/toy.py; its 15-token tokenizer,
ids past it decode to nothing). Rows that need vLLM (or its sleep mode, which the CPU build lacks) are reported as
not run, with the reason, where it is missing.
"""


from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.acceptance.common import (CHECKS, GRPO_STEPS, Row, Stopped, log_tail, result_path,  # noqa: E402
                                     stop_on)
from bench.acceptance.report import report  # noqa: E402
from bench.acceptance.schedule import TIMED, missing, run_all  # noqa: E402


def check_function(name: str):
    """The function of check ``name`` (imported in its own process only: the scheduler loads no model code)."""
    from bench.acceptance import engine_checks, run_checks

    return getattr(engine_checks, f"check_{name}", None) or getattr(run_checks, f"check_{name}")


def run_check(args) -> None:
    """The child process of one check: its rows into checks/NAME.rows.json, also when its budget stops it, and
    whether a stop left its figures whole (every run it started had logged all its steps: the stop came in a run's
    end, and running the check again would measure the same; the H200 run of 2026-11-30 ran grpo_vllm twice so)."""
    from bench.acceptance import run_checks

    received = stop_on(signal.SIGTERM)
    try:
        rows = check_function(args.check)(args)
        # no stop came, or each stop that came ended one of our trainer's runs after its last step (a stop caught
        # anywhere else, as a lever's failure, leaves the figures short)
        whole = not received or (bool(run_checks.STOPPED) and set(run_checks.STOPPED) <= set(run_checks.WHOLE)
                                 and all(r.value != "not started" for r in rows))
    except Stopped:
        rows = [Row(args.check, "stopped by its budget", "", False,
                    "its log's last lines: " + log_tail(os.path.join(args.out, "checks", f"{args.check}.log")))]
        whole = False
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the file is whole or absent: written aside, then moved in place
    path = result_path(args.out, args.check, child=True)
    with open(path + ".tmp", "w") as f:
        json.dump({"rows": [asdict(r) for r in rows], "whole": whole}, f)
    os.replace(path + ".tmp", path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None, help="default: cuda where torch sees one")
    ap.add_argument("--budget-s", type=float, default=480.0, help="all checks of this run together")
    ap.add_argument("--check-budget-s", type=float, default=300.0, help="one check")
    ap.add_argument("--only", nargs="*", choices=CHECKS, default=None)
    ap.add_argument("--mirror", default="", help="a second folder the report is written to after every check")
    ap.add_argument("--grpo-steps", type=int, default=0, help=f"GRPO steps (0: {GRPO_STEPS})")
    ap.add_argument("--lanes", type=int, default=1, help="checks that judge neither time nor memory run this many at "
                    f"once (the others, {', '.join(TIMED)}, alone; on a GPU also every check with a vLLM engine: "
                    "bench/acceptance/schedule.py VLLM_ENGINE)")
    ap.add_argument("--gpu-gib", type=float, default=70.0, help="the device memory the lanes' checks may hold "
                    "together, GiB (their sizes: bench/acceptance/schedule.py GPU_GIB)")
    ap.add_argument("--missing", action="store_true", help="only the checks without a complete result in --out")
    ap.add_argument("--report-only", action="store_true", help="write the report and the evidence archive again "
                    "(into --out and --mirror) from what is in --out, and run nothing")
    ap.add_argument("--check", choices=CHECKS, help=argparse.SUPPRESS)  # the child process's one check
    args = ap.parse_args()
    args.out = os.path.abspath(args.out)
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    os.makedirs(os.path.join(args.out, "checks"), exist_ok=True)
    if args.check:
        run_check(args)
        return
    if args.report_only:
        last = os.path.join(args.out, "acceptance.json")
        note = json.load(open(last)).get("note", "") if os.path.exists(last) else ""
        report(args, note + " (report and archive written again)")
        return
    names = args.only or list(CHECKS)
    if args.missing and not (names := missing(args.out, names)):
        print(f"nothing to run: every check named has a complete result in {args.out}")
        return
    run_all(args, names)


if __name__ == "__main__":
    main()
