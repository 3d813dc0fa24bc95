"""Turn a local GSM8K file (jsonl/parquet with `question` and `answer`, as published) into the RL layout.

    python examples/gsm8k_to_parquet.py --input gsm8k/train.jsonl --output data/gsm8k/train.parquet

Ground truth is the number after '####' in the answer; the prompt asks for that format, so the strict
GSM8K scorer (lib/rewards) can read the model's answer.
"""

from convert import run

INSTRUCTION = "Let's think step by step and output the final answer after \"####\"."


def convert(row: dict, i: int, split: str) -> dict:
    gt = row["answer"].split("####")[-1].strip().replace(",", "")
    return {"data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": gt},
            "extra_info": {"split": split, "index": i, "question": row["question"]}}


if __name__ == "__main__":
    run(convert, __doc__)
