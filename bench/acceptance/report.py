"""The acceptance report: every check's result in the folder (this run's and earlier runs'), with the timed rows of a
check that shared the GPU with another check (or with the gpu-marked tests) voided; and the evidence archive, one
file that brings back every log, every run's metrics and the profiles (a call to the GPU machine returns 8 files)."""

from __future__ import annotations

import glob
import io
import json
import os
import tarfile
import time
from dataclasses import asdict

import torch

from bench.acceptance.common import CHECKS, Row, result_path

ACTIVITIES = "activities.jsonl"
"""Other GPU work in the folder (one JSON line each: {"name", "interval": [start, end]}, epoch seconds): the session
writes the gpu-marked tests' run there, so a timed check that ran beside them is voided as well."""
ARCHIVE = "evidence.tar.gz"
ARCHIVE_FILE_BYTES = 2 * 2**20  # the tail kept of each file (a log that ran away stays readable)


def command(args) -> str:
    return f"python bench/gpu_acceptance.py --out {args.out} --device {args.device}"


def device_name(args) -> str:
    return torch.cuda.get_device_name() if args.device == "cuda" else "cpu"


def save_result(args, name: str, rows: list[Row], seconds: float, complete: bool, since: float = 0.0) -> None:
    """``complete``: the check ran to its end (or cannot run here); False: its budget stopped it or left it out, and a
    later run with --missing runs it again. ``since``: when its process started (epoch seconds; 0: none ran)."""
    with open(result_path(args.out, name), "w") as f:
        json.dump({"seconds": seconds, "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "device": device_name(args),
                   "command": command(args), "complete": complete, "interval": [since, time.time()] if since else None,
                   "rows": [asdict(r) for r in rows]}, f)


def saved_results(out: str) -> dict[str, dict]:
    """Every check's result in the folder, this run's and earlier runs', in the order of CHECKS."""
    return {n: json.load(open(result_path(out, n))) for n in CHECKS if os.path.exists(result_path(out, n))}


def activities(out: str) -> dict[str, list[float]]:
    path = os.path.join(out, ACTIVITIES)
    if not os.path.exists(path):
        return {}
    lines = [json.loads(ln) for ln in open(path) if ln.strip()]
    return {a["name"]: a["interval"] for a in lines if a.get("interval")}


def overlaps(results: dict[str, dict], other: dict[str, list[float]]) -> dict[str, list[str]]:
    """For each check that ran, the other checks and activities whose run intervals intersect its own."""
    spans = {n: r["interval"] for n, r in results.items() if r.get("interval")} | other
    return {n: [m for m, (a1, b1) in spans.items() if m != n and a1 < b0 and a0 < b1]
            for n, (a0, b0) in ((n, r["interval"]) for n, r in results.items() if r.get("interval"))}


def verdict(row: dict, shared: list[str]) -> tuple[str, str]:
    """A row's result and note in the report: a timed row (a time or a memory reading) of a check that shared the GPU
    is void, whatever it measured."""
    if row.get("timed") and shared:
        return "void", f"VOID: ran beside {', '.join(shared)}; " + row["note"]
    return {True: "pass", False: "FAIL", None: "-"}[row["passed"]], row["note"]


def report(args, note: str) -> None:
    """acceptance.md and acceptance.json from every result in the folder, and the evidence archive, into --out and
    --mirror."""
    results = saved_results(args.out)
    shared = overlaps(results, activities(args.out))
    table = ["| check | figure | value | goal | result | note |", "|---|---|---|---|---|---|"]
    for name, res in results.items():
        for r in res["rows"]:
            result, text = verdict(r, shared.get(name, []))
            r["result"] = result
            table.append(f"| {name} ({res['seconds']:.0f} s) | {r['figure']} | {r['value']} | {r['goal']} | "
                         f"{result} | {text.replace('|', '/')} |")
    runs = sorted({(res["command"], res["device"]) for res in results.values()})
    head = [f"# Acceptance run, {time.strftime('%Y-%m-%d %H:%M')}, {device_name(args)}", ""]
    head += [f"Command: `{c}` ({d})" for c, d in runs] + [""]
    ran_beside = [f"{n}: {', '.join(v)}" for n, v in shared.items() if v]
    tail = ["", note, "", f"Checks that shared the GPU (their timed rows void): {'; '.join(ran_beside) or 'none'}",
            f"Logs, metrics and profiles: {ARCHIVE} (tar -xzf)", ""]
    text = "\n".join(head + table + tail)
    payload = {"device": device_name(args), "command": command(args), "note": note, "overlaps": shared,
               "checks": results}
    archive = evidence(args.out)
    for folder in [args.out] + ([args.mirror] if args.mirror else []):
        os.makedirs(folder, exist_ok=True)
        files = (("acceptance.md", text.encode()), ("acceptance.json", json.dumps(payload, indent=1).encode()),
                 (ARCHIVE, archive))
        for name, data in files:
            with open(os.path.join(folder, name + ".part"), "wb") as f:
                f.write(data)
            os.replace(os.path.join(folder, name + ".part"), os.path.join(folder, name))


EVIDENCE = ("*.log", "*.txt", "checks/*.log", "checks/*.txt", "checks/*.json", "runs/*.log", "runs/*/metrics.jsonl",
            "runs/*/timings.json")
"""What the archive holds, relative to the folder: the session's own logs, each check's log, result and profile,
every run's log and metrics (and TRL's timings); not the models, staged packages, toy assets or checkpoints."""


def evidence_files(out: str) -> list[str]:
    return sorted({os.path.relpath(p, out) for pattern in EVIDENCE for p in glob.glob(os.path.join(out, pattern))})


def evidence(out: str) -> bytes:
    """The archive's bytes (gzip'd tar); each file's last ARCHIVE_FILE_BYTES."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for rel in evidence_files(out):
            try:
                with open(os.path.join(out, rel), "rb") as f:
                    f.seek(0, os.SEEK_END)
                    size = f.tell()
                    f.seek(max(0, size - ARCHIVE_FILE_BYTES))
                    data = f.read()
            except OSError:
                continue
            info = tarfile.TarInfo(rel)
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()
