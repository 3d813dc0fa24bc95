"""DataProto op cost vs the same work done by hand on bare dicts of tensors and arrays.

    python bench/bench_protocol.py [--rows 4096] [--tokens 2048] [--repeats 5]

A batch of 8 tensor fields (rows x tokens, int64 and float32) and 3 object fields. For each op prints
ms per call for DataProto and for the hand-written baseline, and their ratio (1.00 = no overhead).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from lib.protocol import DataProto  # noqa: E402


def make_batch(rows: int, tokens: int) -> DataProto:
    g = torch.Generator().manual_seed(0)
    ints = {k: torch.randint(0, 32000, (rows, tokens), generator=g)
            for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    floats = {k: torch.randn(rows, tokens, generator=g)
              for k in ("response_mask", "old_log_probs", "advantages", "values")}
    objects = {"uid": [f"uid-{i // 16}" for i in range(rows)], "data_source": ["gsm8k"] * rows,
               "ground_truth": [str(i) for i in range(rows)]}
    return DataProto.from_dict({**ints, **floats}, objects, {"temperature": 1.0})


def timeit(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    data = make_batch(args.rows, args.tokens)
    t, o = data.batch, data.non_tensor_batch
    half = args.rows // 2
    a, b = data[:half], data[half:]
    idx = np.random.default_rng(0).permutation(args.rows)[: args.rows // 2]
    idx_t = torch.from_numpy(idx)
    left, right = data.select(list(t)[:4], ["uid"]), data.select(list(t)[4:], ["data_source", "ground_truth"])

    cases = {
        "concat (2 halves)": (lambda: DataProto.concat([a, b]),
                              lambda: ({k: torch.cat([a.batch[k], b.batch[k]]) for k in t},
                                       {k: np.concatenate([a.non_tensor_batch[k], b.non_tensor_batch[k]]) for k in o})),
        "chunk(8)": (lambda: data.chunk(8),
                     lambda: [({k: v[i * args.rows // 8:(i + 1) * args.rows // 8] for k, v in t.items()},
                               {k: v[i * args.rows // 8:(i + 1) * args.rows // 8] for k, v in o.items()})
                              for i in range(8)]),
        "split(256)": (lambda: data.split(256),
                       lambda: [({k: v[i:i + 256] for k, v in t.items()}, {k: v[i:i + 256] for k, v in o.items()})
                                for i in range(0, args.rows, 256)]),
        "select(4 keys)": (lambda: data.select(list(t)[:4], ["uid"]),
                           lambda: ({k: t[k] for k in list(t)[:4]}, {"uid": o["uid"]})),
        "repeat(4, interleave)": (lambda: data[:1024].repeat(4),
                                  lambda: ({k: v[:1024].repeat_interleave(4, 0) for k, v in t.items()},
                                           {k: np.repeat(v[:1024], 4) for k, v in o.items()})),
        "union (disjoint)": (lambda: left.select().union(right),
                             lambda: ({**left.batch, **right.batch}, {**left.non_tensor_batch, **right.non_tensor_batch})),
        "union (shared keys)": (lambda: data.select().union(data),
                                lambda: ({k: v for k, v in t.items() if torch.equal(v, t[k])}, dict(o))),
        "index (half, shuffled)": (lambda: data[idx],
                                   lambda: ({k: v.index_select(0, idx_t) for k, v in t.items()},
                                            {k: v[idx] for k, v in o.items()})),
    }
    gb = sum(v.numel() * v.element_size() for v in t.values()) / 2**30
    print(f"DataProto: {args.rows} rows x {args.tokens} tokens, {len(t)} tensor fields ({gb:.2f} GiB), "
          f"{len(o)} object fields, torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(f"{'op':<24}{'DataProto ms':>14}{'by hand ms':>12}{'ratio':>8}")
    for name, (ours, base) in cases.items():
        ms_ours, ms_base = timeit(ours, args.repeats), timeit(base, args.repeats)
        print(f"{name:<24}{ms_ours:>14.3f}{ms_base:>12.3f}{ms_ours / max(ms_base, 1e-6):>8.2f}")


if __name__ == "__main__":
    main()
