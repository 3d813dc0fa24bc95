"""The agent path against the multi-turn loop on the same task (issue 75): samples per second of the rollout stage,
same ranks, same engine, same policy, same budgets.

    python bench/bench_agents.py [--steps 6] [--root runs/bench_agents] [--out FILE] [-- ARGS]

Runs the toy tool task twice through launch.sh (2 CPU ranks unless NPROC is set; ARGS added to both): the multi-turn
preset (configs/tiny_cpu_grpo_tools.yaml: the loop drives the turns and runs the tool) and the agent preset
(configs/tiny_cpu_grpo_agent.yaml: an openai-SDK agent per sample drives them through the rank's endpoint). Reported,
over the steps after the first (warm-up): the rollout stage's samples/s of each (timing/rollout_s: wake, sync,
generation, sleep), their ratio (the goal: >= 0.8), and the agent path's split: the engine's seconds, the rest per call
(HTTP, rendering, the agents' own work, waiting for a round), rounds and requests per round. ``--out`` (default
bench/agents_result.json) is written after each run; each run's log is in ``<root>/<name>.log``.
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
RUNS = {"multi_turn": "configs/tiny_cpu_grpo_tools.yaml", "agent": "configs/tiny_cpu_grpo_agent.yaml"}


def summary(folder: str, samples_per_step: int) -> dict:
    rows = steps_after_the_first(folder, "actor/pg_loss")
    if not rows:
        return {}
    mean = lambda k: statistics.fmean(r[k] for r in rows if k in r) if any(k in r for r in rows) else None  # noqa: E731
    out = {"steps": len(rows), "rollout_s": mean("timing/rollout_s"), "reward": mean("reward/mean"),
           "logp_abs_diff": max(r.get("rollout/logp_abs_diff", 0.0) for r in rows)}
    out["samples_per_s"] = samples_per_step / out["rollout_s"]
    for key in ("timing/agent_rollout_s", "timing/agent_engine_s", "perf/agent_overhead_ms_per_call", "agent/rounds",
                "agent/requests_per_round", "agent/calls_mean", "multi_turn/turns_mean", "timing/multi_turn_generate_s"):
        if mean(key) is not None:
            out[key] = mean(key)
    return out


def main(argv: list[str]) -> int:
    own, extra = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--root", default=os.path.join(ROOT, "runs", "bench_agents"))
    p.add_argument("--out", default=os.path.join(ROOT, "bench", "agents_result.json"))
    a = p.parse_args(own)
    samples = 64 * 8  # the presets' train_batch_size x rollout.n
    result: dict = {"steps": a.steps, "args": extra, "runs": {}}
    for name, preset in RUNS.items():
        launched = launch(a.root, name, ["--config", preset, "--trainer.total_steps", str(a.steps),
                                         "--trainer.val_every", "0", *extra])
        result["runs"][name] = {**launched, **summary(os.path.join(a.root, name), samples)}
        runs = result["runs"]
        if all(runs.get(k, {}).get("samples_per_s") for k in RUNS):
            result["ratio_agent_vs_multi_turn"] = runs["agent"]["samples_per_s"] / runs["multi_turn"]["samples_per_s"]
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)
        print(json.dumps({name: result["runs"][name]}), flush=True)
    print(f"agent / multi-turn rollout samples/s: {result.get('ratio_agent_vs_multi_turn', float('nan')):.3f} "
          f"(goal >= 0.8); {a.out}")
    return 0 if all(r["exit"] == 0 for r in result["runs"].values()) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
