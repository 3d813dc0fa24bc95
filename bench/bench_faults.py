"""Faults injected into a run of the default, and whether the run survived them with its numbers (issue 76): what to
run before trusting a long job to restart itself.

    python bench/bench_faults.py [--faults 4] [--steps 12] [--seed 0] [--root runs/faults] [--out FILE] [-- ARGS]

Runs the default through launch.sh (2 CPU ranks unless NPROC is set; ARGS are added to both runs) twice: once
uninterrupted, once with --faults real faults drawn at random (seeded): each a kind (SIGKILL, SIGSTOP, a sleep without
end), a stage of a step, a rank, and the attempt it strikes (the n-th fault the n-th attempt, at a later step than
the one before, so that every restart meets the next fault; lib/inject.py). trainer.max_restarts is the number of
faults and trainer.hang_timeout_s 30. Reported: faults injected / survived (the run ended 0 having restarted once per
fault) / metrics identical (every step's metrics equal the uninterrupted run's, timing, memory and the fault counters
aside), each restart's cause and steps redone (faults.jsonl), and both runs' wall time. ``--out`` (default
bench/faults_result.json) is written after each run: a benchmark stopped at any moment leaves its figures so far;
each run's log is in its run folder's parent (``<root>/<name>.log``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.launched import launch  # noqa: E402
KINDS = ("kill", "stop", "hang")
STAGES = ("step/rollout", "step/score", "step/log_probs", "step/update")
NOT_COMPARED = ("timing/", "perf/", "memory/", "sync/seconds", "sync/s_per_gb", "fault/")


def draw(n: int, steps: int, ranks: int, seed: int) -> list[str]:
    """``n`` faults at increasing steps in 2..steps, the i-th in attempt i."""
    rng = random.Random(seed)
    at = sorted(rng.sample(range(2, steps + 1), n))
    return [f"{rng.choice(KINDS)}:{rng.choice(STAGES)}:{step}:{rng.randrange(ranks)}:{i}" for i, step in enumerate(at)]


def rows(folder: str) -> list[dict]:
    try:
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            return [{k: v for k, v in json.loads(line).items() if not k.startswith(NOT_COMPARED)} for line in f]
    except OSError:
        return []


def main(argv: list[str]) -> int:
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--faults", type=int, default=4)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--root", default=os.path.join(ROOT, "runs", "faults"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "faults_result.json"))
    a = p.parse_args(own)
    if not 1 <= a.faults <= a.steps - 1:
        p.error(f"--faults {a.faults}: between 1 and --steps - 1 ({a.steps - 1}), one step each")
    ranks = int(os.environ.get("NPROC", "2"))
    faults = draw(a.faults, a.steps, ranks, a.seed)
    args = ["--trainer.total_steps", str(a.steps), "--trainer.save_every", "2", "--trainer.log_samples", "0",
            "--trainer.max_restarts", str(a.faults), "--trainer.hang_timeout_s", "30", "--trainer.no-resume", *extra]
    result: dict = {"faults": faults, "args": args, "ranks": ranks}

    def write() -> None:
        with open(a.out + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(a.out + ".tmp", a.out)

    stamp = time.strftime("%Y%m%d-%H%M%S")
    whole, faulted = f"whole-{stamp}", f"faulted-{stamp}"
    result["uninterrupted"] = launch(a.root, whole, args, {})
    write()
    result["faulted"] = launch(a.root, faulted, args, {"SPMD_RL_TEST_FAULT": ",".join(faults)})
    try:
        with open(os.path.join(a.root, faulted, "faults.jsonl")) as f:
            records = [json.loads(line) for line in f]
    except OSError:
        records = []
    result["restarts"] = [{k: r[k] for k in ("restart", "cause", "failed_after_step", "resumed_from", "steps_redone")}
                          for r in records]
    got, want = rows(os.path.join(a.root, faulted)), rows(os.path.join(a.root, whole))
    differ = sorted({g["step"] for g, w in zip(got, want) if g != w} | ({-1} if len(got) != len(want) else set()))
    survived = result["faulted"]["exit"] == 0 and len(records) == a.faults
    result["summary"] = {"injected": a.faults, "survived": a.faults if survived else len(records),
                         "metrics_identical": bool(got) and not differ, "steps_differing": differ,
                         "steps_redone": sum(r["steps_redone"] for r in records),
                         "extra_wall_s": round(result["faulted"]["wall_s"] - result["uninterrupted"]["wall_s"], 1)}
    write()
    s = result["summary"]
    print(f"faults injected {s['injected']} / survived {s['survived']} / metrics identical {s['metrics_identical']}; "
          f"steps redone {s['steps_redone']}; the faults cost {s['extra_wall_s']} s over "
          f"{result['uninterrupted']['wall_s']} s ({a.out})")
    for r in result["restarts"]:
        print(f"  restart {r['restart']}: after step {r['failed_after_step']}, from step {r['resumed_from']}: "
              f"{r['cause'][:160]}")
    return 0 if survived and s["metrics_identical"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
