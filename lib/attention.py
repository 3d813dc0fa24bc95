"""Packed ("remove padding") attention, with or without Ulysses sequence parallelism.

A packed row holds the valid tokens of several sequences back to back, with position ids that restart at each
sequence. Attention must stay inside each sequence: ``Packing`` holds the sequence bounds (``cu_seqlens``) of
one micro-batch, computed once per micro-batch (not in every layer) by ``packing(position_ids)``.

The state travels as a keyword argument of the model call (``model(..., spmd_packing=p)``): transformers hands
extra keyword arguments down to every attention call, and gradient checkpointing keeps them for the recompute
in backward. (A context manager around the forward was not seen by that recompute: Ulysses with gradient
checkpointing crashed with a CheckpointError, and plain packing would have attended across sequences.)

Kernels, in order: PyTorch's own varlen flash kernel (``torch.nn.attention.varlen.varlen_attn``, torch >= 2.10,
CUDA, bf16/fp16), the flash-attn package where installed, and on CPU (or fp32 on GPU) one causal sdpa over the
sequences laid side by side, right-padded to the longest (sum of L_max^2 work, not S^2). No S x S mask is ever
built (transformers' sdpa on a packed row builds one and attends over the whole row).

The model's own attention features are honoured on every path: a sliding window (varlen kernels take it as a
window size, the plain path as a band mask), logit soft-capping and attention sinks (flash-attn takes the
soft-cap; what a kernel lacks goes to ``math_attention``, the attention written out), and Gemma-3's and Gemma-4's
image blocks (an image's tokens see each other both ways: the plain path's mask, which no varlen kernel takes, so
such rows run the plain path on a GPU too). Another model is never computed silently: tests/test_model_zoo.py checks
packed = padded = eager for each architecture, tests/test_vision.py for each vision-language family.
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from lib import ulysses

Tensor = torch.Tensor
NAME = "spmd_packed"
KWARG = "spmd_packing"


@dataclass
class Packing:
    """Sequence bounds of one packed micro-batch row (the full row: with SP, before slicing)."""

    segments: list[tuple[int, int]]  # [start, end) of every packed sequence
    cu_seqlens: Tensor  # (num_segments + 1,) int32 on the device, for varlen kernels
    max_len: int
    group: dist.ProcessGroup | None = None  # the SP group when the row is split over it (Ulysses)
    sp_size: int = 1
    gather: Tensor | None = None  # (num_segments * max_len,) packed position of each padded slot (0 past the end)
    valid: Tensor | None = None  # (num_segments * max_len,) bool: the padded slots that hold a token
    blocks: Tensor | None = None  # (total,) image block of each packed token, -1 for text (``image_blocks``)
    two_way: str = ""  # the layers where the blocks attend both ways: "all" or "sliding" (lib.vision.two_way)
    masks: dict = field(default_factory=dict)  # the plain path's masks, by (window, two-way), made on first use

    def padded_index(self) -> tuple[Tensor, Tensor]:
        """Where each sequence's tokens sit in a (num_segments, max_len) right-padded layout; made on first use."""
        if self.gather is None:
            starts = self.cu_seqlens[:-1].long()
            lengths = self.cu_seqlens[1:].long() - starts
            offset = torch.arange(self.max_len, device=lengths.device)
            valid = offset[None] < lengths[:, None]
            self.gather = torch.where(valid, starts[:, None] + offset[None], 0).flatten()
            self.valid = valid.flatten()
        return self.gather, self.valid

    def mask(self, window: int | None, two_way: bool, device: torch.device) -> Tensor:
        """The plain path's ``allowed`` mask for a layer of this kind, made once per micro-batch (every layer, and
        gradient checkpointing's recompute, gets the same Packing)."""
        key = (window, two_way)
        if key not in self.masks:
            blocks = None
            if two_way:
                gather, valid = self.padded_index()
                blocks = torch.where(valid, self.blocks[gather], -1).unflatten(0, (len(self.segments), self.max_len))
            self.masks[key] = allowed(self.max_len, window, device, blocks)
        return self.masks[key]


def image_blocks(ids: Tensor, image_token_id: int) -> Tensor:
    """(S,) for a row of ids (S,): the index of the run of image tokens each token is in, -1 for a text token. The
    tokens of one run (one image) attend to each other both ways in a model whose family says so (Gemma-3, -4)."""
    is_image = ids == image_token_id
    starts = is_image & ~F.pad(is_image, (1, 0))[:-1]
    return torch.where(is_image, starts.long().cumsum(0) - 1, -1)


