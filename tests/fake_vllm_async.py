"""A stand-in for vLLM 0.25's ``LLM`` and ``LLMEngine`` as a CUDA run steps them: async scheduling on (vLLM turns it
on for external_launcher on CUDA; its CPU build forces it off, so no CPU engine ever steps with a batch in flight).
No vLLM needed: ``vllm_engine`` builds lib.engine.vllm.VLLMEngine around it with ``object.__new__``.

What it imitates (vLLM 0.25 paths; shared/reviews/2026-11-29-cuda-path-vs-vllm-0.25.md, section (b)):
- the engine core's 2-deep batch queue (``v1/engine/core.py`` ``step_with_batch_queue``): a step schedules a batch
  and, while the queue is not full, returns nothing; once it is full it pops the oldest batch and returns its
  outputs. So the first step after requests arrive returns [], and every later one batch k's outputs while batch
  k + 1 is in flight;
- a request in flight is scheduled again before its last token is known (output placeholders), except when its
  tokens in flight already reach ``max_tokens``; a batch's tokens are sampled when it is scheduled;
- ``update_from_output`` skips requests that are gone or finished (``scheduler.py:1567-1576``), and the output
  processor ignores ids it does not know (``output_processor.py:607-611``): a batch popped after an abort delivers
  nothing for the aborted ids. ``abort_request`` drops the output processor's states and the scheduler's requests and
  leaves the queue as it is, so the next call's first step pops that stale batch;
- ``has_unfinished_requests`` is the output processor's view (requests not yet seen finished);
- ``RequestOutputKind.DELTA`` (``add_streamed_requests``): each output carries the step's new token ids, and its
  log-probs are the last ``len(token_ids)`` entries of the request's accumulating list
  (``output_processor.py:394-395``);
  ``LLM.generate`` (FINAL_ONLY) returns finished requests only, sorted by ``int(request_id)`` as
  ``entrypoints/offline_utils.py:626`` does, so a stray id there raises as it would in vLLM.

A ``Model`` gives the token (and its log-prob) at a response position: sampling depends on the prompt and the position
only, so a request stopped and continued is the same sample, and a token delivered at the wrong place shows."""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

Model = Callable[[list[int], int], tuple[int, float]]
"""(prompt ids, response position) -> (token id, its log-prob)."""

DELTA, FINAL_ONLY = "delta", "final_only"  # vLLM's RequestOutputKind, the two the project uses


@dataclass
class Params:
    """The fields of vLLM's SamplingParams that the engine reads here."""

    max_tokens: int
    stop_token_ids: list[int]
    seed: int | None = None
    output_kind: str = FINAL_ONLY


@dataclass
class Logprob:
    logprob: float


@dataclass
class Completion:
    """vLLM's CompletionOutput: ``logprobs`` one {token: Logprob} per token (``logprobs=0``)."""

    token_ids: list[int]
    logprobs: list[dict[int, Logprob]]


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[Completion]
    finished: bool


@dataclass
class _Request:
    """The scheduler's side of a request."""

    prompt: list[int]
    params: Params
    sampled: list[int] = field(default_factory=list)
    in_flight: int = 0


@dataclass
class _State:
    """The output processor's side of a request."""

    prompt: list[int]
    kind: str
    tokens: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)


class AsyncEngine:
    """``LLMEngine`` with async scheduling: ``add_request``, ``abort_request``, ``has_unfinished_requests``,
    ``step``. ``steps`` counts the steps; ``dropped`` lists the request ids of outputs that a popped batch held for
    requests no longer there (aborted, or finished by an earlier batch), suppressed; ``stale`` is their number."""

    def __init__(self, model: Model, depth: int = 2, max_num_seqs: int = 0):
        """``max_num_seqs``: the most requests a batch holds (0: any number); the others wait, in arrival order."""
        self.model, self.depth, self.max_num_seqs = model, depth, max_num_seqs
        self.requests: dict[str, _Request] = {}  # the scheduler's (unfinished) requests
        self.states: dict[str, _State] = {}  # the output processor's
        self.queue: deque[list[tuple[str, int, float]]] = deque()  # batches in flight, newest left
        self.steps = 0
        self.dropped: list[str] = []
        self.added: list[str] = []

    def add_request(self, request_id: str, prompt: dict, params: Params, lora_request: Any = None) -> None:
        if request_id in self.states or request_id in self.requests:
            raise ValueError(f"request id {request_id} already running")
        ids = list(prompt["prompt_token_ids"])
        self.requests[request_id] = _Request(ids, params)
        self.states[request_id] = _State(ids, params.output_kind)
        self.added.append(request_id)

    def abort_request(self, request_ids: list[str]) -> None:
        for rid in request_ids:  # the output processor first, then the scheduler finishes them (core.py:409-415)
            self.states.pop(rid, None)
            self.requests.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        return bool(self.states)

    @property
    def stale(self) -> int:
        return len(self.dropped)

    def in_flight(self) -> int:
        """Batches scheduled whose outputs no step returned yet."""
        return len(self.queue)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.requests:
            self.queue.appendleft(self._schedule())
            if len(self.queue) < self.depth:
                return []  # the queue not full: schedule only
        elif not self.queue:
            return []
        return self._process(self._update_from_output(self.queue.pop()))

    def _schedule(self) -> list[tuple[str, int, float]]:
        batch = []
        # running requests were admitted before waiting ones: arrival order, finished ones gone, approximates vLLM's
        admitted = list(self.requests.items())[:self.max_num_seqs or None]
        for rid, r in admitted:
            position = len(r.sampled) + r.in_flight
            if position >= r.params.max_tokens:  # sure to be finished by the batches in flight: not scheduled
                continue
            r.in_flight += 1
            batch.append((rid, *self.model(r.prompt, position)))
        return batch

    def _update_from_output(self, batch: list[tuple[str, int, float]]) -> list[tuple[str, int, float, bool]]:
        out = []
        for rid, token, logp in batch:
            r = self.requests.get(rid)
            if r is None:  # aborted, or finished by an earlier batch: vLLM skips it
                self.dropped.append(rid)
                continue
            r.in_flight -= 1
            r.sampled.append(token)
            done = token in r.params.stop_token_ids or len(r.sampled) >= r.params.max_tokens
            if done:
                del self.requests[rid]
            out.append((rid, token, logp, done))
        return out

    def _process(self, outputs: list[tuple[str, int, float, bool]]) -> list[RequestOutput]:
        delivered = []
        for rid, token, logp, done in outputs:
            s = self.states.get(rid)
            if s is None:  # an id the output processor does not know (aborted): ignored
                self.dropped.append(rid)
                continue
            s.tokens.append(token)
            s.logprobs.append({token: Logprob(logp)})
            if done:
                del self.states[rid]
            if s.kind == DELTA:
                delivered.append(RequestOutput(rid, s.prompt, [Completion([token], s.logprobs[-1:])], done))
            elif done:
                delivered.append(RequestOutput(rid, s.prompt, [Completion(list(s.tokens), list(s.logprobs))], True))
        return delivered


