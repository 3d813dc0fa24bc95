"""Ulysses sequence parallelism (Jacobs et al. 2023) for Hugging Face models, without patching model classes.

Inside an SP group of size sp every rank holds 1/sp of the packed sequence. All token-wise layers run on
the local slice; attention swaps layouts with one all-to-all (gather the sequence, scatter the heads),
attends over the whole sequence with 1/sp of the heads, and swaps back. The attention function is
registered with transformers' attention interface under the name ``ulysses``; a model built with
``attn_implementation="ulysses"`` calls it in every layer. Outside a ``sequence_parallel`` context it is
plain sdpa, so the same model also runs unsliced.

GQA: query heads must divide by sp. Key/value heads either divide by sp, or sp divides them and each is
repeated sp // kv_heads times before the exchange (every rank then holds one kv head, the one its query
heads use). Anything else is refused before a model loads (``check_heads``).
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib.util
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist
import torch.nn.functional as F

Tensor = torch.Tensor
ATTN_NAME = "ulysses"


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


@dataclass
class SPContext:
    group: dist.ProcessGroup
    size: int
    segments: list[tuple[int, int]]  # [start, end) of every packed sequence in the full (padded) row
    cu_seqlens: Tensor  # (num_segments + 1,) int32, for varlen kernels
    max_seqlen: int


_ACTIVE: contextvars.ContextVar[SPContext | None] = contextvars.ContextVar("ulysses_context", default=None)


def segments_from_positions(position_ids: Tensor) -> list[tuple[int, int]]:
    """Packed sequences restart their position ids: a new segment starts wherever the step is not +1."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(torch.diff(pos) != 1).flatten() + 1
    bounds = [0] + starts.tolist() + [pos.numel()]
    return [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]


@contextlib.contextmanager
def sequence_parallel(group: dist.ProcessGroup, full_position_ids: Tensor) -> Iterator[SPContext]:
    """Make every ``ulysses`` attention call inside attend over the full packed row whose positions are given."""
    segments = segments_from_positions(full_position_ids)
    lengths = [b - a for a, b in segments]
    cu = torch.tensor([0] + lengths, device=full_position_ids.device).cumsum(0).to(torch.int32)
    ctx = SPContext(group, dist.get_world_size(group), segments, cu, max(lengths))
    token = _ACTIVE.set(ctx)
    try:
        yield ctx
    finally:
        _ACTIVE.reset(token)


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


def _attend(q: Tensor, k: Tensor, v: Tensor, ctx: SPContext, scaling: float | None, dropout: float) -> Tensor:
    """Causal attention within each packed segment. q: (1, H, S, d); k, v: (1, KV, S, d), KV dividing H (GQA:
    kv head m serves query heads m*H/KV ..; the kernels handle it, so no repeated copy is kept for backward)."""
    if q.is_cuda and importlib.util.find_spec("flash_attn") is not None:
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                     ctx.cu_seqlens, ctx.cu_seqlens, ctx.max_seqlen, ctx.max_seqlen,
                                     dropout_p=dropout, softmax_scale=scaling, causal=True)
        return out.transpose(0, 1)[None]
    # the plain path: one causal sdpa per segment (no S x S mask is ever built)
    gqa = k.shape[1] != q.shape[1]
    outs = [F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], dropout_p=dropout,
                                           is_causal=True, scale=scaling, enable_gqa=gqa) for a, b in ctx.segments]
    return torch.cat(outs, dim=2)


def ulysses_attention(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers attention interface: q (B, H, S_local, d), k/v (B, KV, S_local, d) -> (B, S_local, H, d)."""
    ctx = _ACTIVE.get()
    if ctx is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    sp, kv_heads = ctx.size, key.shape[1]
    if kv_heads < sp:  # sp % kv_heads == 0 (checked before loading): one repeated kv head per rank
        key = key.repeat_interleave(sp // kv_heads, dim=1)
        value = value.repeat_interleave(sp // kv_heads, dim=1)
    q = all_to_all(query, ctx.group, scatter_dim=1, gather_dim=2)  # (1, H/sp, S, d)
    k = all_to_all(key, ctx.group, scatter_dim=1, gather_dim=2)
    v = all_to_all(value, ctx.group, scatter_dim=1, gather_dim=2)
    out = _attend(q, k, v, ctx, scaling, dropout if module.training else 0.0)  # (1, H/sp, S, d)
    out = all_to_all(out, ctx.group, scatter_dim=2, gather_dim=1)  # (1, H, S_local, d)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the ``ulysses`` attention with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, ulysses_attention)
    return ATTN_NAME


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
