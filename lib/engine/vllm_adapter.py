"""What differs between vLLM releases (0.25 to 0.32) and its CPU build, for lib.engine.vllm: the engine arguments
each release takes, the sampling parameters, the layerwise reload (LoRA layers unwrapped around it, the CPU build's
experts prepacked after it, the MoE runner's fused router refreshed), the CPU build's shared-memory segments, the
rotary reload warning. vllm itself is imported inside the functions that use it (a heavy optional package).
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import shutil
from typing import Any

import torch
from torch import nn

from lib.dist import Topology
from lib.engine import SamplingConfig, stop_ids
from lib.lora import VLLM_LORA_RANKS


def routes_kwargs(route_layers: list[int] | None) -> dict:
    """What makes vLLM return the experts its routers chose (``CompletionOutput.routed_experts`` in 0.25 and 0.32
    alike). 0.32 delivers them through its auxiliary-output connector, wired to the V2 model runner only, which it
    does not pick by itself for every model: asked for here. 0.25 captures them in the V1 runner (its V2 runner
    lacks the capture and falls back to V1 unless told otherwise)."""
    if not route_layers:
        return {}
    if importlib.util.find_spec("vllm.config.aux_output") is not None:
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    elif os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1":
        raise ValueError("rollout.routing_replay: this vLLM returns routes from its V1 model runner only; unset "
                         "VLLM_USE_V2_MODEL_RUNNER")
    return {"enable_return_routed_experts": True}


def logprobs_mode_kwargs() -> dict:
    # processed log-probs (after temperature) appeared as an engine argument in 0.10.2; all supported releases have it
    return {"logprobs_mode": "processed_logprobs"}


def exact_filter_rule(device: torch.device, sp: SamplingConfig) -> None:
    """Top-k/top-p sampling on CUDA through vLLM's sort-based rule (``apply_top_k_top_p_pytorch``, what its CPU
    build always runs), the rule the trainer rebuilds the kept sets with (lib.logprobs.kept_mask). Its Triton kernel
    (0.25 from 8 rows a step, 0.32 always) bisects a probability threshold in at most 18 halvings: with a long tail its
    top-p set is off by up to thousands of tokens, a set no trainer can rebuild. The kernel is chosen by the module's
    ``HAS_TRITON`` at every call (0.25 and 0.32, both model runners), so the engine sets it off in its own process
    (external_launcher: the worker is this process). 0.32's ``return_sampling_mask`` (the kept ids, CUDA's model
    runner V2 only) is not used: it refuses greedy requests (validation) and top-k 0."""
    if device.type != "cuda" or sp.temperature <= 0 or (sp.top_k <= 0 and sp.top_p >= 1.0):
        return
    from vllm.v1.sample.ops import topk_topp_sampler

    topk_topp_sampler.HAS_TRITON = False


def cpu_prefill_kwargs(device: torch.device, max_model_len: int) -> dict:
    """CPU: whole prompts per prefill. A prompt split over scheduler steps (chunked prefill, once a call's prompts
    pass max_num_batched_tokens: a multi-turn turn's long inputs, or many prompts) makes the runner rewind the
    request's seeded generator, which CPU generators cannot do ("CPU Generator does not use offset")."""
    if device.type != "cpu":
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 8192)}


def image_kwargs(images_per_prompt: int, mm_processor_kwargs: dict | None, videos: bool = True) -> dict:
    """Text prompts: token ids only (no tokenizer). Image prompts: vLLM's multimodal processor needs the tokenizer,
    at most ``images_per_prompt`` images per prompt and no video (where the model takes them), processed with the
    trainer's pixel bounds."""
    if not images_per_prompt:
        return {"skip_tokenizer_init": True}
    limits = {"image": images_per_prompt, **({"video": 0} if videos else {})}
    return {"skip_tokenizer_init": False, "limit_mm_per_prompt": limits,
            "mm_processor_kwargs": dict(mm_processor_kwargs or {})}


def lora_kwargs(lora: Any) -> dict:
    """One adapter slot, of the smallest rank vLLM takes that holds the adapter's."""
    if lora is None:
        return {}

    rank = next(r for r in VLLM_LORA_RANKS if r >= lora.r)
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1}


def count_lora_modules(worker: Any, adapter_id: int) -> int:
    """In the worker (``collective_rpc``): the LoRA modules adapter ``adapter_id`` fills, each packed sub-layer
    counted (its A tensors that are not None)."""
    manager = worker.model_runner.lora_manager._adapter_manager
    adapter = manager.get_adapter(adapter_id) if hasattr(manager, "get_adapter") else None
    if adapter is None:
        adapter = manager._registered_adapters.get(adapter_id)
    if adapter is None:
        return 0
    total = 0
    for weights in adapter.loras.values():
        a = weights.lora_a
        total += sum(x is not None for x in a) if isinstance(a, (list, tuple)) else int(a is not None)
    return total


