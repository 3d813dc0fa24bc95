"""Cases both sides of bench/compare_verl.py run, each with its own DataProto and functions: this file imports
neither project, so it runs in our environment and in verl's throw-away one alike."""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch


def make_fields(rows: int, tokens: int) -> tuple[dict, dict]:
    """A rollout batch: 4 int64 and 4 float32 fields of rows x tokens, and 3 object fields."""
    g = torch.Generator().manual_seed(0)
    tensors = {k: torch.randint(0, 32000, (rows, tokens), generator=g)
               for k in ("input_ids", "attention_mask", "position_ids", "responses")}
    tensors.update({k: torch.randn(rows, tokens, generator=g)
                    for k in ("response_mask", "old_log_probs", "advantages", "values")})
    objects = {"uid": np.array([f"uid-{i // 16}" for i in range(rows)], dtype=object),
               "data_source": np.array(["gsm8k"] * rows, dtype=object),
               "ground_truth": np.array([str(i) for i in range(rows)], dtype=object)}
    return tensors, objects


def nbytes(data) -> int:
    return sum(t.numel() * t.element_size() for t in data.batch.values())


def protocol_ops(cls, rows: int, tokens: int, repeats: int = 5) -> dict[str, tuple[float, float]]:
    """op -> (median ms, GB produced by copying: 0 for views) for the DataProto class ``cls``."""
    tensors, objects = make_fields(rows, tokens)
    data = cls.from_dict(tensors, objects, {"temperature": 1.0})
    half = rows // 2
    a, b = data[:half], data[half:]
    idx = np.sort(np.random.default_rng(0).permutation(rows)[:half])
    keys = list(tensors)
    left = data.select(keys[:4], ["uid"])
    right = data.select(keys[4:], ["data_source", "ground_truth"])
    total = nbytes(data)
    ops = {
        "from_dict (no copy)": (lambda: cls.from_dict(tensors, objects), 0),
        "slice view [:half]": (lambda: data[:half], 0),
        "select keys (view)": (lambda: data.select(keys[:4], ["uid"]), 0),
        "union (disjoint keys)": (lambda: left.union(right), 0),
        "select_idxs (half, copy)": (lambda: data.select_idxs(idx), total / 2),
        "concat (2 halves, copy)": (lambda: cls.concat([a, b]), total),
        "chunk (8 views)": (lambda: data.chunk(8), 0),
        "repeat x2 interleave (copy)": (lambda: data.repeat(2, interleave=True), 2 * total),
    }
    return {name: (timed(fn, repeats)[1], produced / 1e9) for name, (fn, produced) in ops.items()}


def memcpy_gbs(rows: int, tokens: int) -> float:
    """The machine's copy speed for the same bytes: torch.cat of the fields' halves, GB/s."""
    tensors, _ = make_fields(rows, tokens)
    half = rows // 2
    _, ms = timed(lambda: [torch.cat([t[:half], t[half:]]) for t in tensors.values()])
    return sum(t.numel() * t.element_size() for t in tensors.values()) / 1e9 / (ms / 1e3)


def advantage_inputs(batch: int, n: int, length: int = 64, seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, length + 1, (batch,), generator=g)
    mask = (torch.arange(length)[None] < lengths[:, None]).float()
    rewards = torch.zeros(batch, length)
    rewards[torch.arange(batch), lengths - 1] = torch.randint(0, 2, (batch,), generator=g).float()
    rewards[::7, 0] += 0.25  # some non-binary rewards, some on other tokens
    index = np.array([f"prompt-{i // n}" for i in range(batch)], dtype=object)
    return {"rewards": rewards, "mask": mask, "index": index}


def timed(fn, repeats: int = 5):
    """(the first call's result, median ms of ``repeats`` more calls)."""
    out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return out, statistics.median(times) * 1e3


def partition_inputs(items: int = 1024, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(16, 8192, size=items).tolist()


def partition_quality(weights: list[int], parts: list[list[int]]) -> float:
    """Largest part over the ideal (sum / k): 1.0 is perfect."""
    sums = [sum(weights[i] for i in p) for p in parts]
    assert sorted(i for p in parts for i in p) == list(range(len(weights)))
    return max(sums) / (sum(weights) / len(parts))
