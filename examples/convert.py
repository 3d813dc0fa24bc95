"""Shared by the converters: read a local jsonl/parquet file, map each row to the RL layout, write parquet."""

import argparse
import os
from typing import Callable

from datasets import load_dataset


def run(convert: Callable[[dict, int, str], dict], description: str) -> None:
    """``convert(row, index, split)`` -> the RL row; split is the output file's name (train, test, ...)."""
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--input", required=True, help="a local .jsonl or .parquet file")
    ap.add_argument("--output", required=True, help="the .parquet file to write")
    args = ap.parse_args()
    if not os.path.isfile(args.input):
        raise SystemExit(f"error: {args.input} does not exist")
    kind = "parquet" if args.input.endswith(".parquet") else "json"
    ds = load_dataset(kind, data_files=args.input, split="train")
    split = os.path.splitext(os.path.basename(args.output))[0]
    out = ds.map(lambda row, i: convert(row, i, split), with_indices=True, remove_columns=ds.column_names)
    os.makedirs(os.path.dirname(args.output) or ".", exist_ok=True)
    out.to_parquet(args.output)
    print(f"{len(out)} rows -> {args.output}")
