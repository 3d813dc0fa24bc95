"""The update's micro-batch token budget sized from the device's memory in bytes (``actor.batching.token_budget
memory``), measured once at start-up, instead of a fixed count.

    tokens = (device total - in use now - AdamW moments to come - margin) / activation bytes per token

- in use now: every byte on the device once the trainer's models and the (sleeping) engine are built, read from the
  driver (``mem_get_info``), so the engine's pools and anything else on the device count;
- AdamW moments to come: two fp32 tensors per trained parameter of this rank's shard, made by the first step (none
  when the optimizer is offloaded);
- activation bytes per token: the peak a forward and backward of the update's own path (packed rows, the model's
  head and loss path as configured) adds above what was allocated before it, over a probe of PROBE_TOKENS tokens;
  gradients and FSDP's gathered layers are in it, so the figure errs large (a smaller budget, never an OOM from it);
- margin: ``DEVICE_MARGIN_BYTES`` of lib/engines.py (CUDA context, NCCL, fragmentation).

The budget is capped at ``max_tokens_per_rank`` (16,384 by default), is the smallest of the ranks' and must hold one
full sequence. Where no device allocator can be read (CPU), the budget is ``max_tokens_per_rank``. The code asks ``torch.cuda.is_available()``, so
lib/fake_device's counters drive it in the CPU tests.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lib.forward import response_log_probs
from lib.protocol import DataProto

PROBE_TOKENS = 2048
PROBE_ROW = 512  # tokens a probe row holds: half prompt, half response


def probe_batch(num_tokens: int, vocab_size: int, seed: int = 0) -> DataProto:
    """Rows of PROBE_ROW tokens (half prompt, half response), random ids, ``num_tokens`` in all."""
    g = torch.Generator().manual_seed(seed)
    rows, half = max(1, num_tokens // PROBE_ROW), PROBE_ROW // 2
    ids = torch.randint(0, vocab_size, (rows, 2 * half), generator=g)
    mask = torch.ones_like(ids)
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask,
                                "position_ids": torch.arange(2 * half).expand(rows, -1).contiguous(),
                                "responses": ids[:, half:], "response_mask": torch.ones(rows, half)})


def activation_bytes_per_token(model: nn.Module, device: torch.device, vocab_size: int, packed: bool,
                               num_tokens: int = PROBE_TOKENS) -> float:
    """What one forward and backward of the update's path adds at its peak, per token (module docstring). The
    gradients it leaves are dropped again."""
    batch = probe_batch(num_tokens, vocab_size).to(device)
    tokens = int(batch.batch["attention_mask"].sum())
    model.train()
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    logp, _ = response_log_probs(model, batch, packed=packed)
    logp.sum().backward()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    model.zero_grad(set_to_none=True)
    return max(peak - base, 1) / tokens


def token_budget(model: nn.Module, device: torch.device, vocab_size: int, packed: bool, cap: int, min_tokens: int,
                 moments_bytes: int, margin_bytes: int) -> tuple[int, str]:
    """The budget and the line that says how it was sized. Raises ValueError when memory holds no full sequence."""
    if not torch.cuda.is_available():
        return cap, f"token budget {cap} tokens per micro-batch (max_tokens_per_rank: no device memory to size from)"
    per_token = activation_bytes_per_token(model, device, vocab_size, packed)
    free, total = torch.cuda.mem_get_info(device)
    left = free - moments_bytes - margin_bytes
    fits = torch.tensor([int(left // per_token) if left > 0 else 0], device=device)
    if dist.is_initialized():  # world: every rank takes the smallest budget (all refuse or none; one plan of work)
        dist.all_reduce(fits, op=dist.ReduceOp.MIN)
    fits = int(fits.item())
    sizes = (f"{total / 2**30:.1f} GiB device, {(total - free) / 2**30:.1f} in use, {moments_bytes / 2**30:.1f} for "
             f"AdamW's moments, {margin_bytes / 2**30:.1f} margin; {per_token / 2**10:.1f} KiB of activations a token")
    if fits < min_tokens:
        raise ValueError(f"actor.batching.token_budget memory: the device holds {fits} tokens of activations "
                         f"({sizes}), fewer than one full sequence ({min_tokens}); shorten data.max_prompt_length / "
                         f"rollout.max_response_length, turn on actor.model.gradient_checkpointing or "
                         f"actor.fsdp.optimizer_offload, or use more ranks")
    tokens = min(fits, cap)
    return tokens, (f"token budget {tokens} tokens per micro-batch (sized from memory: {fits} fit, capped at "
                    f"max_tokens_per_rank {cap}; {sizes})")


def trained_bytes(model: nn.Module) -> int:
    """AdamW's two fp32 moments for this rank's trained parameters (its shards): what its first step adds."""
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in model.parameters() if p.requires_grad)
    return 2 * 4 * local


def size_from_memory(batching: Any, model: nn.Module, device: torch.device, vocab_size: int, min_tokens: int,
                     offloaded: bool, margin_bytes: int) -> tuple[Any, str]:
    """``batching`` with max_tokens_per_rank sized from memory (a copy), and the line to print."""
    tokens, line = token_budget(model, device, vocab_size, batching.use_remove_padding, batching.max_tokens_per_rank,
                                min_tokens, 0 if offloaded else trained_bytes(model), margin_bytes)
    return dataclasses.replace(batching, max_tokens_per_rank=tokens), line
