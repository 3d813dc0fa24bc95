"""The vLLM rollout engine, in-process on every rank (``distributed_executor_backend="external_launcher"``).

Facts this follows (each one a bug other projects shipped):
- Built with dummy weights and ``enable_sleep_mode=True``; our weights are streamed in before the first
  generation, never read from disk by vLLM, and never reloaded from disk after a sync (that silently
  brings the base model back).
- ``expandable_segments`` in PYTORCH_CUDA_ALLOC_CONF breaks the sleep allocator: removed, with a warning,
  before vLLM starts. One sleeping engine per process (the reference model is never a second engine).
- Seeds are equal inside a tensor-parallel group and differ across groups. With TP > 1 the group
  all-gathers its prompts, generates once, and each rank keeps its own rows.
- Rollout log-probs are the engine's processed log-probs (after temperature).
Version differences (vLLM 0.25 .. 0.33) stay in the small adapter functions at the bottom.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Iterable

import torch

from lib.dist import Topology, all_gather
from lib.engine import SamplingConfig, build_output, expand_samples
from lib.protocol import DataProto

log = logging.getLogger(__name__)


def strip_expandable_segments() -> None:
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    parts = [p for p in conf.split(",") if p and not p.replace(" ", "").startswith("expandable_segments")]
    if len(parts) != len([p for p in conf.split(",") if p]):
        log.warning("removing expandable_segments from PYTORCH_CUDA_ALLOC_CONF: vLLM's sleep mode does not "
                    "work with it")
        if parts:
            os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(parts)
        else:
            os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)


class VLLMEngine:
    def __init__(self, model_path: str, topo: Topology, pad_token_id: int, eos_token_ids: list[int],
                 sampling: SamplingConfig, val_sampling: SamplingConfig | None = None, max_model_len: int = 4096,
                 gpu_memory_utilization: float = 0.5, dtype: str = "bfloat16", enforce_eager: bool = False,
                 trust_remote_code: bool = False):
        strip_expandable_segments()
        from vllm import LLM

        self.topo, self.pad_id, self.eos_ids = topo, pad_token_id, list(eos_token_ids)
        self.sampling = sampling
        self.val_sampling = val_sampling or SamplingConfig(temperature=0.0, max_new_tokens=sampling.max_new_tokens)
        # equal within a TP group (they must sample the same tokens), different across groups
        self.group_seed = sampling.seed * 100003 + topo.rollout_dp_rank
        self.llm = LLM(model=model_path, tensor_parallel_size=topo.rollout_tp_size,
                       distributed_executor_backend="external_launcher", enable_sleep_mode=True,
                       load_format="dummy", dtype=dtype, seed=self.group_seed, max_model_len=max_model_len,
                       gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                       skip_tokenizer_init=True, trust_remote_code=trust_remote_code, enable_prefix_caching=True,
                       **_logprobs_mode_kwargs())
        self.metrics: dict[str, float] = {}
        self.sleep(2)  # dummy weights: nothing worth keeping until the first sync

    def _mem(self) -> float:
        free, total = torch.cuda.mem_get_info()
        return (total - free) / 2**30

    def sleep(self, level: int = 2) -> None:
        self.metrics["engine/mem_before_sleep_gb"] = self._mem()
        self.llm.sleep(level=level)
        self.metrics["engine/mem_after_sleep_gb"] = self._mem()

    def wake_up(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None:
        self.metrics[f"engine/mem_before_wake_{'_'.join(tags)}_gb"] = self._mem()
        self.llm.wake_up(tags=list(tags))
        self.metrics[f"engine/mem_after_wake_{'_'.join(tags)}_gb"] = self._mem()

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        batch = list(weights)
        _load_into_model(self.llm, batch)

    def generate(self, data: DataProto, validate: bool = False) -> DataProto:
        sp = self.val_sampling if validate else self.sampling
        t0 = time.perf_counter()
        data = expand_samples(data, sp.n)
        topo = self.topo
        if topo.rollout_tp_size > 1:
            # tp group: one generation for the group's prompts, then each rank keeps its own rows
            data, sizes = all_gather(data, topo.rollout_tp_group, return_sizes=True)
            start = sum(sizes[:topo.rollout_tp_rank])
            mine = slice(start, start + sizes[topo.rollout_tp_rank])
        else:
            mine = slice(0, len(data))
        ids, mask = data.batch["input_ids"], data.batch["attention_mask"]
        prompts = [row[m.bool()].tolist() for row, m in zip(ids.cpu(), mask.cpu())]
        params = _sampling_params(sp, self.eos_ids)
        outputs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        responses = [list(o.outputs[0].token_ids) for o in outputs]
        logps = [_sampled_logprobs(o.outputs[0]) for o in outputs]
        data = data[mine]
        responses, logps = responses[mine], logps[mine]
        fields = build_output(data.batch["input_ids"], data.batch["attention_mask"], data.batch["position_ids"],
                              responses, logps, self.pad_id, response_width=None)
        elapsed = time.perf_counter() - t0
        n = sum(len(r) for r in responses)
        meta = {"generate_s": elapsed, "generated_tokens": n, "tokens_per_s": n / max(elapsed, 1e-9)}
        return DataProto.from_dict(fields, dict(data.non_tensor_batch), {**data.meta_info, **meta})


# ---- adapter: everything that differs between vLLM releases


def _logprobs_mode_kwargs() -> dict:
    # processed log-probs (after temperature) appeared as an engine argument in 0.10.2; all supported releases have it
    return {"logprobs_mode": "processed_logprobs"}


def _sampling_params(sp: SamplingConfig, eos_ids: list[int]) -> Any:
    """No per-request seed: identical seeds would make a prompt's n samples identical. The engine's own
    generator, seeded per TP group at construction, drives sampling."""
    from vllm import SamplingParams

    greedy = sp.temperature == 0
    return SamplingParams(n=1, temperature=0.0 if greedy else sp.temperature, top_p=1.0 if greedy else sp.top_p,
                          top_k=0 if greedy else sp.top_k, max_tokens=sp.max_new_tokens,
                          stop_token_ids=sorted(set(eos_ids) | set(sp.stop_token_ids)), logprobs=0, detokenize=False)


def _sampled_logprobs(completion: Any) -> list[float]:
    """Log-prob of each sampled token (``logprobs=0`` returns just that one per position)."""
    if completion.logprobs is None:
        return [0.0] * len(completion.token_ids)
    return [step[token].logprob for token, step in zip(completion.token_ids, completion.logprobs)]


def _load_into_model(llm: Any, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Copy (HF name, tensor) pairs into the in-process model; vLLM's loader maps HF names (fused qkv etc.)."""
    if hasattr(llm, "apply_model"):
        llm.apply_model(lambda model: model.load_weights(weights))
        return
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    runner.model.load_weights(weights)
