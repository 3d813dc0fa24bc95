"""Episodes a second of one rank: the toy tool task through an OpenEnv environment against the same task through
our own tool loop, side by side, on the same engine and weights.

    python bench/bench_envs.py [--prompts 32] [--n 8] [--rounds 5] [--max-sessions 0]

The tool preset's model and rows (lib/toy.py, toy_tool), the HF engine sampling at temperature 1. One side is
lib/multi_turn (the lookup tool in a tool worker process); the other lib/envs with the toy tool task served by
openenv-core (tests/envs/toy_openenv.py:tool_app, a child process like env.app's), its answers rendered as tool
messages, so both sides play the same episodes. Rounds alternate between the sides, each round the same seeds; the
figure is each side's median over the rounds, split into generation and the rest (tools, or the environment's
sessions and steps).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lib import toy  # noqa: E402
from lib.config import FSDPConfig, ModelConfig, MultiTurnConfig  # noqa: E402
from lib.config_env import EnvConfig  # noqa: E402
from lib.data import collate, load_prompts  # noqa: E402
from lib.dist import init_topology  # noqa: E402
from lib.engine import SamplingConfig  # noqa: E402
from lib.engine.hf import HFEngine  # noqa: E402
from lib.envs.loop import EnvRollout  # noqa: E402
from lib.envs.openenv import LocalServer  # noqa: E402
from lib.fsdp import build_sharded_model  # noqa: E402
from lib.models import load_tokenizer, stop_token_ids  # noqa: E402
from lib.multi_turn.loop import MultiTurn  # noqa: E402
from lib.sync import sync_weights  # noqa: E402

APP = os.path.join(ROOT, "tests", "envs", "toy_openenv.py") + ":tool_app"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--max-sessions", type=int, default=0)
    ap.add_argument("--max-in-flight", type=int, default=16)
    ap.add_argument("--assets", default=os.path.join(ROOT, "runs", "toy_tool_assets"))
    args = ap.parse_args()
    assets = toy.prepare_tool(args.assets)
    topo = init_topology()
    tokenizer = load_tokenizer(assets["model"])
    with tempfile.TemporaryDirectory() as tmp:
        rows = os.path.join(tmp, "rows.jsonl")
        with open(assets["train"]) as f, open(rows, "w") as out:
            for line in list(f)[:args.prompts]:
                row = json.loads(line)
                row["extra_info"]["env_reset"] = {"key": row["prompt"][0]["content"]}
                out.write(json.dumps(row) + "\n")
        prompts = collate(load_prompts([rows], tokenizer, 16, known_sources=None), np.arange(args.prompts), 16,
                          tokenizer.pad_token_id)
        model = build_sharded_model(ModelConfig(path=assets["model"]), FSDPConfig(), topo, trainable=False)
        engine = HFEngine(model.config, topo.device, tokenizer.pad_token_id, stop_token_ids(assets["model"], tokenizer),
                          SamplingConfig(n=args.n, temperature=1.0, max_new_tokens=64, seed=0))
        engine.wake_up(["weights"])
        sync_weights(model, engine, torch.float32)
        loop = MultiTurn(MultiTurnConfig(tools="lib/toy.py:lookup", max_turns=3, max_tokens_per_turn=32,
                                         tool_workers=1), tokenizer, 64)
        server = LocalServer(APP, os.path.join(tmp, "server.log"))
        env = EnvRollout(EnvConfig(url=server.url, max_turns=3, max_tokens_per_turn=32, observation_role="tool",
                                   max_sessions=args.max_sessions, max_in_flight=args.max_in_flight), server.url,
                         tokenizer, 64, 16)
        sides = {"tool loop": (loop, "timing/multi_turn_generate_s"), "environment": (env, "timing/env_generate_s")}
        figures: dict[str, list[tuple[float, float, float]]] = {name: [] for name in sides}
        try:
            for r in range(args.rounds + 1):  # the first round warms both up, not counted
                for name, (roller, gen_key) in sides.items():
                    prompts.meta_info["seed_key"] = r
                    t0 = time.perf_counter()
                    out = roller.rollout(engine, prompts)
                    wall = time.perf_counter() - t0
                    gen = out.meta_info["multi_turn"][gen_key]
                    if r:
                        figures[name].append((len(out) / wall, gen, wall - gen))
        finally:
            loop.close()
            env.close()
            server.close()
    episodes = args.prompts * args.n
    print(f"toy tool task, {args.prompts} prompts x {args.n} samples = {episodes} episodes a round, up to 3 turns, "
          f"HF engine on {topo.device}, {args.rounds} rounds (median)")
    med = {name: [statistics.median(f[i] for f in rows) for i in range(3)] for name, rows in figures.items()}
    for name, (rate, gen, rest) in med.items():
        print(f"  {name:12s} {rate:8.1f} episodes/s  generation {gen:.3f} s, tools or environment {rest:.3f} s")
    print(f"environment / tool loop episodes a second: {med['environment'][0] / med['tool loop'][0]:.2f}x")


if __name__ == "__main__":
    main()
