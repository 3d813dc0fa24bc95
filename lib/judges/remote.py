"""A judge behind an OpenAI-compatible ``/chat/completions`` endpoint (a vLLM or SGLang server, or a hosted API).

One step's samples go out together, asynchronously: at most ``max_in_flight`` requests at once, each with a timeout,
the whole step within ``deadline_s`` (what is not back by then is masked). 429, 5xx, time-outs and dropped
connections are retried up to ``max_retries`` times after a jittered exponential backoff; any other 4xx is the
request's own fault and is not. Answers are cached by (model, template, sampling settings, prompt, response): a
duplicate, in one step or a later one, makes no second call. Token usage is counted per step, and an optional
budget stops new calls once reached (calls in flight then finish: the budget is exceeded by at most that many).
The key comes from an environment variable the config names, never from the config file; ``probe`` sends one short
request at start-up, so that a wrong key or URL is one clear error before any model loads.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import random
import time

import httpx

from lib.config import JudgeConfig
from lib.judges.parse import DEADLINE, ERROR, OVER_BUDGET, TRUNCATED, UNPARSED, Verdict, verdict

RETRIED = (429, 500, 502, 503, 504)


class RemoteJudge:
    def __init__(self, cfg: JudgeConfig, template: str, api_key: str = ""):
        """The endpoint, limits and verdict form of ``cfg`` (lib.config.JudgeConfig); ``template``: the judge's
        prompt, {question}, {response} and {reference} filled in (str.format); ``api_key``: sent as a bearer token."""
        self.endpoint, self.template, self.api_key = cfg, template, api_key
        self.cache: dict[str, tuple[str, bool]] = {}  # key -> (the judge's text, cut by its token limit)
        self.used_tokens = 0  # over the run, for the budget

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _body(self, text: str, max_tokens: int) -> dict:
        return {"model": self.endpoint.model, "messages": [{"role": "user", "content": text}],
                "temperature": self.endpoint.temperature, "max_tokens": max_tokens}

    def _key(self, text: str) -> str:
        settings = (self.endpoint.model, self.template, self.endpoint.temperature, self.endpoint.max_tokens)
        return hashlib.sha256(json.dumps([*settings, text]).encode()).hexdigest()

    def render(self, question: str, response: str, reference: str = "") -> str:
        return self.template.format(question=question, response=response, reference=reference)

    def probe(self) -> None:
        """One short request: a refused key or an endpoint that cannot be reached is one clear error, now."""
        url = self.endpoint.url.rstrip("/") + "/chat/completions"
        try:
            r = httpx.post(url, json=self._body("Reply OK.", 1), headers=self._headers(),
                           timeout=self.endpoint.timeout_s)
        except httpx.HTTPError as e:
            raise ValueError(f"judge endpoint {url} cannot be reached ({type(e).__name__}: {e}): check the judge's "
                             f"url and that its server is up") from None
        if r.status_code in (401, 403):
            raise ValueError(f"judge endpoint {url} refused the key (HTTP {r.status_code}): set the environment "
                             f"variable the config's api_key_env names to a valid key") from None
        if r.status_code >= 400:
            raise ValueError(f"judge endpoint {url} answered a probe with HTTP {r.status_code}: {r.text[:200]}")

    def score(self, items: list[tuple[str, str, str]]) -> tuple[list[Verdict], dict[str, float]]:
        """Verdicts for (question, response, reference) items, in order, and the step's judge metrics."""
        t0 = time.perf_counter()
        verdicts, counts = asyncio.run(self._score([self.render(*item) for item in items]))
        seconds = time.perf_counter() - t0
        statuses = [v.status for v in verdicts]
        scored = [v.score for v in verdicts if v.score is not None]
        return verdicts, {
            "judge/seconds": seconds, "judge/tokens": float(counts["tokens"]), "judge/requests": float(counts["calls"]),
            "judge/cache_hits": float(counts["cache_hits"]), "judge/errors": float(statuses.count(ERROR)),
            "judge/parse_failures": float(statuses.count(UNPARSED) + statuses.count(TRUNCATED)),
            "judge/deadline": float(statuses.count(DEADLINE)), "judge/over_budget": float(statuses.count(OVER_BUDGET)),
            "judge/score_mean": sum(scored) / len(scored) if scored else float("nan")}

    async def _score(self, texts: list[str]) -> tuple[list[Verdict], dict[str, int]]:
        counts = {"tokens": 0, "calls": 0, "cache_hits": 0}
        keys = [self._key(t) for t in texts]
        answers: dict[str, tuple[str, bool] | str] = {}  # key -> (text, truncated), or a status without one
        todo = {}
        for key, text in zip(keys, texts):
            if key in self.cache:
                counts["cache_hits"] += 1
                answers[key] = self.cache[key]
            elif key not in todo:
                todo[key] = text
            else:
                counts["cache_hits"] += 1  # a duplicate of this step: one call for both
        gate = asyncio.Semaphore(self.endpoint.max_in_flight)
        async with httpx.AsyncClient(timeout=self.endpoint.timeout_s) as client:
            tasks = {key: asyncio.create_task(self._ask(client, gate, text, counts)) for key, text in todo.items()}
            if tasks:
                await asyncio.wait(tasks.values(), timeout=self.endpoint.deadline_s)
            for key, task in tasks.items():
                if not task.done():
                    task.cancel()
                    answers[key] = DEADLINE
                else:
                    answers[key] = task.result()
                    if isinstance(answers[key], tuple):
                        self.cache[key] = answers[key]
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        e = self.endpoint
        return [Verdict(None, a) if isinstance(a, str) else
                verdict(a[0], a[1], e.parse, e.field, (e.scale_min, e.scale_max), (0.0, 1.0))
                for a in (answers[k] for k in keys)], counts

    async def _ask(self, client: httpx.AsyncClient, gate: asyncio.Semaphore, text: str,
                   counts: dict[str, int]) -> tuple[str, bool] | str:
        """One verdict's text and whether it was cut, or the status of a request that got none."""
        e = self.endpoint
        url = e.url.rstrip("/") + "/chat/completions"
        async with gate:
            for attempt in range(e.max_retries + 1):
                if attempt:
                    await asyncio.sleep(e.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5))
                if e.budget_tokens and self.used_tokens >= e.budget_tokens:
                    return OVER_BUDGET
                counts["calls"] += 1
                try:
                    r = await client.post(url, json=self._body(text, e.max_tokens), headers=self._headers())
                except (httpx.TimeoutException, httpx.TransportError):
                    continue
                if r.status_code in RETRIED:
                    continue
                if r.status_code >= 400:
                    return ERROR
                try:
                    body = r.json()
                    choice = body["choices"][0]
                    used = int((body.get("usage") or {}).get("total_tokens", 0))
                except (ValueError, KeyError, IndexError, TypeError):
                    return ERROR
                counts["tokens"] += used
                self.used_tokens += used
                return choice["message"]["content"] or "", choice.get("finish_reason") == "length"
            return ERROR
