"""A judge model in the trainer's own processes, taking turns with the policy's engine on the device.

Each rank holds a replica (an HF engine, lib/engine/hf.py: the policy's HF engine's own chunked, KV-cached decoding)
and judges the rank's own samples, as each rank generates its own. Its weights are read from the folder once and
live on the CPU between uses: after the rollout, when the policy's engine sleeps, the judge wakes (moved to the
device), answers greedily (or at judge.temperature) and sleeps again, whether or not scoring raised. It refuses to
wake while another engine of the process is awake (lib.engine.awake), so the two never hold the device together.

With vLLM a second sleep-mode engine cannot live in the process (one CuMemAllocator per process): with judge.engine
vllm the judge decodes in vLLM in a child process of each rank (lib/judges/vllm_child.py), which takes turns the same
way; with hf (the default) in our HF engine here, whatever rollout.engine is. With judge.tp_size > 1 the children of
each group of that many ranks hold the judge together (tensor parallel): the group's ranks gather their prompts, the
children generate them all, each rank keeps its own answers.
"""

from __future__ import annotations

import contextlib
import glob
import os
from typing import Any, Iterator

import torch
import torch.distributed as dist
from safetensors import safe_open

from lib.config_judge import JudgeConfig
from lib.engine import SamplingConfig, awake, kv_cache_bytes
from lib.engine.hf import HFEngine
from lib.engine.vllm_adapter import cpu_prefill_kwargs
from lib.judges.base import Answer, Judge
from lib.judges.parse import ERROR, verdict_schema
from lib.judges.vllm_child import ChildEngine, TPLayout, tp_layout
from lib.models import load_config, load_tokenizer, saved_dtype, stop_token_ids
from lib.preflight import vllm_problems

NAME = "judge"
MAX_SEQS = 256
"""judge.engine vllm: the verdicts one scheduler step decodes together (more wait their turn)."""


def weight_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"judge.path={path!r} holds no *.safetensors weights; point it at a model folder")
    return files


def checkpoint_tensors(path: str) -> Any:
    """(name, tensor) of every tensor in the folder's safetensors files, on CPU."""
    for file in weight_files(path):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def context_of(config: Any) -> int | None:
    """The positions the model was built for (None where its config does not say)."""
    text = getattr(config, "text_config", None) or config
    return getattr(text, "max_position_embeddings", None)


