"""Curves of a run: ``python -m lib.plot RUN_DIR`` writes RUN_DIR/plots/*.png from metrics.jsonl."""

from __future__ import annotations

import json
import os
import sys

GROUPS = {
    "reward": ["reward/mean", "val/mean@1", "val/score_mean", "val/best@N", "val/maj@N"],
    "length": ["response/length_mean", "response/length_max", "response/clip_ratio"],
    "kl": ["actor/kl_loss", "actor/ppo_kl", "algorithm/kl_in_reward", "algorithm/kl_coef"],
    "entropy": ["actor/entropy"],
    "time": ["timing/step_s", "timing/rollout_s", "timing/update_s", "timing/log_probs_s"],
}


def plot(run: str) -> list[str]:
    import matplotlib  # deferred: an optional package, needed only to draw

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = os.path.join(run, "metrics.jsonl")
    if not os.path.isfile(path):
        raise SystemExit(f"{path} not found: point lib.plot at a run folder")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    os.makedirs(os.path.join(run, "plots"), exist_ok=True)
    written = []
    for name, keys in GROUPS.items():
        fig, ax = plt.subplots(figsize=(6, 3.5))
        drawn = 0
        for key in keys:
            pts = [(r["step"], r[key]) for r in rows if key in r]
            if pts:
                ax.plot(*zip(*pts), marker="o" if len(pts) < 30 else None, markersize=3, label=key)
                drawn += 1
        if drawn:
            ax.set_xlabel("step")
            ax.set_title(name)
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            out = os.path.join(run, "plots", f"{name}.png")
            fig.tight_layout()
            fig.savefig(out, dpi=100)
            written.append(out)
        plt.close(fig)
    return written


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m lib.plot RUN_DIR")
    for p in plot(sys.argv[1]):
        print(p)
