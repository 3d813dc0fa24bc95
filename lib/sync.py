"""Streamed, bucketed weight sync from FSDP2 shards into a rollout engine, and the rollout-mode switch.

Every rank walks the parameters in the same order, casts its shards to the engine's dtype and gathers them one
bucket at a time (one all-gather over the FSDP mesh per bucket of at most ``bucket_bytes``: no rank-0-only sends,
lib.fsdp.iter_full_params_bucketed), and hands the engine buckets of at most ``bucket_bytes`` (counted in the
engine's dtype). A shard that is the whole tensor (a shard group of one rank: one GPU, a replicated model) goes
uncast: the engine's copy casts it (the sync plan's foreach, a loader's ``copy_``), with no cast tensor allocated
and written a tensor at a time first (290 for the 0.5B shape on one H200). The extra memory at
any moment is about two buckets (the gathered buffer and the tensors cut from it), never the whole model. The order
of a step (vLLM's sleep-mode rules):

    gc.collect + empty_cache -> wake_up(["weights"]) -> stream weights (one post-load processing per sync)
    -> [offload training params] -> empty_cache -> wake_up(["kv_cache"]) -> reset_prefix_cache -> generate
    -> sleep(level)

Each waking step first returns the blocks training's caching allocator holds but no longer uses, so vLLM's
pool can take them. Weights are written only after their wake, and never reloaded from disk afterwards
(a no-argument ``reload_weights`` brings the checkpoint back: TRL bug 5312).
"""

from __future__ import annotations

import gc
import itertools
import time
from typing import Iterator

import torch
from torch import nn

from lib import lora
from lib.engine import RolloutEngine
from lib.fsdp import iter_full_params_bucketed, iter_persistent_buffers, load_model, offload_model


WEIGHTS = {"full": iter_full_params_bucketed, "merged": lora.iter_merged, "base": lora.iter_base}
"""The full tensors a sync can stream, in Hugging Face names, each an iterator over (model, dtype) (the full weights
also over bucket_bytes: one all-gather per bucket of shards)."""


def engine_bytes(tensor: torch.Tensor, dtype: torch.dtype | None) -> int:
    """A sent tensor's bytes in the engine: a floating tensor in ``dtype`` (the engine's copy casts an uncast one),
    anything else (or without ``dtype``) as it is."""
    return tensor.numel() * (dtype.itemsize if dtype is not None and tensor.is_floating_point()
                             else tensor.element_size())


