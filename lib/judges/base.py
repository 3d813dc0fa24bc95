"""What every judge shares: the prompt filled from the template, the cache, the verdicts read from the answers and
the step's judge metrics. A judge says only how it gets answers for the texts not already known (``_answers``)."""

from __future__ import annotations

import hashlib
import json
import time

from lib.config_judge import JudgeConfig
from lib.judges.parse import DEADLINE, ERROR, OVER_BUDGET, TRUNCATED, UNPARSED, Verdict, verdict

Answer = tuple[str, bool] | str
"""The judge's text and whether its token limit cut it, or the status of a request that got no text."""


class Judge:
    remote = False
    """An endpoint over the network: its probe is sent once a launch (lib.inputs.check_inputs)."""

    def __init__(self, cfg: JudgeConfig, template: str):
        """``template``: the judge's prompt, {question}, {response} and {reference} filled in (str.format)."""
        self.endpoint, self.template = cfg, template
        self.cache: dict[str, tuple[str, bool]] = {}  # key -> (the judge's text, cut by its token limit)
        self.used_tokens = 0  # over the run, for the budget

    def describe(self) -> str:
        raise NotImplementedError

    def close(self) -> None:
        """At the end of the run: what the judge started ends (a judge model's vLLM child)."""

    def probe(self) -> None:
        """At start-up, before any model loads: what cannot work is one clear error now."""

    @property
    def collective(self) -> bool:
        """Whether every rank must ask for answers at every scoring, with nothing to ask or not (a judge held by
        several ranks' processes together)."""
        return False

    def check_context(self, prompt_tokens: int, response_tokens: int) -> None:
        """At start-up: refuse a judge that cannot read the longest question and response (a remote endpoint's
        context is its server's: a request over it is refused there and counted in judge/errors)."""

    def _answers(self, todo: dict[str, str], counts: dict[str, int]) -> dict[str, Answer]:
        """An answer for each (key, prompt text) of ``todo``; ``counts``: add the tokens used and the calls made."""
        raise NotImplementedError

    def _key(self, text: str) -> str:
        settings = (self.endpoint.model or self.endpoint.path, self.template, self.endpoint.temperature,
                    self.endpoint.max_tokens)
        return hashlib.sha256(json.dumps([*settings, text]).encode()).hexdigest()

    def render(self, question: str, response: str, reference: str = "") -> str:
        return self.template.format(question=question, response=response, reference=reference)

    def score(self, items: list[tuple[str, str, str]]) -> tuple[list[Verdict], dict[str, float]]:
        """Verdicts for (question, response, reference) items, in order, and the step's judge metrics. A duplicate
        (in this call, or cached from an earlier one) makes no second request."""
        t0 = time.perf_counter()
        texts = [self.render(*item) for item in items]
        counts = {"tokens": 0, "calls": 0, "cache_hits": 0}
        keys = [self._key(t) for t in texts]
        answers: dict[str, Answer] = {}
        todo: dict[str, str] = {}
        for key, text in zip(keys, texts):
            if key in self.cache:
                counts["cache_hits"] += 1
                answers[key] = self.cache[key]
            elif key not in todo:
                todo[key] = text
            else:
                counts["cache_hits"] += 1  # a duplicate of this step: one request for both
        if todo or self.collective:
            for key, answer in self._answers(todo, counts).items():
                answers[key] = answer
                if isinstance(answer, tuple):
                    self.cache[key] = answer
        e = self.endpoint
        verdicts = [Verdict(None, a) if isinstance(a, str) else
                    verdict(a[0], a[1], e.parse, e.field, (e.scale_min, e.scale_max), (0.0, 1.0))
                    for a in (answers[k] for k in keys)]
        statuses = [v.status for v in verdicts]
        scored = [v.score for v in verdicts if v.score is not None]
        return verdicts, {
            "judge/seconds": time.perf_counter() - t0, "judge/tokens": float(counts["tokens"]),
            "judge/requests": float(counts["calls"]), "judge/cache_hits": float(counts["cache_hits"]),
            "judge/errors": float(statuses.count(ERROR)),
            "judge/parse_failures": float(statuses.count(UNPARSED) + statuses.count(TRUNCATED)),
            "judge/deadline": float(statuses.count(DEADLINE)), "judge/over_budget": float(statuses.count(OVER_BUDGET)),
            "judge/score_mean": sum(scored) / len(scored) if scored else float("nan"),
            **({"memory/judge_device_peak_gb": counts["device_bytes"] / 2**30} if "device_bytes" in counts else {})}