class LocalJudge(Judge):
    def __init__(self, cfg: JudgeConfig, template: str, trust_remote_code: bool = False):
        """Reads the judge's config and tokenizer (no weights yet: ``start`` loads them). Raises ValueError naming
        the fix for a folder that cannot judge: no chat template, no stop token."""
        super().__init__(cfg, template)
        path = cfg.path
        try:
            self.config = load_config(path, trust_remote_code)
            self.tokenizer = load_tokenizer(path, trust_remote_code)
        except (OSError, ValueError) as e:
            raise ValueError(f"judge.path={path!r} cannot be loaded ({type(e).__name__}: {str(e)[:200]}); point it at "
                             f"a model folder with its tokenizer") from None
        if not self.tokenizer.chat_template:
            raise ValueError(f"judge.path={path!r}: its tokenizer has no chat template, so the judge's prompt cannot be "
                             f"put in its own format; use the instruct (chat) variant of the model, or add a "
                             f"chat_template to its tokenizer_config.json")
        weight_files(path)  # no weights: refused now, before any model loads
        self.eos = stop_token_ids(path, self.tokenizer, trust_remote_code)
        if not self.eos:
            raise ValueError(f"judge.path={path!r}: neither its tokenizer nor its generation_config.json names an eos "
                             f"token, so a verdict could never end; add eos_token_id to generation_config.json")
        self.engine: Any = None  # an HFEngine, or lib.judges.vllm_child.ChildEngine with judge.engine vllm
        self.need = 0  # the longest judge sequence, once check_context has measured it
        self.calls = 0
        self.group: Any = None  # judge.tp_size > 1: the ranks whose children hold the judge together

    def probe(self) -> None:
        """judge.engine vllm: what keeps vLLM from decoding this judge here (the package, its release, the model's
        class and head size), and a judge.tp_size group that would cross nodes, is one error now, before any model
        loads."""
        tp, local = self.endpoint.tp_size, os.environ.get("LOCAL_WORLD_SIZE")  # (set in a rank, not before torchrun)
        if tp > 1 and local is not None and int(local) % tp:
            raise ValueError(f"judge.tp_size={tp}: a TP group's children share one node, and this node runs {local} "
                             f"ranks; use a judge.tp_size that divides the ranks per node")
        if self.endpoint.engine == "vllm" and (problems := vllm_problems(self.config, "judge.engine")):
            raise ValueError(f"judge.path={self.endpoint.path!r}: " + "; ".join(problems))

    def describe(self) -> str:
        how = f"temperature {self.endpoint.temperature:g}" if self.endpoint.temperature else "greedy"
        where = "offloaded to CPU between uses"
        if self.endpoint.engine == "vllm":
            where = "decoded by vLLM in a child process of each rank, asleep between uses"
            if self.endpoint.tp_size > 1:
                where += f", tensor parallel over the children of each {self.endpoint.tp_size} ranks"
        return (f"judge model: {self.endpoint.path} on every rank, taking turns with the policy's engine ({where}), "
                f"{how}, verdicts of at most {self.endpoint.max_tokens} tokens")

    def prompt_ids(self, text: str) -> list[int]:
        return self.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)

    def check_context(self, prompt_tokens: int, response_tokens: int) -> None:
        """Refuse a judge whose context cannot hold its prompt around the longest question and response (counted in
        the policy's tokens) and the verdict's token limit."""
        context = context_of(self.config)
        overhead = len(self.prompt_ids(self.render("", "", "")))
        need = overhead + prompt_tokens + response_tokens + self.endpoint.max_tokens
        self.need = need
        if context is not None and need > context:
            raise ValueError(
                f"judge.path={self.endpoint.path!r}: its context is {context} positions, and a verdict may need "
                f"{need} ({overhead} of its prompt template, {prompt_tokens} of question (data.max_prompt_length), "
                f"{response_tokens} of response (rollout.max_response_length), {self.endpoint.max_tokens} of verdict "
                f"(judge.max_tokens)); lower judge.max_tokens or those lengths, shorten judge.template, or use a judge "
                f"with a longer context")

    def start(self, device: torch.device, batch_tokens: int = 65536, seed: int = 0) -> None:
        """Build the replica and load the folder's weights into it, then put it to sleep on the CPU (judge.engine
        vllm: start the rank's vLLM child, which loads the folder itself and sleeps)."""
        cfg = self.endpoint
        if cfg.engine == "vllm":
            tp = None
            if cfg.tp_size > 1:
                self.group, tp = tp_layout(cfg.tp_size, device)
            self.engine = ChildEngine(NAME, device, self.child_spec(device, seed, tp), seed, tp)
            return
        sampling = SamplingConfig(temperature=cfg.temperature, n=1, max_new_tokens=cfg.max_tokens, seed=seed)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos[0]
        self.engine = HFEngine(self.config, device, pad, self.eos, sampling, sampling, batch_tokens=batch_tokens,
                               name=NAME)
        with self.turn():
            self.engine.load_weights((n, t) for n, t in checkpoint_tensors(cfg.path) if n not in self.engine.aliases)
            self.engine.finish_sync()

    def child_spec(self, device: torch.device, seed: int, tp: TPLayout | None = None) -> dict:
        """The vLLM engine of judge.engine vllm: the folder's own weights and dtype, one sequence as long as
        check_context measured (else the model's context), its KV cache in bytes for MAX_SEQS of them; guided JSON
        verdicts with judge.parse json. ``tp``: the child is one of its TP group's (vLLM's tensor parallelism across
        the group's processes; its KV cache holds its share of the heads)."""
        cfg = self.endpoint
        length = self.need or context_of(self.config) or 4096
        dtype = saved_dtype(self.config)
        text = getattr(self.config, "text_config", None) or self.config
        args = {"model": cfg.path, "dtype": str(dtype).removeprefix("torch."), "seed": seed, "max_model_len": length,
                "max_num_seqs": MAX_SEQS, "kv_cache_memory_bytes": kv_cache_bytes(
                    text, MAX_SEQS, length, torch.empty((), dtype=dtype).element_size(), cfg.tp_size),
                "gpu_memory_utilization": 0.1,  # vLLM's start-up check only: the KV cache is sized in bytes
                "enable_prefix_caching": True, "skip_tokenizer_init": cfg.parse != "json",
                **cpu_prefill_kwargs(device, length)}
        if device.type == "cpu":  # no compiled graphs (minutes of start-up on CPU for a few seconds of judging)
            args["enforce_eager"] = True
        spec = {"engine_args": args, "eos": self.eos, "temperature": cfg.temperature, "schema": None}
        if cfg.parse == "json":
            spec["schema"] = verdict_schema(cfg.field, cfg.scale_min, cfg.scale_max)["json_schema"]["schema"]
        if tp is not None:  # one of the group's children: vLLM's TP across the group's processes
            args.update(tensor_parallel_size=tp.size, distributed_executor_backend="external_launcher")
            spec["shm_prefix"] = tp.shm_prefix
        return spec

    def close(self) -> None:
        """The engine's end with the run (the vLLM child exits; the HF replica frees its memory)."""
        if self.engine is not None:
            self.engine.close()

    @contextlib.contextmanager
    def turn(self) -> Iterator[None]:
        """The judge awake on the device inside, asleep on the CPU again after, whatever happens inside."""
        busy = awake.others(NAME)
        if busy:
            raise RuntimeError(f"the judge model would wake while {sorted(busy)} is awake on the device; the judge "
                               f"scores after the rollout, when the policy's engine sleeps")
        self.engine.wake_up(["weights"])
        try:
            yield
        finally:
            self.engine.sleep(1)

    @property
    def collective(self) -> bool:
        return self.group is not None

    def _answers(self, todo: dict[str, str], counts: dict[str, int]) -> dict[str, Answer]:
        return dict(zip(todo, self.complete(list(todo.values()), counts)))

    def complete(self, texts: list[str], counts: dict[str, int] | None = None) -> list[Answer]:
        """The judge's answer to each prompt text, in one turn on the device: (text, cut by judge.max_tokens), or
        ERROR for a prompt its context cannot hold with the verdict. ``counts``: tokens and requests added (on a GPU,
        ``device_bytes`` too: the device's memory in use at the end of the turn, every process's)."""
        if self.engine is None:
            raise RuntimeError("LocalJudge.start() was never called")
        counts = {"tokens": 0, "calls": 0} if counts is None else counts
        prompts = [self.prompt_ids(t) for t in texts]
        context = context_of(self.config)
        fits = [context is None or len(p) + self.endpoint.max_tokens <= context for p in prompts]
        answers: list[Answer] = [ERROR] * len(texts)  # counted in judge/errors
        asked = [i for i, ok in enumerate(fits) if ok]
        mine = [prompts[i] for i in asked]
        together, offset = [mine], 0
        if self.group is not None:  # the TP group's prompts, every child generating them all, in rank order
            together = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(together, mine, group=self.group)
            offset = sum(len(part) for part in together[:dist.get_rank(self.group)])
        together = [p for part in together for p in part]
        if together:
            with self.turn():
                turns = self.engine.generate_ids(together, [self.endpoint.max_tokens] * len(together), validate=True,
                                                 key=self.calls)[offset:offset + len(mine)]
                if torch.cuda.is_available():  # the device's whole use: a vLLM child's memory is not this process's
                    free, total = torch.cuda.mem_get_info(self.engine.device)
                    counts["device_bytes"] = max(counts.get("device_bytes", 0), total - free)
            self.calls += 1
            counts["calls"] += len(asked)
            for i, turn in zip(asked, turns):
                counts["tokens"] += len(prompts[i]) + len(turn.ids)
                self.used_tokens += len(prompts[i]) + len(turn.ids)
                answers[i] = (self.tokenizer.decode(turn.ids, skip_special_tokens=True), not turn.stopped)
        return answers
