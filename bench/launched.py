"""What the benchmarks that time whole runs share: a run through launch.sh with its log kept, and a run's steps after
the first (warm-up) from its metrics.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def launch(root: str, name: str, args: list[str], extra_env: dict[str, str] | None = None) -> dict:
    """train_grpo.py through launch.sh (2 CPU ranks unless NPROC is set) as the run ``name`` in ``root``, its log in
    ``<root>/<name>.log``: its exit code and wall time."""
    os.makedirs(root, exist_ok=True)
    t0 = time.monotonic()
    with open(os.path.join(root, f"{name}.log"), "w") as log:
        code = subprocess.call(["bash", "launch.sh", "train_grpo.py", "--trainer.output_root", root,
                                "--trainer.run_name", name, *args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                               env={**os.environ, "NPROC": os.environ.get("NPROC", "2"), **(extra_env or {})})
    return {"exit": code, "wall_s": round(time.monotonic() - t0, 1)}


def steps_after_the_first(folder: str, key: str) -> list[dict]:
    """The run's metric rows that hold ``key`` (its training steps), the first (warm-up) left out; none if the run
    left no metrics."""
    try:
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            return [r for r in map(json.loads, f) if key in r][1:]
    except OSError:
        return []
