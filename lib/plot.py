"""Curves of a run: ``python -m lib.plot RUN_DIR`` writes RUN_DIR/plots/*.png from metrics.jsonl."""

from __future__ import annotations

import os
import sys

from lib.view.read import Metrics

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

    metrics = Metrics(run)
    if not os.path.isfile(metrics.path):
        raise SystemExit(f"{metrics.path} not found: point lib.plot at a run folder")
    metrics.update()
    os.makedirs(os.path.join(run, "plots"), exist_ok=True)
    written = []
    for name, keys in GROUPS.items():
        fig, ax = plt.subplots(figsize=(6, 3.5))
        drawn = 0
        curves = metrics.curves(keys)
        for key in keys:
            pts = curves.get(key)
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
