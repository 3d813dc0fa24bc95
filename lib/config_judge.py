"""The config section of an LLM judge (``judge``), re-exported by lib/config.py; ground like it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class JudgeConfig:
    """An LLM judge scores every response (lib/judges): behind an endpoint (``url``) or a model beside the policy
    (``path``). A response it could not score (unparseable, cut, no answer, over the budget) is masked from the update
    and counted in judge/*, never rewarded 0; with a group estimator, a group left with fewer than two scored samples
    is masked whole (judge/dropped_groups)."""

    url: str = ""
    """The endpoint's base URL, e.g. http://host:8000/v1 ("": no remote judge)."""
    model: str = ""
    """The model name the endpoint serves."""
    path: str = ""
    """A judge model folder (a causal LM with a chat template; toy_judge: the toy task's) on every rank, taking turns
    with the policy's engine on the device, on the CPU between uses (lib/judges/local.py). "": none. Not with url."""
    engine: Literal["hf", "vllm"] = "hf"
    """What decodes the judge model (path): hf, our HF engine in the rank's own process; vllm, vLLM in a child process
    of each rank, with its own sleep-mode allocator (one per process: it cannot live in the policy engine's)."""
    tp_size: int = 1
    """judge.engine vllm: the children of each tp_size consecutive ranks (of one node) hold the judge together (vLLM's
    tensor parallelism, a judge larger than one device) and judge those ranks' samples together. 1: whole in each."""
    api_key_env: str = ""
    """The name of the environment variable that holds the key ("": none sent). The key never goes in a config."""
    template: str = ""
    """A text file with the judge's prompt, {question}, {response} and {reference} (ground truth) filled in ("": a
    rubric asking for "Score: N", 0-10)."""
    parse: Literal["auto", "json", "boxed", "score"] = "auto"
    """How the verdict is read: a JSON field, \\boxed{N}, a "Score: N" line, or the first of them found."""
    field: str = "score"
    """The JSON field (parse json or auto)."""
    scale_min: float = 0.0
    scale_max: float = 10.0
    """The judge's scale; a score outside it is unparsed. It maps linearly onto 0..1."""
    weight: float = 1.0
    """The judge's score times this, plus reward.custom_fn's / the rule's times rule_weight, is the reward."""
    rule_weight: float = 0.0
    """The rule / custom score's weight beside the judge (0: the judge alone)."""
    max_in_flight: int = 16
    """Requests in flight at once, per rank."""
    timeout_s: float = 120.0
    """One request's time limit (then retried)."""
    deadline_s: float = 900.0
    """One step's scoring time limit: what is not back by then is masked (judge/deadline)."""
    max_retries: int = 4
    """Retries after a 429, a 5xx, a time-out or a dropped connection (jittered backoff); never after another 4xx."""
    backoff_s: float = 1.0
    """The first retry's wait (doubled each time, times a random 0.5-1.5)."""
    budget_tokens: int = 0
    """Endpoint tokens per rank over the run; reached, no more calls (the rest masked, judge/over_budget). 0: none."""
    max_tokens: int = 1024
    """The judge's completion limit; a verdict cut there is masked (judge/parse_failures)."""
    temperature: float = 0.0
