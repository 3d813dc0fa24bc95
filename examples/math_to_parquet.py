"""Turn a local MATH file (jsonl/parquet with `problem` and `solution`, as published) into the RL layout.

    python examples/math_to_parquet.py --input math/train.jsonl --output data/math/train.parquet

Ground truth is the last \\boxed{...} of the solution; the MATH scorer compares boxed answers after
normalisation (or with math-verify when installed).
"""

import argparse
import os
import sys

from datasets import load_dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lib.rewards.builtin import last_boxed  # noqa: E402

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    args = ap.parse_args()
    kind = "parquet" if args.input.endswith(".parquet") else "json"
    ds = load_dataset(kind, data_files=args.input, split="train")

    def convert(row, i):
        return {"data_source": "DigitalLearningGmbH/MATH-lighteval",
                "prompt": [{"role": "user", "content": f"{row['problem']} {INSTRUCTION}"}],
                "ability": "math", "reward_model": {"style": "rule", "ground_truth": last_boxed(row["solution"])},
                "extra_info": {"index": i, "level": row.get("level"), "type": row.get("type")}}

    out = ds.map(convert, with_indices=True, remove_columns=ds.column_names)
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    out.to_parquet(args.output)
    print(f"{len(out)} rows -> {args.output}")


if __name__ == "__main__":
    main()