def sampling_params(sp: SamplingConfig, eos_ids: list[int], seeds: list[int], banned: list[int]) -> list[Any]:
    """One SamplingParams per request (n is expanded into rows beforehand), each with its seed (``request_seeds``);
    greedy requests need none. ``banned`` ids get vLLM's lowest logit bias, -100 (it clamps there; the trainer
    sets them to lib.vision.BANNED_LOGIT): their probability is then at most e^-100 times what it was, and the log-prob
    of any other token moves by less than fp32 resolves."""
    from vllm import SamplingParams

    greedy = sp.temperature == 0
    common = dict(n=1, temperature=0.0 if greedy else sp.temperature, top_p=1.0 if greedy else sp.top_p,
                  top_k=0 if greedy else sp.top_k, max_tokens=sp.max_new_tokens,
                  stop_token_ids=stop_ids(eos_ids, sp), logprobs=0, detokenize=False,
                  logit_bias={i: -100.0 for i in banned} or None)
    return [SamplingParams(**common, seed=None if greedy else seed) for seed in seeds]


def sampled_logprobs(completion: Any) -> list[float]:
    """Log-prob of each sampled token (``logprobs=0`` returns just that one per position)."""
    if completion.logprobs is None:
        return [0.0] * len(completion.token_ids)
    return [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)]


def add_streamed_requests(llm: Any, ids: list[str], prompts: list[dict], params: list[Any], lora: Any) -> None:
    """Requests whose tokens come back at every engine step (``RequestOutputKind.DELTA``), added to ``llm``'s
    engine under ``ids``: what a call that may stop its requests midway reads them from (LLM.generate only returns
    finished ones). The prompts are rendered as LLM.generate renders them (its ``_preprocess_cmpl``, the same in
    0.25 and 0.32; ``LLMEngine.add_request`` warns that raw prompts are deprecated)."""
    from vllm.sampling_params import RequestOutputKind

    engine = llm.llm_engine
    for rid, prompt, p in zip(ids, llm._preprocess_cmpl(prompts), params):
        p.output_kind = RequestOutputKind.DELTA
        engine.add_request(rid, prompt, p, lora_request=lora)


def run_on_model(llm: Any, fn: Any) -> None:
    """``fn(model)`` on this process's model, inside vLLM's current-config context (weight loaders and layer
    processing read it). In-process (external_launcher), so closures and tensors pass by reference."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(llm.llm_engine.vllm_config):
        llm.apply_model(fn)


SHM_DIR, SHM_PREFIX = "/dev/shm", "spmdrl-vllm"


def unique_cpu_shm_names(topo: Topology) -> None:
    """vLLM's CPU build all-reduces a TP group through a shared-memory segment created exclusively (O_EXCL) under
    a name taken from the rendezvous address, which external_launcher makes ``env://`` in every run: a segment
    that a killed run left behind makes every later engine fail (``create shm in SHMManager failed. errno: 17``),
    and two runs on one machine collide. Here the segments are named after this launch (world rank 0's pid), and
    segments named after a launch whose process is gone are removed first."""
    owner = [os.getpid()]
    torch.distributed.broadcast_object_list(owner, src=0)  # world: one name for the launch on every rank
    name_cpu_shm(f"{SHM_PREFIX}-{owner[0]}")


def name_cpu_shm(prefix: str) -> None:
    """vLLM's CPU TP segments named ``prefix``-<group>-[<ranks>]-cpushm from now on in this process (``prefix``:
    SHM_PREFIX-<pid of a process of the launch>[-...], which remove_stale_shm reads); stale ones removed first."""
    try:
        from vllm.distributed.device_communicators import cpu_communicator
    except ImportError:
        return
    remove_stale_shm()

    def group_name(communicator: Any) -> str:
        ranks = "-".join(str(r) for r in communicator.ranks)
        return f"{prefix}-{communicator.unique_name}-[{ranks}]-cpushm".replace("/", "_").replace(":", "_")

    shm = getattr(cpu_communicator, "_CPUSHMDistributed", None)
    if shm is not None and hasattr(shm, "make_group_name"):
        shm.make_group_name = staticmethod(group_name)


def remove_stale_shm(shm_dir: str = SHM_DIR) -> list[str]:
    """Remove our vLLM shared-memory segments and LoRA adapter folders whose process (the pid in the name) no longer
    runs."""
    removed = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(SHM_PREFIX + "-"):
            continue
        pid = name[len(SHM_PREFIX) + 1:].split("-", 1)[0]
        if pid.isdigit() and not _alive(int(pid)):
            path = os.path.join(shm_dir, name)
            with contextlib.suppress(OSError):
                if os.path.isdir(path) and not os.path.islink(path):  # a crashed run's LoRA adapter folders
                    shutil.rmtree(path)
                else:
                    os.unlink(path)
                removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def shutdown(llm: Any) -> None:
    core = getattr(llm.llm_engine, "engine_core", None)  # the in-process client (V1, multiprocessing off)
    if core is not None:
        core.shutdown()


def layerwise_reload(llm: Any, begin: bool, unwrapped: list[tuple[Any, str, Any]], layers: list[Any] | None = None) -> None:
    """Open (``begin``) or close one vLLM layerwise reload. Open: the model goes back to checkpoint layout, on
    meta until each layer's weights arrive. Weight loading must go through this: after loading, vLLM may repack
    weights into kernel layouts (the CPU backend does) that plain ``load_weights`` cannot write into. Close:
    process what is left and put the kernel tensors back.

    With LoRA, the reload runs on the model as vLLM loaded it at start-up: each LoRA layer is replaced by its
    ``base_layer`` from the opening to the close (``unwrapped`` keeps them; the LoRA manager keeps its own
    references) and put back after. vLLM 0.25's LoRA layers neither load weights nor show the base's parameters
    under the layer's own name, so a sync into them failed (``no parameter named ...qkv_proj.weight``, the first
    GPU run); 0.32 forwards both. Unwrapped, both releases load the base as a model without LoRA.

    ``layers``: open the reload on these layers (and what they hold) only, the rest staying live (the layers that keep
    the loader beside a sync plan, lib.engine.plan); None: the whole model."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

    if begin:
        run_on_model(llm, lambda model: unwrapped.extend(_unwrap_lora_layers(model)))
        if layers is None:
            run_on_model(llm, initialize_layerwise_reload)
        else:
            for layer in layers:
                run_on_model(llm, lambda _: initialize_layerwise_reload(layer))
    else:
        model_config = llm.llm_engine.vllm_config.model_config
        try:
            run_on_model(llm, lambda model: finalize_layerwise_reload(model, model_config))
            run_on_model(llm, _repack_cpu_experts)
        finally:
            for parent, name, layer in reversed(unwrapped):
                setattr(parent, name, layer)
            unwrapped.clear()


