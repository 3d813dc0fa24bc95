"""A profile of a few updates, summed up in a few KB of text: where the time goes, so that a GPU window's MFU figure
says what to change (the H100 run of 2026-11-27 measured 16% MFU and could not say why).

    with profiled(device) as prof:
        ...two updates...
    text, headline = summary(prof, device, wall_s, peaks)

On a GPU it reads the device's kernels (their own time), on CPU the operators' own CPU time: the top entries, the
shares of matmuls, attention, the log-probs (softmax and friends), the optimizer, communication and elementwise
work, and on a GPU the device's idle time within the profiled wall time. ``peaks``: peak memory by phase, measured
by the caller (``PhasePeaks``).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator

import torch
from torch.autograd import DeviceType

# kernel or operator name -> category; the first pattern that matches wins
CATEGORIES = (
    ("communication", r"nccl|all_gather|allgather|reduce_scatter|all_reduce|allreduce|gloo|broadcast|c10d"),
    ("optimizer", r"adam|optimizer|multi_tensor_apply|_foreach"),
    ("attention", r"flash|fmha|attention|sdpa|scaled_dot_product|varlen"),
    ("log-probs", r"log_softmax|logsumexp|softmax|cross_entropy|nll_loss|logprob|LogProbs"),
    ("matmul", r"gemm|matmul|aten::mm\b|aten::addmm|aten::bmm|aten::linear|cutlass|nvjet|xmma|sm\d+_|cublas"),
    ("norm, activation, rotary", r"rms|norm|silu|gelu|swiglu|rotary|rope|mul|add|pow|rsqrt|sigmoid|cat|neg"),
)


def category(name: str) -> str:
    for cat, pattern in CATEGORIES:
        if re.search(pattern, name, re.IGNORECASE):
            return cat
    return "other"


@contextlib.contextmanager
def profiled(device: torch.device) -> Iterator[torch.profiler.profile]:
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        yield prof
    if device.type == "cuda":
        torch.cuda.synchronize()


class PhasePeaks:
    """Peak allocated memory by phase of an update: the forwards and backwards of its micro-batches, and the optimizer
    step (read through the optimizer's step hooks). GPU only (the CPU allocator keeps no peak)."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.peaks = {"forward+backward": 0, "optimizer step": 0}
        self.cuda = torch.cuda.is_available()
        self.handles = [optimizer.register_step_pre_hook(self._pre), optimizer.register_step_post_hook(self._post)]
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()

    def _read(self, phase: str) -> None:
        if self.cuda:
            self.peaks[phase] = max(self.peaks[phase], torch.cuda.max_memory_allocated())
            torch.cuda.reset_peak_memory_stats()

    def _pre(self, *_) -> None:
        self._read("forward+backward")

    def _post(self, *_) -> None:
        self._read("optimizer step")

    def close(self) -> dict[str, int]:
        for h in self.handles:
            h.remove()
        return self.peaks if self.cuda else {}


def _busy(intervals: list[tuple[float, float]]) -> float:
    """The union's length of (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def summary(prof: torch.profiler.profile, device: torch.device, wall_s: float, peaks: dict[str, int] | None = None,
            title: str = "", top: int = 15) -> tuple[str, str]:
    """The profile as text (top entries by own time, shares by category, idle time on a GPU, peaks by phase) and its
    headline (the three largest categories' shares, and the GPU's idle seconds) for a report's row."""
    gpu = device.type == "cuda"
    events = prof.events()
    if gpu:
        own = [(e.name, e.device_time_total if hasattr(e, "device_time_total") else e.cuda_time_total,
                e.time_range.start, e.time_range.end) for e in events if e.device_type == DeviceType.CUDA]
        unit = "GPU kernels"
    else:
        own = [(e.name, e.self_cpu_time_total, 0, 0) for e in events if e.device_type == DeviceType.CPU
               and e.self_cpu_time_total > 0]
        unit = "CPU operators (own time)"
    by_name: dict[str, float] = {}
    by_cat: dict[str, float] = {}
    for name, us, _, _ in own:
        by_name[name] = by_name.get(name, 0.0) + us
        by_cat[category(name)] = by_cat.get(category(name), 0.0) + us
    total = sum(by_name.values()) or 1e-9
    lines = [f"# Profile{': ' + title if title else ''}", "",
             f"{unit}: {total / 1e6:.3f} s over {wall_s:.3f} s of wall time, {len(own)} entries"]
    idle = ""
    if gpu:
        busy = _busy([(a, b) for _, _, a, b in own]) / 1e6
        idle = f"GPU idle: {max(wall_s - busy, 0.0):.3f} s"
        lines.append(f"{idle} ({max(wall_s - busy, 0.0) / max(wall_s, 1e-9):.1%} of the wall time: no kernel "
                     "running, the host launching or waiting)")
    shares = sorted(by_cat.items(), key=lambda kv: -kv[1])
    lines += ["", "Shares by category:"]
    lines += [f"  {cat:28s} {us / total:6.1%}  {us / 1e6:8.3f} s" for cat, us in shares]
    lines += ["", f"Top {top} by own time:"]
    for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:top]:
        lines.append(f"  {us / total:6.1%}  {us / 1e3:9.1f} ms  [{category(name)}]  {name[:110]}")
    if peaks:
        lines += ["", "Peak memory by phase: " + ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in peaks.items())]
    headline = ", ".join(f"{cat} {us / total:.1%}" for cat, us in shares[:3]) + (f"; {idle}" if idle else "")
    return "\n".join(lines) + "\n", headline