def packing(position_ids: Tensor, group: dist.ProcessGroup | None = None, blocks: Tensor | None = None,
            two_way: str = "") -> Packing:
    """Packed sequences restart their position ids: a new sequence starts wherever the step is not +1.
    ``blocks``: the row's ``image_blocks``, attending both ways in the layers ``two_way`` names."""
    pos = position_ids.reshape(-1)
    starts = torch.nonzero(torch.diff(pos) != 1).flatten() + 1
    bounds = [0] + starts.tolist() + [pos.numel()]  # one host sync per micro-batch
    segments = [(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
    cu = torch.tensor([0] + [b - a for a, b in segments], device=pos.device).cumsum(0).to(torch.int32)
    size = dist.get_world_size(group) if group is not None else 1
    return Packing(segments, cu, max(b - a for a, b in segments), group if size > 1 else None, size, blocks=blocks,
                   two_way=two_way)


@functools.cache
def _installed(module: str) -> bool:
    """Looked up once per process: attention runs this in every layer of every forward."""
    return importlib.util.find_spec(module) is not None


def varlen_kernel() -> str | None:
    """The varlen attention kernel available on CUDA: "torch" (torch >= 2.10), "flash_attn", or None."""
    if _installed("torch.nn.attention.varlen"):
        return "torch"
    if _installed("flash_attn"):
        return "flash_attn"
    return None


@functools.cache
def _varlen_params() -> frozenset[str]:
    from torch.nn.attention.varlen import varlen_attn

    return frozenset(inspect.signature(varlen_attn).parameters)


def _torch_varlen(q: Tensor, k: Tensor, v: Tensor, p: Packing, scaling: float | None, window: int | None) -> Tensor:
    """q (T, H, d), k/v (T, KV, d) -> (T, H, d). The keyword names changed between torch 2.10 and 2.12."""
    from torch.nn.attention.varlen import varlen_attn

    params = _varlen_params()
    if "window_size" in params:  # (left, right): a window of W tokens is the token and W - 1 before it
        kw: dict[str, Any] = {"window_size": (window - 1 if window else -1, 0)}
    else:
        kw = {"is_causal": True}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    if scaling is not None:
        if "scale" in params:
            kw["scale"] = scaling
        else:  # the kernel's own scale is d ** -0.5
            q = q * (scaling * q.shape[-1] ** 0.5)
    return varlen_attn(q, k, v, p.cu_seqlens, p.cu_seqlens, p.max_len, p.max_len, **kw)


def allowed(length: int, window: int | None, device: torch.device, blocks: Tensor | None = None) -> Tensor:
    """(L, L) bool: query i sees key j when j <= i and, with a sliding window of W tokens, i - j < W (transformers'
    sliding_window_overlay: the token itself and the W - 1 before it). ``blocks`` (n, L): image blocks (-1 for
    text); then (n, 1, L, L), a query also seeing the later tokens of its own block, within the window (Gemma-3:
    AND(window, OR(causal, block)))."""
    i = torch.arange(length, device=device)
    diff = i[:, None] - i[None, :]
    seen = diff >= 0
    if blocks is not None:
        seen = seen | ((blocks[:, :, None] == blocks[:, None, :]) & (blocks[:, :, None] >= 0))
        seen = seen[:, None]
    return seen & (diff < window) if window else seen


def math_attention(q: Tensor, k: Tensor, v: Tensor, scaling: float | None, mask: Tensor,
                   softcap: float | None = None, sinks: Tensor | None = None, dropout: float = 0.0) -> Tensor:
    """Attention written out, for what sdpa lacks: logit soft-capping (Gemma-2: cap * tanh(s / cap)) and attention
    sinks (GPT-OSS: one learned logit per head joins each softmax and is dropped after it).
    q (n, H, L, d); k, v (n, KV, L, d); mask: ``allowed``'s; sinks (H,). Returns (n, H, L, d). Softmax in float32,
    as the eager references do."""
    heads = q.shape[1]
    if k.shape[1] != heads:
        k = k.repeat_interleave(heads // k.shape[1], dim=1)
        v = v.repeat_interleave(heads // v.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) * (scaling if scaling is not None else q.shape[-1] ** -0.5)
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        sink = sinks.to(scores.dtype).reshape(1, heads, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], -1).float(), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores.float(), dim=-1)
    probs = F.dropout(probs.to(q.dtype), p=dropout, training=dropout > 0)
    return probs @ v


def attend(q: Tensor, k: Tensor, v: Tensor, p: Packing, scaling: float | None, dropout: float = 0.0,
           window: int | None = None, softcap: float | None = None, sinks: Tensor | None = None,
           two_way: bool = False) -> Tensor:
    """Causal attention within each packed sequence. q: (1, H, S, d); k, v: (1, KV, S, d) with KV dividing H
    (GQA: the kernels share each kv head, so no repeated copy is kept for backward). Returns (1, H, S, d).
    ``window`` (a sliding window of that many tokens), ``softcap`` and ``sinks`` (one logit per head of q) are
    honoured by every path: a kernel that lacks one hands the call to the next, down to ``math_attention``.
    ``two_way``: each image's tokens also see the later ones of their image (``Packing.blocks``: the plain path's
    mask; no varlen kernel takes one)."""
    window = window if window and window < p.max_len else None  # a window longer than every sequence is none
    fast = q.is_cuda and q.dtype in (torch.bfloat16, torch.float16) and not two_way
    kernel = varlen_kernel() if fast else None
    torch_ok = window is None or "window_size" in _varlen_params() if kernel == "torch" else False
    if kernel == "torch" and dropout == 0.0 and softcap is None and sinks is None and torch_ok:
        out = _torch_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), p, scaling, window)
        return out.transpose(0, 1)[None]
    if kernel is not None and _installed("flash_attn") and sinks is None:
        from flash_attn import flash_attn_varlen_func

        out = flash_attn_varlen_func(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1),
                                     p.cu_seqlens, p.cu_seqlens, p.max_len, p.max_len, dropout_p=dropout,
                                     softmax_scale=scaling, causal=True,
                                     window_size=(window - 1, 0) if window else (-1, -1), softcap=softcap or 0.0)
        return out.transpose(0, 1)[None]
    # the plain path: the sequences side by side, right-padded to the longest, in one causal sdpa. A token attends
    # only to the tokens before it in its own sequence, never to the padding (which comes after them).
    gather, valid = p.padded_index()
    n, length = len(p.segments), p.max_len

    def padded(x: Tensor) -> Tensor:  # (1, H, S, d) -> (n, H, length, d)
        return x[0][:, gather].unflatten(1, (n, length)).transpose(0, 1)

    if softcap or sinks is not None:
        out = math_attention(padded(q), padded(k), padded(v), scaling, p.mask(window, two_way, q.device), softcap,
                             sinks, dropout)
    else:
        band = {"attn_mask": p.mask(window, two_way, q.device)} if window or two_way else {"is_causal": True}
        out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), dropout_p=dropout, scale=scaling,
                                             enable_gqa=k.shape[1] != q.shape[1], **band)
    return out.transpose(0, 1).flatten(1, 2)[:, valid][None]


