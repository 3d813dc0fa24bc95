"""Turn a local MATH file (jsonl/parquet with `problem` and `solution`, as published) into the RL layout.

    python examples/math_to_parquet.py --input math/train.jsonl --output data/math/train.parquet

Ground truth is the last \\boxed{...} of the solution; the MATH scorer compares boxed answers after
normalisation (or with math-verify when installed).
"""

import os
import sys

from convert import run

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lib.rewards.builtin import last_boxed  # noqa: E402

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def convert(row: dict, i: int, split: str) -> dict:
    return {"data_source": "DigitalLearningGmbH/MATH-lighteval",
            "prompt": [{"role": "user", "content": f"{row['problem']} {INSTRUCTION}"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": last_boxed(row["solution"])},
            "extra_info": {"split": split, "index": i, "level": row.get("level"), "type": row.get("type")}}


if __name__ == "__main__":
    run(convert, __doc__)
