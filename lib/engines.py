"""The run's rollout engines, built asleep from the config: the policy's (vLLM or HF, its KV cache sized in bytes
from the device's total memory) and on-policy distillation's teacher's (HF)."""

from __future__ import annotations

from typing import Any

import torch

from lib import budget, lora, routing
from lib.config import Config
from lib.engine import SamplingConfig, plan_kv_cache
from lib.engine.hf import HFEngine
from lib.engine.vllm import VLLMEngine
from lib.models import load_config, stop_token_ids
from lib.preflight import picks_vllm
from lib.run import Run
from lib.vision import placeholder_ids


def engine_dtype(run: Run) -> torch.dtype:
    return torch.bfloat16 if run.topo.device.type == "cuda" else torch.float32


def _samplings(cfg: Config) -> tuple[SamplingConfig, SamplingConfig]:
    """The rollout's sampling and validation's."""
    r = cfg.rollout
    return (SamplingConfig(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k, n=r.n,
                           max_new_tokens=r.max_response_length, seed=cfg.trainer.seed),
            SamplingConfig(temperature=r.val_temperature, n=r.val_n, max_new_tokens=r.max_response_length,
                           seed=cfg.trainer.seed + 1))


def _hf_engine(run: Run, path: str, eos: list[int], lora: Any = None, name: str = "policy") -> HFEngine:
    """An HF engine of the model at ``path``'s shape with the run's sampling, asleep."""
    cfg, topo = run.cfg, run.topo
    sampling, val = _samplings(cfg)
    return HFEngine(load_config(path, cfg.actor.model.trust_remote_code), topo.device, run.tokenizer.pad_token_id,
                    eos, sampling, val, dtype=engine_dtype(run), rank_seed=topo.rollout_dp_rank,
                    attn_implementation=cfg.actor.model.attn_implementation, batch_tokens=cfg.rollout.hf_batch_tokens,
                    lora=lora, vision=run.vision, routes=cfg.rollout.routing_replay and path == cfg.actor.model.path,
                    name=name)


def build_teacher_engine(run: Run) -> HFEngine:
    """An HF engine of distill.teacher's shape, with the policy's sampling and its own stop tokens, asleep (the teacher's
    own validation, lib.validation.validate_teacher, fills and uses it once)."""
    path = run.cfg.distill.teacher
    return _hf_engine(run, path, stop_token_ids(path, run.tokenizer, run.cfg.actor.model.trust_remote_code),
                      name="teacher")


def build_engine(run: Run) -> Any:
    cfg, topo, r = run.cfg, run.topo, run.cfg.rollout
    sampling, val = _samplings(cfg)
    tok = run.tokenizer
    eos = stop_token_ids(cfg.actor.model.path, tok, cfg.actor.model.trust_remote_code)
    run.logger.print(f"stop tokens: {eos} ({', '.join(repr(tok.convert_ids_to_tokens(i)) for i in eos)})")
    if picks_vllm(cfg):

        # a wave: the training samples of one generate call (a TP group generates its ranks' rows together), at
        # most max_num_seqs; validation runs in waves of the same size
        wave = min(run.sizes.samples_per_rank * topo.rollout_tp_size, r.max_num_seqs)
        max_model_len = cfg.data.max_prompt_length + r.max_response_length
        kv_bytes = int(r.kv_cache_gb * 2**30)
        if kv_bytes:
            run.logger.print(f"vLLM KV cache {r.kv_cache_gb:g} GiB per rank (rollout.kv_cache_gb)")
        else:
            dtype = engine_dtype(run)
            model_config = load_config(cfg.actor.model.path, cfg.actor.model.trust_remote_code)
            kv_bytes, line = plan_kv_cache(model_config, wave, max_model_len, dtype.itemsize, topo.rollout_tp_size,
                                           device_budget(run, dtype))
            run.logger.print(line)
        return VLLMEngine(cfg.actor.model.path, topo, tok.pad_token_id, eos, sampling, val,
                          max_model_len=max_model_len, max_num_seqs=wave, kv_cache_bytes=kv_bytes,
                          gpu_memory_utilization=r.gpu_memory_utilization,
                          dtype=str(engine_dtype(run)).removeprefix("torch."), enforce_eager=r.enforce_eager,
                          trust_remote_code=cfg.actor.model.trust_remote_code, lora=engine_lora(run),
                          route_layers=routing.moe_layers(run.actor.model) if r.routing_replay else None,
                          sync_plan=r.sync_plan, **vllm_image_kwargs(run))

    return _hf_engine(run, cfg.actor.model.path, eos, engine_lora(run))


def vllm_image_kwargs(run: Run) -> dict[str, Any]:
    """What vLLM needs for image prompts: the most images a prompt holds, the trainer's pixel bounds (vLLM's
    processor must cut each image into as many tokens as the trainer's) and the placeholder ids never sampled."""
    if not run.vision:
        return {}
    m = run.cfg.actor.model
    bounds = {k: v for k, v in (("min_pixels", m.min_pixels), ("max_pixels", m.max_pixels)) if v}
    most = max(run.train.max_images, run.val.max_images if run.val is not None else 0)
    config = load_config(m.path, m.trust_remote_code)
    return {"images_per_prompt": most, "mm_processor_kwargs": bounds, "banned_ids": placeholder_ids(config),
            "videos": getattr(config, "video_token_id", None) is not None}


def engine_lora(run: Run) -> Any:
    """The PEFT config the engine serves adapters of (None: full weights, LoRA off or merged)."""
    if run.lora is None or run.lora.merge:
        return None
    return lora.peft_config(run.cfg.actor.lora)


# device memory kept back beside the trainer's state and the engine's weights: CUDA context, NCCL buffers,
# allocator fragmentation, the sampler's logits
DEVICE_MARGIN_BYTES = 4 * 2**30


def device_budget(run: Run, engine_dtype_: torch.dtype) -> int | None:
    """GPU: the bytes left for the KV cache while the engine is awake, from the device's total memory (not its free
    memory, which depends on what else runs): minus what the trainer holds now (policy and reference), the AdamW
    moments its first step will add (unless offloaded), the engine's weights and ``DEVICE_MARGIN_BYTES``. None on
    CPU (the size is what the run needs)."""
    topo = run.topo
    if topo.device.type != "cuda":
        return None
    total = torch.cuda.get_device_properties(topo.device).total_memory
    params = list(run.actor.model.parameters())
    moments = 0 if run.cfg.actor.fsdp.optimizer_offload else budget.trained_bytes(run.actor.model)
    engine_weights = sum(p.numel() for p in params) * engine_dtype_.itemsize // topo.rollout_tp_size
    return total - torch.cuda.memory_allocated(topo.device) - moments - engine_weights - DEVICE_MARGIN_BYTES
