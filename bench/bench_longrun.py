"""A run's health over time, measured while it runs: what to run before a week-long job (issue 64).

    python bench/bench_longrun.py --run-dir runs/health [--every 5] [--out health.json] -- ARGS
    # ARGS: launch.sh's, e.g. train_grpo.py --trainer.total_steps 3000 --trainer.save_every 100

Starts ``bash launch.sh ARGS`` with the run folder ``--run-dir`` (the benchmark adds ``--trainer.output_root`` and
``--trainer.run_name``: leave them out of ARGS) and, every ``--every`` seconds, reads every process of the run from
/proc (launch.sh, torchrun, the ranks, the reward workers, an engine's): resident memory and how many are alive.
When the run ends (or the benchmark is stopped: Ctrl-C or SIGTERM, passed on to the run, whose ranks save and exit)
it prints, per kind of process, resident memory at the first and the last sample and its peak; the processes alive,
first, last and most; the seconds a step, the mean of the first 10% of steps against the last 10% (the drift); the
run folder's size and the checkpoints kept. ``--out`` holds every sample and the summary, written after each sample:
a benchmark stopped at any moment leaves its figures so far. Figures, not verdicts: the test command runs it on a
short run (tests/test_longrun.py) and checks that the figures are there and sane.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.acceptance.schedule import process_tree  # noqa: E402 (a process and its descendants, from /proc)
KINDS = (("check", ("lib.check",)), ("torchrun", ("torch.distributed.run", "torchrun")),
         ("rank", ("train_grpo.py", "train_ppo.py", "runs_driver.py")), ("reward worker", ("lib.rewards.worker",)),
         ("launch.sh", ("launch.sh",)))  # the first that matches: lib.check's and torchrun's command lines name the
# script too


def kind(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
    return next((name for name, marks in KINDS if any(m in cmd for m in marks)), "other")


def rss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return 0.0


def sample(root: int, t0: float, run_dir: str) -> dict:
    """Every live process of the run (its kind and resident MiB), and the steps the run has logged."""
    procs = [(kind(p), rss_mib(p)) for p in process_tree(root)]
    procs = [(k, m) for k, m in procs if k and m > 0]
    by_kind: dict[str, list[float]] = {}
    for k, m in procs:
        by_kind.setdefault(k, []).append(m)
    return {"t": time.monotonic() - t0, "step": len(step_seconds(run_dir)), "alive": len(procs),
            "rss_mib": {k: sorted(v) for k, v in by_kind.items()}}


def step_seconds(run_dir: str) -> list[float]:
    """Each logged training step's seconds (metrics.jsonl's timing/step_s)."""
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            return [r["timing/step_s"] for r in map(json.loads, f) if "timing/step_s" in r]
    except (OSError, ValueError):
        return []


def folder_mib(path: str) -> float:
    total = 0
    for base, _, files in os.walk(path):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(base, name))
            except OSError:
                pass
    return total / 2**20


def summarize(samples: list[dict], run_dir: str) -> dict:
    out: dict = {"samples": len(samples), "seconds": samples[-1]["t"] if samples else 0.0}
    steps = step_seconds(run_dir)
    # while it trains: from its first step logged to its last (start-up and the ranks' exit are not the run)
    running = [s for s in samples if 1 <= s["step"] < len(steps)] or [s for s in samples if s["step"] >= 1]
    if running:
        first, last = running[0], running[-1]
        kinds = sorted({k for s in samples for k in s["rss_mib"]})
        out["rss_mib"] = {k: {"first": max(first["rss_mib"].get(k, [0.0])), "last": max(last["rss_mib"].get(k, [0.0])),
                              "peak": max(max(s["rss_mib"].get(k, [0.0])) for s in running)} for k in kinds}
        out["alive"] = {"first": first["alive"], "last": last["alive"], "most": max(s["alive"] for s in running)}
        out["first_sample_step"], out["last_sample_step"] = first["step"], last["step"]
    out["steps"] = len(steps)
    if len(steps) >= 10:
        tenth = len(steps) // 10
        early, late = sum(steps[:tenth]) / tenth, sum(steps[-tenth:]) / tenth
        out["step_s"] = {"first_10pct": early, "last_10pct": late, "drift": late / max(early, 1e-9)}
    checkpoints = os.path.join(run_dir, "checkpoints")
    out["run_folder_mib"] = folder_mib(run_dir)
    out["checkpoints_kept"] = len([d for d in os.listdir(checkpoints) if d.startswith("step_")]) \
        if os.path.isdir(checkpoints) else 0
    return out


def report(s: dict) -> None:
    print(f"run health over {s['seconds']:.0f} s ({s['samples']} samples, {s['steps']} steps; processes from the "
          f"sample at step {s.get('first_sample_step', '-')} to the one at step {s.get('last_sample_step', '-')}):")
    for k, r in s.get("rss_mib", {}).items():
        print(f"  {k:13s} resident MiB (largest of its kind): first {r['first']:.0f}, last {r['last']:.0f}, "
              f"peak {r['peak']:.0f}")
    if "alive" in s:
        a = s["alive"]
        print(f"  processes alive: first {a['first']}, last {a['last']}, most {a['most']}")
    if "step_s" in s:
        d = s["step_s"]
        print(f"  seconds a step: first 10% {d['first_10pct']:.3f}, last 10% {d['last_10pct']:.3f} "
              f"(drift {d['drift']:.2f}x)")
    print(f"  run folder {s['run_folder_mib']:.1f} MiB, {s['checkpoints_kept']} checkpoints kept")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--run-dir", required=True, help="the run folder (made by the run)")
    ap.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    ap.add_argument("--out", default="", help="JSON of every sample and the summary, rewritten after each sample")
    ap.add_argument("args", nargs=argparse.REMAINDER, help="-- then launch.sh's arguments")
    a = ap.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    if not args:
        ap.error("give launch.sh's arguments after --, e.g. -- train_grpo.py --trainer.total_steps 3000")
    run_dir = os.path.abspath(a.run_dir)
    cmd = ["bash", os.path.join(ROOT, "launch.sh"), *args, "--trainer.output_root", os.path.dirname(run_dir),
           "--trainer.run_name", os.path.basename(run_dir)]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    signal.signal(signal.SIGTERM, lambda *_: proc.send_signal(signal.SIGTERM))  # the run saves and exits
    signal.signal(signal.SIGINT, lambda *_: proc.send_signal(signal.SIGINT))
    t0, samples = time.monotonic(), []
    while True:
        samples.append(sample(proc.pid, t0, run_dir))
        if a.out:
            with open(a.out + ".tmp", "w") as f:
                json.dump({"command": cmd, "summary": summarize(samples, run_dir), "samples": samples}, f)
            os.replace(a.out + ".tmp", a.out)
        try:
            code = proc.wait(timeout=a.every)
            break
        except subprocess.TimeoutExpired:
            continue
    summary = summarize(samples, run_dir)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": cmd, "exit": code, "summary": summary, "samples": samples}, f)
    report(summary)
    return code


if __name__ == "__main__":
    sys.exit(main())