def buckets(weights: Iterator[tuple[str, torch.Tensor]], bucket_bytes: int, dtype: torch.dtype | None = None
            ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group (name, tensor) pairs into lists of at most ``bucket_bytes`` (a larger tensor goes alone), counted as
    the engine holds them (``engine_bytes``)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in weights:
        nbytes = engine_bytes(tensor, dtype)
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def sync_weights(model: nn.Module, engine: RolloutEngine, dtype: torch.dtype, bucket_bytes: int = 512 * 2**20,
                 weights: str = "full") -> dict[str, float]:
    """Stream the FSDP ``model``'s full weights (``weights``, a key of WEIGHTS: its parameters, or a LoRA model's base
    or merged weights), then its persistent buffers, into an awake ``engine``; once more when the engine's
    ``finish_sync`` asks (the first sync of a vLLM engine proves its plan with the same weights: lib.engine.plan).
    Returns time, GB sent, peak extra GB, passes."""
    device = next(model.parameters()).device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        allocs = torch.cuda.memory_stats(device).get("num_device_alloc", 0)
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    sent = 0
    largest_bucket = 0
    passes = 0
    again = True
    while again:  # a second pass only when the engine asks for the same weights again (its sync plan's proof)
        params = (iter_full_params_bucketed(model, dtype, bucket_bytes, cast_whole=False) if weights == "full"
                  else WEIGHTS[weights](model, dtype))
        # the weights that are not parameters go after the parameters, whatever sent those (full, base or merged)
        for bucket in buckets(itertools.chain(params, iter_persistent_buffers(model, dtype)), bucket_bytes, dtype):
            nbytes = sum(engine_bytes(t, dtype) for _, t in bucket)
            sent += nbytes if not passes else 0
            largest_bucket = max(largest_bucket, nbytes)
            engine.load_weights(bucket)
            del bucket
        # every engine parameter written (or a declared alias of one): never a stale tensor
        again = bool(engine.finish_sync())
        passes += 1
    if cuda:
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    metrics = {"sync/seconds": elapsed, "sync/gb": sent / 2**30, "sync/s_per_gb": elapsed / max(sent / 2**30, 1e-9),
               "sync/passes": float(passes),
               "sync/peak_extra_gb": largest_bucket / 2**30}  # on CPU what the bucketing bounds (no allocator peak)
    if cuda:
        metrics["sync/peak_extra_gb"] = (torch.cuda.max_memory_allocated(device) - base) / 2**30
        # the allocator's calls into the device (cudaMalloc) in the sync, each a host stall (the cache is emptied
        # before the sync)
        metrics["sync/device_allocs"] = float(torch.cuda.memory_stats(device).get("num_device_alloc", 0) - allocs)
    return metrics


def sync_adapter(model: nn.Module, engine: RolloutEngine, adapter: lora.Sync) -> dict[str, float]:
    """Send the LoRA adapter's full tensors to the engine as a new version, then check that the engine holds exactly
    that version over every LoRA module of the trainer (verl #7495 synced zero adapter tensors for months)."""
    t0 = time.perf_counter()
    tensors = dict(lora.iter_adapter(model))
    if not tensors:
        raise RuntimeError("the adapter sync gathered no LoRA tensors from the trainer's model")
    adapter.version += 1
    engine.load_adapter(adapter.version, tensors)
    held, modules = engine.adapter_state()
    if held != adapter.version or modules != adapter.num_modules:
        raise RuntimeError(f"after the adapter sync the engine holds version {held} over {modules} LoRA modules; "
                           f"expected version {adapter.version} over {adapter.num_modules}")
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    return {"sync/adapter_seconds": time.perf_counter() - t0, "sync/adapter_mb": nbytes / 2**20,
            "sync/adapter_tensors": float(len(tensors)), "sync/adapter_version": float(adapter.version)}


def plan(engine: RolloutEngine, adapter: lora.Sync | None) -> tuple[str | None, bool]:
    """What one sync sends, decided here alone: the full weights streamed (a key of WEIGHTS, or None for none), and
    whether the LoRA adapter follows. A full model: its parameters. A LoRA policy in merge mode: W + s*BA. A LoRA
    policy served as an adapter: the base only while the engine lacks it (its first wake, or after a level-2 sleep),
    then the adapter every step."""
    if adapter is None:
        return "full", False
    if adapter.merge:
        return "merged", False
    return (None if engine.base_loaded else "base"), True


def enter_rollout(model: nn.Module, engine: RolloutEngine, dtype: torch.dtype, bucket_bytes: int = 512 * 2**20,
                  offload_params: bool = False, adapter: lora.Sync | None = None) -> dict[str, float]:
    """Training -> rollout: wake the engine's weights, stream in what ``plan`` says, optionally park the training
    shards on CPU, then wake the KV cache, send the adapter (into the engine's finished base; vLLM: after its
    reload) and drop any cached prefixes (computed with the old weights)."""
    weights, send_adapter = plan(engine, adapter)
    cuda = torch.cuda.is_available()
    if cuda:
        gc.collect()  # tensors only Python's cycle collector still holds keep their blocks in the cache
        torch.cuda.empty_cache()
    engine.wake_up(["weights"])
    metrics = sync_weights(model, engine, dtype, bucket_bytes, weights) if weights else {"sync/seconds": 0.0,
                                                                                          "sync/gb": 0.0}
    if offload_params:
        offload_model(model)
    if cuda:
        torch.cuda.empty_cache()  # the sync's buckets and gathered tensors
    engine.wake_up(["kv_cache"])
    if send_adapter:
        metrics.update(sync_adapter(model, engine, adapter))
    engine.reset_prefix_cache()
    return {**metrics, **getattr(engine, "metrics", {})}


def exit_rollout(model: nn.Module, engine: RolloutEngine, device: torch.device, level: int = 2,
                 offload_params: bool = False) -> None:
    """Rollout -> training: the engine sleeps (level 2 drops its weights: the next sync sends all of them; level 1,
    a LoRA policy's, keeps the base)."""
    engine.sleep(level)
    if offload_params:
        load_model(model, device)
