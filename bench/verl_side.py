"""verl 0.9.1's side of bench/compare_verl.py; runs in the throw-away environment that script makes.

    python bench/verl_side.py INPUTS.pt OUTPUTS.pt ROWS TOKENS
"""

from __future__ import annotations

import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shared_cases as cases  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.ppo import core_algos  # noqa: E402
from verl.utils.seqlen_balancing import karmarkar_karp  # noqa: E402


def main(inputs: str, outputs: str, rows: int, tokens: int) -> None:
    x = torch.load(inputs, weights_only=False)
    result = {"protocol": cases.protocol_ops(DataProto, rows, tokens)}
    saved = {}
    for name, fn in (("grpo", lambda: core_algos.compute_grpo_outcome_advantage(x["rewards"], x["mask"], x["index"])),
                     ("rloo", lambda: core_algos.compute_rloo_outcome_advantage(x["rewards"], x["mask"], x["index"]))):
        (adv, _), ms = cases.timed(fn)
        saved[name] = adv
        result[f"{name}_ms"] = ms
    weights = cases.partition_inputs()
    for k in (8, 64):
        parts, ms = cases.timed(lambda: karmarkar_karp(weights, k, equal_size=True))
        result[f"kk{k}"] = (ms, cases.partition_quality(weights, parts))
    torch.save(saved, outputs)
    print(json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
