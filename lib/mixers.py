"""Layers that mix along the sequence besides attention, under packing and Ulysses.

A packed row holds several sequences back to back (lib/forward.py). lib/attention.py keeps attention inside each
sequence; the other sequence-mixing layers of 2026's hybrid models would not know the bounds and carry state from
one sequence into the next: Gated DeltaNet linear attention (Qwen3.5, Qwen3-Next), LFM2's causal short
convolutions, Mamba-2 (Granite-4). transformers' torch paths for them take no sequence bounds, so each such layer
runs once per packed sequence here: its forward is wrapped to split the row at the bounds that travel with the model
call (``lib.attention.Packing``, the keyword argument every decoder layer hands down to its mixer) and join the
outputs. Token for token this is the padded forward of each sequence.

With Ulysses the row is split over the SP group; the mixer then needs the whole sequence, so every rank gathers
the row (one autograd all-reduce of the slices placed in a zero row: its backward hands each rank the gradient of
its own positions, summed over the group), runs the mixer on every sequence and keeps its own slice. The mixer's
work is repeated on every rank of the group (attention's is not); its heads and channels are independent, so a
head-split all-to-all would avoid that, at the cost of splitting each layer's projections: not done here.

A layer that mixes the sequence and is not found here would still compute another model when packed: the
start-up self-check (lib/selfcheck.py) compares the packed forward with the padded one on the user's model and
stops the run naming the mode.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lib import ulysses
from lib.attention import KWARG, Packing

# class-name endings of the sequence mixers of the architectures tested (tests/zoo.py); a module that owns a
# Conv1d (a causal convolution over the sequence) counts as one too
NAMES = ("GatedDeltaNet", "ShortConv", "MambaLayer", "Mamba2Mixer", "MambaMixer")
WRAPPED = "_spmd_packed_mixer"


def is_mixer(module: nn.Module) -> bool:
    if type(module).__name__.endswith(NAMES):
        return True
    return any(isinstance(child, nn.Conv1d) for child in module.children())


def find(model: nn.Module) -> list[str]:
    """Names of the modules that mix along the sequence apart from attention (outermost only)."""
    found: list[str] = []
    for name, module in model.named_modules():
        if is_mixer(module) and not any(name.startswith(f"{outer}.") for outer in found):
            found.append(name)
    return found


def _run_segments(forward: Any, hidden: torch.Tensor, p: Packing, args: tuple, kwargs: dict) -> torch.Tensor:
    """The mixer on each packed sequence of ``hidden`` (1, S, D) alone, outputs joined in order."""
    outs = []
    for start, end in p.segments:
        out = forward(hidden[:, start:end], *args, **kwargs)
        if isinstance(out, tuple):  # (hidden, None...) for mixers that return a tuple
            if any(x is not None for x in out[1:]):
                raise RuntimeError("a packed sequence mixer returned more than its hidden states")
            out = out[0]
        outs.append(out)
    return torch.cat(outs, dim=1)


def _segmented(forward: Any, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    p: Packing | None = kwargs.pop(KWARG, None)
    if p is None:  # padded rows or generation: the model's own forward
        return forward(hidden_states, *args, **kwargs)
    if kwargs.get("cache") is not None or kwargs.get("cache_params") is not None:
        raise RuntimeError("packed rows are for training forwards: no cache")
    if p.group is None:
        return _run_segments(forward, hidden_states, p, args, kwargs)
    # Ulysses: this rank holds one contiguous slice of the padded row, the same length on every rank
    local = hidden_states.shape[1]
    rank = dist.get_rank(p.group)
    full = hidden_states.new_zeros((hidden_states.shape[0], local * p.sp_size, *hidden_states.shape[2:]))
    full = full.index_copy(1, torch.arange(rank * local, (rank + 1) * local, device=full.device), hidden_states)
    full = ulysses.all_reduce_sum(full, p.group)  # sp group: the whole row on every rank
    out = _run_segments(forward, full, p, args, kwargs)
    return out[:, rank * local:(rank + 1) * local]


def bound(model: nn.Module) -> list[str]:
    """Make every sequence mixer of ``model`` honour packed bounds (idempotent); returns their names."""
    names = find(model)
    for name in names:
        module = model.get_submodule(name)
        if getattr(module, WRAPPED, False):
            continue
        original = module.forward
        # an instance attribute: nn.Module.__call__ (hooks, FSDP, checkpointing) calls it in place of the class's
        module.forward = functools.partial(_segmented, original)
        setattr(module, WRAPPED, True)
    return names
