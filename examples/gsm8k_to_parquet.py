"""Turn a local GSM8K file (jsonl/parquet with `question` and `answer`, as published) into the RL layout.

    python examples/gsm8k_to_parquet.py --input gsm8k/train.jsonl --output data/gsm8k/train.parquet

Ground truth is the number after '####' in the answer; the prompt asks for that format, so the strict
GSM8K scorer (lib/rewards) can read the model's answer.
"""

import argparse
import os

from datasets import load_dataset

INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--input", required=True)
    ap.add_argument("--output", required=True)
    args = ap.parse_args()
    kind = "parquet" if args.input.endswith(".parquet") else "json"
    ds = load_dataset(kind, data_files=args.input, split="train")
    split = os.path.splitext(os.path.basename(args.output))[0]

    def convert(row, i):
        gt = row["answer"].split("####")[-1].strip().replace(",", "")
        return {"data_source": "openai/gsm8k",
                "prompt": [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}],
                "ability": "math", "reward_model": {"style": "rule", "ground_truth": gt},
                "extra_info": {"split": split, "index": i, "question": row["question"]}}

    out = ds.map(convert, with_indices=True, remove_columns=ds.column_names)
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    out.to_parquet(args.output)
    print(f"{len(out)} rows -> {args.output}")


if __name__ == "__main__":
    main()
