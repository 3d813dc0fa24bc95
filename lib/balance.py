"""Sequence-length balancing: Karmarkar-Karp partitions, rank balancing, dynamic micro-batches.

Karmarkar & Karp's largest differencing method for k-way partitioning: every item starts as a k-subset
state (the item alone in one subset), and the two states with the largest spread are merged by pairing
the heaviest subsets of one with the lightest of the other, until one state is left. With ``equal_size``
the items are first dealt k at a time into k different subsets, so every part gets n/k items.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

import numpy as np
import torch
import torch.distributed as dist

from lib.dist import reshard
from lib.protocol import DataProto

DEFAULT_LINEAR_WEIGHT = 24576  # a in a*L + L^2: per-token (projection/MLP) cost against attention's per pair


def workload(lengths: Sequence[int] | np.ndarray, linear_weight: float = DEFAULT_LINEAR_WEIGHT) -> np.ndarray:
    """Compute cost of a sequence of L tokens: a*L (token-wise layers) + L^2 (attention)."""
    lengths = np.asarray(lengths, dtype=np.float64)
    return linear_weight * lengths + lengths ** 2


class _State:
    """k subsets (item lists and their sums), ordered by sum descending."""

    __slots__ = ("sums", "items")

    def __init__(self, sums: list[float], items: list[list[int]]):
        order = sorted(range(len(sums)), key=lambda i: (-sums[i], i))
        self.sums = [sums[i] for i in order]
        self.items = [items[i] for i in order]

    @property
    def spread(self) -> float:
        return self.sums[0] - self.sums[-1]

    def merge(self, other: "_State") -> "_State":
        # heaviest of self with lightest of other (other's sums are descending, so reverse it)
        k = len(self.sums)
        return _State([self.sums[i] + other.sums[k - 1 - i] for i in range(k)],
                      [self.items[i] + other.items[k - 1 - i] for i in range(k)])


def karmarkar_karp(weights: Sequence[float], k: int, equal_size: bool = False) -> list[list[int]]:
    """Split item indices into k parts of near-equal total weight; each part is sorted ascending."""
    n = len(weights)
    if k < 1:
        raise ValueError(f"need k >= 1 parts, got {k}")
    if equal_size and n % k:
        raise ValueError(f"equal-size partition of {n} items into {k} parts is impossible; "
                         f"use a multiple of {k} items")
    order = sorted(range(n), key=lambda i: (weights[i], i))
    states = []
    if equal_size:
        for start in range(0, n, k):
            chunk = order[start:start + k]
            states.append(_State([float(weights[i]) for i in chunk], [[i] for i in chunk]))
    else:
        for i in order:
            states.append(_State([float(weights[i])] + [0.0] * (k - 1), [[i]] + [[] for _ in range(k - 1)]))
    # max-heap on spread; the counter keeps ties deterministic
    heap = [(-s.spread, c, s) for c, s in enumerate(states)]
    heapq.heapify(heap)
    counter = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = a.merge(b)
        heapq.heappush(heap, (-merged.spread, counter, merged))
        counter += 1
    if not heap:
        return [[] for _ in range(k)]
    parts = [sorted(p) for p in heap[0][2].items]
    return sorted(parts, key=lambda p: (p[0] if p else n, len(p)))


def balance_across_ranks(data: DataProto, group: dist.ProcessGroup | None = None,
                         linear_weight: float = DEFAULT_LINEAR_WEIGHT, equal_size: bool = True,
                         pad_values: dict | None = None) -> tuple[DataProto, dict[str, float]]:
    """Reshard ``data`` so every rank of ``group`` gets an equal compute load (Karmarkar-Karp on a*L + L^2).

    Every rank all-gathers the per-row token counts (the group, so every rank computes the same partition),
    then rows move with ``reshard``. With ``equal_size`` every rank also keeps the same number of rows.
    Returns the new local batch and balance metrics (max/mean load before and after)."""
    world = dist.get_world_size(group)
    local_lengths = data.batch["attention_mask"].sum(-1).to(torch.int64).cpu()
    sizes = [None] * world
    dist.all_gather_object(sizes, local_lengths.tolist(), group=group)
    lengths = np.concatenate([np.asarray(s, dtype=np.int64) for s in sizes])
    loads = workload(lengths, linear_weight)
    parts = karmarkar_karp(loads.tolist(), world, equal_size=equal_size)
    before = np.array([loads[sum(len(s) for s in sizes[:r]):sum(len(s) for s in sizes[:r + 1])].sum()
                       for r in range(world)])
    after = np.array([loads[p].sum() for p in parts])
    metrics = {"balance/imbalance_before": float(before.max() / max(before.mean(), 1e-9)),
               "balance/imbalance_after": float(after.max() / max(after.mean(), 1e-9))}
    return reshard(data, parts, group, pad_values), metrics


def dynamic_micro_batches(lengths: Sequence[int], max_tokens: int, group: dist.ProcessGroup | None = None,
                          ) -> list[list[int]]:
    """Group row indices into micro-batches of at most ``max_tokens`` tokens each, balanced by Karmarkar-Karp.

    The number of micro-batches is the smallest that fits, raised to the largest over ``group``'s ranks
    (a max all-reduce) so that every rank runs the same number of forward/backward passes: FSDP's
    collectives must pair up. Concatenate the outputs in the order returned and undo it with
    ``restore_order``."""
    lengths = [int(x) for x in lengths]
    if lengths and max(lengths) > max_tokens:
        raise ValueError(f"a sequence of {max(lengths)} tokens exceeds the dynamic batch budget of {max_tokens} "
                         f"tokens per micro-batch; raise max_tokens_per_rank to at least the longest prompt + response")

    def fits(k: int) -> list[list[int]] | None:
        parts = karmarkar_karp(lengths, k)
        return parts if all(sum(lengths[i] for i in p) <= max_tokens for p in parts) else None

    distributed = dist.is_initialized()
    k = max(1, math.ceil(sum(lengths) / max_tokens))
    while True:
        while fits(k) is None:
            k += 1
        if not distributed:
            break
        # max over the group's ranks: every rank must run the same number of micro-batches; then check that
        # the agreed count fits everywhere (more parts almost always fit; if not, everyone searches upwards)
        t = torch.tensor([k], dtype=torch.int64, device="cuda" if "nccl" in str(dist.get_backend(group)) else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        k = int(t.item())
        t.fill_(int(fits(k) is not None))
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
        if t.item():
            break
        k += 1
    return fits(k)


def restore_order(parts: Sequence[Sequence[int]]) -> np.ndarray:
    """The permutation that takes the concatenation of ``parts`` back to the original row order."""
    flat = np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]) if parts else np.zeros(0, np.int64)
    inverse = np.empty_like(flat)
    inverse[flat] = np.arange(len(flat))
    return inverse


def micro_batches(data: DataProto, micro_batch_size: int, max_tokens: int | None,
                  group: dist.ProcessGroup | None = None) -> tuple[list[DataProto], np.ndarray | None]:
    """Fixed-size micro-batches (``max_tokens`` None), or dynamic ones by token count. Returns the pieces and,
    for dynamic ones, the permutation that restores the original row order of the concatenated outputs."""
    if max_tokens is None:
        return data.split(micro_batch_size), None
    lengths = data.batch["attention_mask"].sum(-1).tolist()
    parts = dynamic_micro_batches(lengths, max_tokens, group)
    return [data.select_idxs(p) for p in parts], restore_order(parts)


def balance_groups(data: DataProto, group: dist.ProcessGroup | None = None, keep_groups: int = 0,
                   linear_weight: float = DEFAULT_LINEAR_WEIGHT, group_key: str = "uid",
                   ) -> tuple[DataProto, dict[str, float]]:
    """Reshard so every rank gets an equal compute load, moving whole groups (the n samples of a prompt stay
    together, so group statistics stay local). ``keep_groups`` > 0 keeps only the first that many groups
    (in rank order), as dynamic sampling needs. Equal group counts per rank when they divide evenly."""
    world = dist.get_world_size(group)
    # world / group: every rank's uids and lengths (a few numbers per row), so every rank computes the same
    # assignment; then only the rows that change rank move (lib.dist.reshard)
    local = (data.non_tensor_batch[group_key].tolist(), data.batch["attention_mask"].sum(-1).cpu().tolist())
    meta: list = [None] * world
    dist.all_gather_object(meta, local, group=group)
    uids = [u for part in meta for u in part[0]]
    lengths = np.asarray([n for part in meta for n in part[1]], dtype=np.int64)
    order: dict = {}
    for i, u in enumerate(uids):
        order.setdefault(u, []).append(i)
    groups = list(order.values())
    if keep_groups:
        groups = groups[:keep_groups]
    loads = [float(workload(lengths[g], linear_weight).sum()) for g in groups]
    parts = karmarkar_karp(loads, world, equal_size=len(groups) % world == 0)
    per_rank = [float(sum(loads[j] for j in p)) for p in parts]
    assignment = [sorted(i for j in p for i in groups[j]) for p in parts]
    metrics = {"balance/imbalance": max(per_rank) / max(np.mean(per_rank), 1e-9), "balance/groups": len(groups)}
    return reshard(data, assignment, group), metrics
