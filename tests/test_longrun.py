"""bench/bench_longrun.py (issue 64, 3) on a short run of the default preset through launch.sh: the figures a user
reads before a week-long job are all there (every process's resident memory, the processes alive, the step time's
drift, the run folder's size and checkpoints), and the JSON holds them. Figures, not verdicts: a 12-step run's
drift says nothing of a week's."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.helpers import ROOT


def test_the_long_run_benchmark_reports_every_figure(tmp_path):
    out = tmp_path / "health.json"
    proc = subprocess.run([sys.executable, "bench/bench_longrun.py", "--run-dir", str(tmp_path / "run"), "--every",
                           "0.5", "--out", str(out), "--", "train_grpo.py", "--trainer.total_steps", "12",
                           "--trainer.save_every", "5", "--trainer.val_every", "0", "--trainer.log_samples", "0",
                           "--trainer.keep_last", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900,
                          env={**__import__("os").environ, "NPROC": "2", "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    s = json.loads(out.read_text())["summary"]
    assert s["steps"] == 12 and s["samples"] >= 2, s
    assert s["rss_mib"]["rank"]["first"] > 50 and s["rss_mib"]["rank"]["peak"] >= s["rss_mib"]["rank"]["last"] > 50
    assert s["alive"]["most"] >= 4, s  # launch.sh, torchrun, two ranks (and their reward workers)
    assert s["step_s"]["first_10pct"] > 0 and s["step_s"]["drift"] > 0, s
    assert s["checkpoints_kept"] == 2 and s["run_folder_mib"] > 0, s  # steps 10 and 12 (keep_last 2)
    for line in ("resident MiB", "processes alive", "seconds a step", "checkpoints kept"):
        assert line in proc.stdout, proc.stdout
