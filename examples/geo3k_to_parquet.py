"""Turn a local Geometry3K file (hiyouga/geometry3k's parquet: `images`, `problem` with an <image> placeholder,
`answer`) into the RL layout, images kept in the parquet (verl's geo3k layout).

    python examples/geo3k_to_parquet.py --input geometry3k/train.parquet --output data/geo3k/train.parquet

The ground truth is the answer; the scorer compares the response's last \\boxed{...} with it (the MATH scorer,
data_source hiyouga/geometry3k). A problem without a placeholder gets one in front (its image comes first).
"""

from convert import run

INSTRUCTION = ("You FIRST think about the reasoning process as an internal monologue and then provide the final "
               "answer. The final answer MUST be put in \\boxed{}.")


def convert(row: dict, i: int, split: str) -> dict:
    problem = row["problem"] if "<image>" in row["problem"] else "<image>" + row["problem"]
    return {"data_source": "hiyouga/geometry3k", "images": row["images"],
            "prompt": [{"role": "user", "content": f"{problem} {INSTRUCTION}"}],
            "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(row["answer"])},
            "extra_info": {"split": split, "index": i}}


if __name__ == "__main__":
    run(convert, __doc__)
