"""Ulysses sequence parallelism (Jacobs et al. 2023) for Hugging Face models, without patching model classes.

Inside an SP group of size sp every rank holds 1/sp of the packed sequence. All token-wise layers run on
the local slice; attention swaps layouts with one all-to-all (gather the sequence, scatter the heads),
attends over the whole sequence with 1/sp of the heads, and swaps back. That attention is
lib/attention.py's packed attention (registered with transformers), given the SP group in its ``Packing``;
this module holds the collectives, the slicing and the head-count check.

GQA: query heads must divide by sp. Key/value heads either divide by sp, or sp divides them and each is
repeated sp // kv_heads times before the exchange (every rank then holds one kv head, the one its query
heads use). Anything else is refused before a model loads (``check_heads``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

Tensor = torch.Tensor


def check_heads(num_heads: int, num_kv_heads: int, sp_size: int) -> None:
    """Refuse head counts that cannot be split over the SP group, naming the sizes and the fix."""
    if sp_size == 1:
        return
    problems = []
    if num_heads % sp_size:
        problems.append(f"{num_heads} query heads do not divide by sp={sp_size}")
    if num_kv_heads % sp_size and sp_size % num_kv_heads:
        problems.append(f"{num_kv_heads} key/value heads neither divide by sp={sp_size} nor divide it")
    if problems:
        ok = [d for d in range(1, num_heads + 1) if num_heads % d == 0 and (num_kv_heads % d == 0 or d % num_kv_heads == 0)]
        raise ValueError("Ulysses cannot split this model's attention: " + "; ".join(problems) +
                         f". Use a sequence-parallel size in {ok}")


class _AllToAll(torch.autograd.Function):
    """Split ``x`` along scatter_dim into sp pieces, send piece j to rank j, concatenate what arrives along
    gather_dim. Its gradient is the same exchange with the two dims swapped."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
        ctx.group, ctx.scatter_dim, ctx.gather_dim = group, scatter_dim, gather_dim
        return _exchange(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _exchange(grad, ctx.group, ctx.gather_dim, ctx.scatter_dim), None, None, None


def _exchange(x: Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
    sp = dist.get_world_size(group)
    send = torch.stack(x.chunk(sp, dim=scatter_dim)).contiguous()  # (sp, ...) piece j for rank j
    recv = torch.empty_like(send)
    # sp group: the ranks holding the other slices of the same sequences
    dist.all_to_all_single(recv, send, group=group)
    return torch.cat(recv.unbind(0), dim=gather_dim)


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the gradient of each rank's input is the sum of every rank's output gradient."""

    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_sum(x: Tensor, group: dist.ProcessGroup) -> Tensor:
    return _AllReduceSum.apply(x, group)


def all_to_all(x: Tensor, group: dist.ProcessGroup, scatter_dim: int, gather_dim: int) -> Tensor:
    return _AllToAll.apply(x, group, scatter_dim, gather_dim)


def pad_and_slice(input_ids: Tensor, position_ids: Tensor, sp_size: int, sp_rank: int
                  ) -> tuple[Tensor, Tensor, Tensor, int]:
    """Pad a packed (1, T) row to a multiple of sp (padding is its own segment, never kept for a loss) and
    take this rank's slice. Returns (local ids, local positions, full padded positions, slice start)."""
    total = input_ids.shape[1]
    pad = (-total) % sp_size
    if pad:
        input_ids = F.pad(input_ids, (0, pad))
        position_ids = torch.cat([position_ids, torch.arange(pad, device=position_ids.device)[None]], dim=1)
    local = input_ids.shape[1] // sp_size
    start = sp_rank * local
    return input_ids[:, start:start + local], position_ids[:, start:start + local], position_ids, start
