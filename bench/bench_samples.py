"""What keeping samples costs a step (issue 77): the default run with the samples kept at the default share against the
same run keeping none, and the keeping's own time.

    python bench/bench_samples.py [--steps 12] [--rounds 2] [--root runs/bench_samples] [--out FILE] [-- ARGS]

Runs the default through launch.sh (2 CPU ranks unless NPROC is set; ARGS added to every run) ``--rounds`` times in
each setting, alternating (kept, none, kept, none, ...) so that the machine's drift falls on both. Reported, over the
steps after the first: each setting's mean step time (timing/step_s), their ratio, the keeping's own seconds a step
(timing/samples_s: making the records, gathering them over the ranks, writing the file; logged with the next step;
the first step's apart, as it loads the parquet writer once a run) and its share of the kept run's step (the goal:
< 3%), and the files' size a step. ``--out`` (default bench/samples_result.json) is
written after each run; each run's log is in ``<root>/<name>.log``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.launched import launch, steps_after_the_first  # noqa: E402
SETTINGS = {"kept": [], "none": ["--samples.share", "0"]}


def summary(folder: str) -> dict:
    rows = steps_after_the_first(folder, "timing/step_s")
    if not rows:
        return {}
    out = {"steps": len(rows), "step_s": statistics.mean(r["timing/step_s"] for r in rows)}
    # the keeping's time is logged with the next step: rows[0] (step 2) holds step 1's, which loads pyarrow's
    # parquet writer (0.3-0.4 s, once a run)
    kept = [r["timing/samples_s"] for r in rows[1:] if "timing/samples_s" in r]
    files = os.path.join(folder, "samples")
    if kept and os.path.isdir(files):
        out["samples_s"] = statistics.mean(kept)
        out["samples_first_s"] = rows[0]["timing/samples_s"]
        out["file_kb_per_step"] = statistics.mean(os.path.getsize(os.path.join(files, f))
                                                  for f in os.listdir(files)) / 1024
    return out


def main(argv: list[str]) -> int:
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--root", default=os.path.join(ROOT, "runs", "bench_samples"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "samples_result.json"))
    a = p.parse_args(own)
    args = ["--trainer.total_steps", str(a.steps), "--trainer.val_every", "0", "--trainer.save_every", "0",
            "--trainer.log_samples", "0", *extra]
    result: dict = {"steps": a.steps, "args": args, "runs": {}}

    def write() -> None:
        with open(a.out + ".tmp", "w") as f:
            json.dump(result, f, indent=1)
        os.replace(a.out + ".tmp", a.out)

    for k in range(a.rounds):
        for setting, more in SETTINGS.items():
            name = f"{setting}_{k}"
            run = launch(a.root, name, [*args, *more])
            run.update(summary(os.path.join(a.root, name)))
            result["runs"][name] = run
            print(name, json.dumps(run), flush=True)
            done = {s: [r for n, r in result["runs"].items() if n.startswith(s) and "step_s" in r] for s in SETTINGS}
            if all(done.values()):
                step = {s: statistics.mean(r["step_s"] for r in rs) for s, rs in done.items()}
                keep_s = statistics.mean(r["samples_s"] for r in done["kept"])
                result.update({"step_s_kept": step["kept"], "step_s_none": step["none"],
                               "ratio_kept_vs_none": step["kept"] / step["none"], "samples_s": keep_s,
                               "samples_share_of_step": keep_s / step["kept"],
                               "file_kb_per_step": statistics.mean(r["file_kb_per_step"] for r in done["kept"])})
            write()
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}, indent=1))
    return 0 if all(r["exit"] == 0 for r in result["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
