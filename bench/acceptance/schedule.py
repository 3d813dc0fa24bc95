"""Which check runs when: each in a child process of its own session; alone, the timed ones (their figures are times
or device-memory readings) and, on a GPU, every one that runs a vLLM engine; the others side by side in lanes whose
device memory is counted in bytes; each within its budget, stopped with SIGTERM a grace before it ends (the check
writes the rows of what it measured, a training child finishes its step) and killed, its whole process tree, at the
end. The report is written after every check."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

from bench.acceptance.common import (CHILD_GRACE_S, ROOT, Row, Stopped, failure_note, has_vllm, log_tail,
                                     result_path, stop_held, stop_on)
from bench.acceptance.report import report, save_result

# Checks whose figures are times or device-memory readings: alone on the GPU.
TIMED = ("correctness", "sleep_wake", "rollout", "grpo_vllm", "grpo_hf", "update", "trl", "partial", "levers")
# Checks that run a vLLM engine (ours, TRL's, the judge's child): alone on a GPU as well, whatever --lanes says.
# vLLM 0.25 reads the device's free memory, which other processes move: Worker.sleep asserts that it grew across the
# release, with no retry ("Memory usage increased after sleeping", v1/worker/gpu_worker.py:200-210), and an engine's
# start wants gpu_memory_utilization x the device free (utils.py:405-425). A lane's allocation inside a sleep's window
# (its step re-allocating after empty_cache, its engine's wake mapping GBs, a CUDA context) fails the first whatever
# memory share each holds: a lower rollout.gpu_memory_utilization would fix only the start. The toy rows free a few
# MB a sleep and would fail first, at random, looking like an engine bug (review 2026-11-29 (e3)). The cost: the
# feature rows run one after another (~1100 s, not ~400 s in lanes of four; bench/README.md, the window's schedule).
VLLM_ENGINE = ("correctness", "sleep_wake", "lora_sleep", "rollout", "grpo_vllm", "grpo_lora_vllm", "ppo", "distill",
               "trl", "tools", "agents", "vision", "qwen3_5", "gemma4", "moe", "judge", "partial")
# What the others hold on a GPU at most, in GiB (weights, gradients, Adam, the engine's weights and its KV cache
# sized in bytes by lib.engine.plan_kv_cache, activations), from the 0.5B shape's ~15 GiB a GRPO run on the H100
# (2026-11-27) and the models' sizes; lanes start a check only where the sum fits --gpu-gib. On a GPU every check
# below runs a vLLM engine today (VLLM_ENGINE: alone), so there the sizes bind only a check that runs none.
GPU_GIB = {"lora_sleep": 8, "grpo_lora_vllm": 14, "ppo": 20, "distill": 26, "tools": 3, "agents": 3, "vision": 3,
           "qwen3_5": 8, "gemma4": 10, "moe": 12, "judge": 24}


def cannot_run(name: str, args) -> list[Row]:
    """The rows of a check that cannot run here, known before it starts (none: it can)."""
    if name == "sleep_wake" and (args.device != "cuda" or not has_vllm()):
        return [Row("sleep/wake", "not run", "", None, "needs vLLM's sleep mode on a GPU (the CPU build has none)")]
    if name == "lora_sleep" and not has_vllm():
        return [Row("LoRA after a level-1 sleep", "not run", "", None, "vLLM is not installed here")]
    if name == "rollout" and not has_vllm():
        return [Row("rollout: engine / bare LLM.generate tokens/s", "not run", ">= 0.95x", None,
                    "vLLM is not installed here")]
    if name in ("grpo_vllm", "grpo_lora_vllm") and not has_vllm():
        return [Row(name.replace("_", " ") + " engine", "not run", "", None, "vLLM is not installed here")]
    return []


@dataclass
class Running:
    proc: subprocess.Popen
    log: str
    started: float  # perf_counter
    budget: float
    since: float  # the epoch second it started (the report's interval)
    termed: float = 0.0  # perf_counter when SIGTERM was sent (0: not yet)


def launch(name: str, args, budget: float) -> Running:
    """``name`` in a child process of its own session (torchrun's workers with it), its output into checks/NAME.log."""
    rows_file = result_path(args.out, name, child=True)
    if os.path.exists(rows_file):
        os.remove(rows_file)
    cmd = [sys.executable, os.path.join(ROOT, "bench", "gpu_acceptance.py"), "--check", name, "--out", args.out,
           "--device", args.device]
    if args.grpo_steps:
        cmd += ["--grpo-steps", str(args.grpo_steps)]
    log = os.path.join(args.out, "checks", f"{name}.log")
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    return Running(proc, log, time.perf_counter(), budget, time.time())


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (read from /proc): torchrun starts its workers in sessions of their own, out of
    reach of a signal to the check's process group."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    tree, todo = [], [pid]
    while todo:
        p = todo.pop()
        tree.append(p)
        todo += children.get(p, [])
    return tree


def terminate(run: Running) -> None:
    """SIGTERM to the check's process group (the check writes its rows; torchrun passes it to its workers)."""
    if not run.termed:
        run.termed = time.perf_counter()
        try:
            os.killpg(run.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass


def kill(run: Running) -> None:
    """SIGKILL to the check's whole process tree and its group, then reaped."""
    for pid in process_tree(run.proc.pid):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        os.killpg(run.proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    run.proc.wait()


def collect(name: str, args, run: Running) -> tuple[list[Row], float, bool]:
    """An ended check's rows: (rows, seconds, whether it ran to its end). A stopped check's rows are those it wrote
    when the SIGTERM reached it (what it measured), or one row with its log's last lines."""
    took = time.perf_counter() - run.started
    rows_file = result_path(args.out, name, child=True)
    stopped = bool(run.termed)
    if os.path.exists(rows_file):
        said = json.load(open(rows_file))
        rows, whole = [Row(**r) for r in said["rows"]], said["whole"] and run.proc.returncode == 0
        if stopped:
            rows.insert(0, Row(name, "stopped by its budget", f"<= {run.budget:.0f} s", None if whole else False,
                               f"SIGTERM after {run.termed - run.started:.0f} s; " + (
                                   "after every step of its runs: its figures are whole" if whole
                                   else "the rows below are what it measured")))
        return rows, took, whole
    if stopped:
        return [Row(name, "over budget", f"<= {run.budget:.0f} s", False,
                    f"stopped after {took:.0f} s; its log's last lines: {log_tail(run.log)}")], took, False
    said = open(run.log, errors="replace").read()
    oom = "out of memory" in said.lower()
    return [Row(name, "crashed" + (" (OOM)" if oom else ""), "", False,
                f"exit {run.proc.returncode}: {failure_note(said)}")], took, True


def missing(out: str, names: list[str]) -> list[str]:
    """Those of ``names`` without a complete result in ``out`` (never run, or stopped or left out by a budget)."""
    return [n for n in names if not os.path.exists(result_path(out, n))
            or not json.load(open(result_path(out, n))).get("complete", True)]


def alone(name: str, args) -> bool:
    """Whether ``name`` runs with no other check beside it: a timed check; on a GPU, a check with a vLLM engine."""
    return name in TIMED or (args.device == "cuda" and name in VLLM_ENGINE)


def fits(name: str, running: dict[str, Running], args) -> bool:
    """Whether ``name`` may start beside ``running``: a timed check, or a vLLM engine's on a GPU, alone (``alone``);
    the others up to --lanes at once, their device memory (GPU_GIB) within --gpu-gib on a GPU."""
    if not running:
        return True
    if alone(name, args) or any(alone(n, args) for n in running) or len(running) >= args.lanes:
        return False
    if args.device != "cuda":
        return True
    return sum(GPU_GIB.get(n, args.gpu_gib) for n in [*running, name]) <= args.gpu_gib


def run_all(args, names: list[str]) -> None:
    """Every check of ``names`` in order, each within its budget and the run's, the report after each one. A SIGTERM
    (or SIGINT, SIGHUP) to this process stops the checks running then as their budgets would (their rows kept) and
    exits with 128 + the signal."""
    start, pending, running, finished = time.perf_counter(), list(names), {}, 0
    grace = min(CHILD_GRACE_S[args.device] + 5, args.check_budget_s / 2)  # SIGTERM to SIGKILL
    stop = stop_on(signal.SIGTERM, signal.SIGINT, signal.SIGHUP)

    def finish(name: str, rows: list[Row], secs: float, complete: bool, since: float = 0.0) -> None:
        nonlocal finished
        finished += 1
        save_result(args, name, rows, secs, complete, since)
        report(args, f"{time.perf_counter() - start:.0f} s in this run ({'all' if finished == len(names) else finished}"
               f" of {len(names)} checks); budget {args.budget_s:.0f} s, {args.check_budget_s:.0f} s a check, "
               f"{args.lanes} lane(s)")
        print(f"{name} ({secs:.0f} s): " + "; ".join(f"{r.figure} = {r.value}" for r in rows), flush=True)

    try:
        while pending or running:
            now = time.perf_counter()
            for name, run in list(running.items()):  # the ended, the due for SIGTERM and the due for SIGKILL
                if run.proc.poll() is None and now - run.started > run.budget - grace:
                    terminate(run)
                if run.proc.poll() is None and now - run.started > run.budget:
                    kill(run)
                if run.proc.poll() is not None:
                    with stop_held(stop):  # an ended check is reported whole, a stop or not
                        del running[name]
                        finish(name, *collect(name, args, run), run.since)
            while pending:  # start what may start
                name = pending[0]
                left = args.budget_s - (time.perf_counter() - start)
                if rows := cannot_run(name, args):  # reported without a process or a budget
                    pending.pop(0)
                    finish(name, rows, 0.0, True)
                elif left <= grace:
                    pending.pop(0)
                    finish(name, [Row(name, "not run", "", False, f"the run's budget ({args.budget_s:.0f} s) was "
                                      "spent")], 0.0, False)
                elif fits(name, running, args):
                    with stop_held(stop):  # a stop now finds the check started and recorded, or neither
                        running[pending.pop(0)] = launch(name, args, min(args.check_budget_s, left))
                else:
                    break
            if running:
                time.sleep(0.2)
    except Stopped:  # stopped from outside: the running checks as at their budgets, then out
        for run in running.values():
            terminate(run)
        deadline = time.perf_counter() + grace
        while any(r.proc.poll() is None for r in running.values()) and time.perf_counter() < deadline:
            time.sleep(0.2)
        for name, run in list(running.items()):
            if run.proc.poll() is None:
                kill(run)
            finish(name, *collect(name, args, run), run.since)
        sys.exit(128 + stop[0])
    print(f"report: {os.path.join(args.out, 'acceptance.md')}")