def refresh_fused_gates(model: nn.Module) -> int:
    """vLLM's MoE runner (0.25 to 0.32: ``MoERunner._combined_gate_weight``) keeps ``cat([gate.weight,
    shared_expert_gate.weight])``, made at its first forward (the dummy weights' profiling run) where ROCm's AITER
    fuses the shared experts (Qwen3-Next, Qwen3.5-MoE); no reload refreshes it, so those models would route with
    the start-up gates after every sync, vLLM's loader included. Refreshed in place after each sync (a graph
    captured with its address keeps it). Returns the runners refreshed."""
    done = 0
    with torch.no_grad():
        for module in model.modules():
            cached = getattr(module, "_combined_gate_weight", None)
            if isinstance(cached, torch.Tensor):
                cached.copy_(torch.cat([module.gate.weight, module.shared_expert_gate.weight], dim=0))
                done += 1
    return done


def _repack_cpu_experts(model: Any) -> int:
    """vLLM's CPU build keeps a fused-MoE layer's expert weights prepacked in its grouped-GEMM layout (and padded):
    ``CPUUnquantizedExperts.process_weights_after_loading`` does it at start-up. On a weight update the unquantized
    MoE method (0.32: ``UnquantizedFusedMoEMethod._setup_kernel``) copies the reloaded weights into that storage and
    skips the prepack, so the kernels read plain weights as packed ones: a silently wrong model (the canary at 1.2e-2
    on a tiny Qwen3-MoE, against 6e-8 for the same weights loaded from disk). After each reload the prepack runs
    again on each such layer, as at start-up. GPU backends do their layout work in the method itself (no experts
    class of this kind): nothing to do there. Returns the layers repacked."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except Exception:  # noqa: BLE001 (a release without the CPU experts class, 0.25's GPU wheels, or one whose
        return 0  # CPU module does not import on this machine: no such layer can be in the model either)
    done = 0
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if isinstance(experts, CPUUnquantizedExperts):
            experts.process_weights_after_loading(module)
            done += 1
    return done


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


class RotaryReloadFilter(logging.Filter):
    """Drops vLLM's "RotaryEmbedding: Failed to load weights", logged at the end of every sync. Its reload counts a
    rotary layer's ``cos_sin_cache`` (a non-persistent buffer computed from the config at start-up) among the
    tensors to load; no checkpoint carries it, so at the close the layer's own cache is put back. That cache depends
    on the config alone (rope theta, scaling, head size), never on trained weights, so nothing is stale. The same
    message for any other layer (a weight the sync failed to send) still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        return not (record.msg == "%s: Failed to load weights" and args and str(args[0]).endswith("RotaryEmbedding"))


def quiet_rotary_reload_warning() -> None:
    logger = logging.getLogger(RELOAD_LOGGER)
    if not any(isinstance(f, RotaryReloadFilter) for f in logger.filters):
        logger.addFilter(RotaryReloadFilter())


def _unwrap_lora_layers(model: Any) -> list[tuple[Any, str, Any]]:
    """Put each vLLM LoRA layer's ``base_layer`` in its place; returns (parent, attribute, LoRA layer) to restore."""
    from vllm.lora.layers import BaseLayerWithLoRA

    swapped = []
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            base = getattr(child, "base_layer", None)
            if isinstance(child, BaseLayerWithLoRA) and isinstance(base, torch.nn.Module):
                setattr(parent, name, base)
                swapped.append((parent, name, child))
    return swapped