def packed_attention(module: Any, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     scaling: float | None = None, dropout: float = 0.0, **kwargs: Any) -> tuple[Tensor, None]:
    """transformers attention interface: q (1, H, S_local, d), k/v (1, KV, S_local, d) -> (1, S_local, H, d).
    With ``Packing.group`` the row is split over that SP group: one all-to-all gathers the sequence and scatters
    the heads, attention runs over the whole row with H/sp heads, and one all-to-all swaps back."""

    p: Packing | None = kwargs.get(KWARG)
    if p is None:
        raise RuntimeError(f"a model built with attn_implementation={NAME!r} takes packed rows only: call it with "
                           f"{KWARG}=lib.attention.packing(position_ids) (lib/forward.py does)")
    dropout = dropout if module.training else 0.0
    # what the model's attention does besides causal softmax(q k / sqrt(d)) v: Mistral/Gemma/GPT-OSS sliding
    # windows, Gemma-2 soft-capping, GPT-OSS sinks (the names transformers' attention calls pass)
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    # Gemma-3's image blocks attend both ways in every layer, Gemma-4's in its sliding-window layers only
    two_way = p.two_way == "all" or (p.two_way == "sliding" and bool(window))
    if p.group is None:
        out = attend(query, key, value, p, scaling, dropout, window, softcap, sinks, two_way)
        return out.transpose(1, 2).contiguous(), None
    sp, kv_heads = p.sp_size, key.shape[1]
    if kv_heads < sp:  # sp % kv_heads == 0 (checked before loading): one repeated kv head per rank
        key = key.repeat_interleave(sp // kv_heads, dim=1)
        value = value.repeat_interleave(sp // kv_heads, dim=1)
    q = ulysses.all_to_all(query, p.group, scatter_dim=1, gather_dim=2)  # (1, H/sp, S, d)
    k = ulysses.all_to_all(key, p.group, scatter_dim=1, gather_dim=2)
    v = ulysses.all_to_all(value, p.group, scatter_dim=1, gather_dim=2)
    if sinks is not None:  # this rank holds the sp_rank-th slice of the heads
        sinks = sinks.chunk(sp)[dist.get_rank(p.group)]
    out = attend(q, k, v, p, scaling, dropout, window, softcap, sinks, two_way)  # (1, H/sp, S, d)
    out = ulysses.all_to_all(out, p.group, scatter_dim=2, gather_dim=1)  # (1, H, S_local, d)
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register the packed attention with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, packed_attention)
    return NAME


def uses_packed_attention(model: torch.nn.Module) -> bool:
    """Whether the model's decoder attends through ``packed_attention`` (a vision-language model's text config
    carries its own implementation)."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return NAME in (getattr(config, "_attn_implementation", None), getattr(text, "_attn_implementation", None))
