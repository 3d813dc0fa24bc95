"""What the vision tower costs in a policy update: ``timing/vision_tower_share`` (a wall-clock share, logged with the
stage times) and ``vision/tower_param_share``.

Time: the tower's forward passes and its backward, over the block's wall time. Its backward starts when the gradient
of its output arrives and ends when the gradient of its input (the pixel patches, made to require one for this)
has been computed; a forward that runs inside that interval (gradient checkpointing's recomputation) is not counted
twice. On a GPU each boundary synchronises the device, so the intervals are the kernels' and not the launches'.
Memory: the tower's share of the trained parameters, which is its share of the weights, gradients and optimizer
state; on a GPU also ``memory/vision_tower_activation_gb``, the memory its forward passes leave allocated (what
backward keeps of them), summed over the block.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from lib.vision import is_vision_param


def towers(model: nn.Module) -> list[nn.Module]:
    """The outermost modules of the vision tower and its merger (Qwen-VL: ``model.visual``)."""
    out = []
    for name, module in model.named_modules():
        parent = name.rpartition(".")[0]
        if name and is_vision_param(name + ".") and not (parent and is_vision_param(parent + ".")):
            out.append(module)
    return out


def _sync(cuda: bool) -> float:
    if cuda:
        torch.cuda.synchronize()
    return time.perf_counter()


@contextlib.contextmanager
def tower_clock(model: nn.Module, metrics: dict[str, float]) -> Iterator[None]:
    """Measure the vision tower over the block (nothing for a model without one) into ``metrics``."""
    mods = towers(model)
    if not mods:
        yield
        return
    cuda = torch.cuda.is_available()  # a GPU machine trains on its GPU (tests: lib/fake_device.py on CPU)
    state: dict[str, Any] = {"seconds": 0.0, "backward": 0, "memory": 0, "forward_at": 0.0, "memory_at": 0}
    trained = any(p.requires_grad for m in mods for p in m.parameters())  # a frozen tower has no backward to time

    def before(module: nn.Module, args: tuple, kwargs: dict) -> tuple:
        state["forward_at"] = _sync(cuda)
        state["memory_at"] = torch.cuda.memory_allocated() if cuda else 0
        pixels = args[0] if args else kwargs.get("hidden_states")
        if trained and torch.is_grad_enabled() and torch.is_tensor(pixels) and pixels.is_floating_point():
            pixels = pixels.detach().requires_grad_()
            pixels.register_hook(ended)
            if args:
                args = (pixels, *args[1:])
            else:
                kwargs = {**kwargs, "hidden_states": pixels}
        return args, kwargs

    def after(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        now = _sync(cuda)
        if not state["backward"]:  # a recomputation inside backward is already in the backward's interval
            state["seconds"] += now - state["forward_at"]
            state["memory"] += (torch.cuda.memory_allocated() - state["memory_at"]) if cuda else 0
        out = output[0] if isinstance(output, tuple) else getattr(output, "pooler_output", None)
        if trained and torch.is_tensor(out) and out.requires_grad:  # the merged features, which the LM takes
            out.register_hook(started)

    def started(grad: torch.Tensor) -> None:
        state["backward"] += 1
        state["backward_at"] = _sync(cuda)

    def ended(grad: torch.Tensor) -> None:
        if state["backward"]:
            state["backward"] -= 1
            state["seconds"] += _sync(cuda) - state["backward_at"]

    hooks = [h for m in mods for h in (m.register_forward_pre_hook(before, with_kwargs=True),
                                        m.register_forward_hook(after, with_kwargs=True))]
    t0 = _sync(cuda)
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
    elapsed = _sync(cuda) - t0
    params = [p for p in model.parameters() if p.requires_grad]
    tower = {id(p) for m in mods for p in m.parameters() if p.requires_grad}
    total = sum(p.numel() for p in params)
    metrics["timing/vision_tower_share"] = state["seconds"] / max(elapsed, 1e-9)
    metrics["vision/tower_param_share"] = sum(p.numel() for p in params if id(p) in tower) / max(total, 1)
    if cuda:
        metrics["memory/vision_tower_activation_gb"] = state["memory"] / 2**30