class LLM:
    """``vllm.LLM``'s part that VLLMEngine calls: ``llm_engine``, ``_preprocess_cmpl`` and ``generate``."""

    def __init__(self, engine: AsyncEngine):
        self.llm_engine = engine
        self.counter = itertools.count()

    def _preprocess_cmpl(self, prompts: list[dict]) -> list[dict]:
        return list(prompts)

    def generate(self, prompts: list[dict], params: list[Params], use_tqdm: bool = False, lora_request: Any = None
                 ) -> list[RequestOutput]:
        engine = self.llm_engine
        for prompt, p in zip(prompts, params):
            p.output_kind = FINAL_ONLY
            engine.add_request(str(next(self.counter)), prompt, p, lora_request=lora_request)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += [o for o in engine.step() if o.finished]
        return sorted(outputs, key=lambda o: int(o.request_id))  # vLLM's sort: a stray "until-..." id raises


def sampling_params(sp: Any, eos_ids: list[int], seeds: list[int], banned: list[int]) -> list[Params]:
    """lib.engine.vllm_adapter.sampling_params without vLLM."""
    from lib.engine import stop_ids

    return [Params(sp.max_new_tokens, stop_ids(eos_ids, sp), None if sp.temperature == 0 else s) for s in seeds]


def add_streamed_requests(llm: LLM, ids: list[str], prompts: list[dict], params: list[Params], lora: Any) -> None:
    """lib.engine.vllm_adapter.add_streamed_requests without vLLM: DELTA outputs."""
    for rid, prompt, p in zip(ids, llm._preprocess_cmpl(prompts), params):
        p.output_kind = DELTA
        llm.llm_engine.add_request(rid, prompt, p, lora_request=lora)


def install(setattr_: Callable[[Any, str, Any], None] = setattr) -> None:
    """Point lib.engine.vllm at this module's sampling_params and add_streamed_requests (the real ones import vLLM).
    ``setattr_``: pytest's ``monkeypatch.setattr`` in a test's own process; plain setattr in a child process."""
    from lib.engine import vllm

    setattr_(vllm, "sampling_params", sampling_params)
    setattr_(vllm, "add_streamed_requests", add_streamed_requests)


def vllm_engine(model: Model, eos_ids: list[int], max_new_tokens: int = 64, depth: int = 2, tp_size: int = 1,
                max_num_seqs: int = 0) -> Any:
    """A VLLMEngine (built without its __init__, so without vLLM) around ``AsyncEngine(model, depth, max_num_seqs)``:
    awake, no LoRA,
    no images, tensor parallel size ``tp_size`` (> 1 needs a process group: _group_requests all-gathers), training
    sampling at temperature 1."""
    import torch

    from lib.engine import SamplingConfig
    from lib.engine.vllm import VLLMEngine

    e = object.__new__(VLLMEngine)
    e.topo = SimpleNamespace(rollout_tp_size=tp_size, rollout_tp_rank=0, rollout_tp_group=None, rank=0)
    e.device, e.pad_id, e.eos_ids = torch.device("cpu"), 0, list(eos_ids)
    e.sampling = SamplingConfig(temperature=1.0, max_new_tokens=max_new_tokens, seed=1)
    e.val_sampling = SamplingConfig(temperature=0.0, max_new_tokens=max_new_tokens)
    e.banned, e.images, e.route_layers, e.group = [], False, None, 0
    e.calls, e.asleep, e.metrics, e.streams, e._lora_request = {False: 0, True: 0}, set(), {}, 0, None
    e.llm = LLM(AsyncEngine(model, depth, max_num_seqs))
    return e
