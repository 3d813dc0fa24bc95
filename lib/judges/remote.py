"""A judge behind an OpenAI-compatible ``/chat/completions`` endpoint (a vLLM or SGLang server, or a hosted API).

One step's samples go out together, asynchronously: at most ``max_in_flight`` requests at once, each with a timeout,
the whole step within ``deadline_s`` (what is not back by then is masked). 429, 5xx, time-outs and dropped
connections are retried up to ``max_retries`` times after a jittered exponential backoff; any other 4xx is the
request's own fault and is not. Answers are cached by (model, template, sampling settings, prompt, response): a
duplicate, in one step or a later one, makes no second call. Token usage is counted per step, and an optional
budget stops new calls once reached (calls in flight then finish: the budget is exceeded by at most that many).
The key comes from an environment variable the config names, never from the config file; ``probe`` sends one short
request at start-up, so that a wrong key or URL is one clear error before any model loads. With ``parse json`` the
requests ask for the verdict as JSON by ``response_format`` (guided decoding on the server).
"""

from __future__ import annotations

import asyncio
import random
import time

import httpx

from lib.config_judge import JudgeConfig
from lib.judges.base import Answer, Judge
from lib.judges.parse import DEADLINE, ERROR, OVER_BUDGET, verdict_schema

RETRIED = (429, 500, 502, 503, 504)


class RemoteJudge(Judge):
    remote = True

    def __init__(self, cfg: JudgeConfig, template: str, api_key: str = ""):
        """The endpoint, limits and verdict form of ``cfg`` (lib.config.JudgeConfig); ``api_key``: sent as a bearer
        token."""
        super().__init__(cfg, template)
        self.api_key = api_key

    def describe(self) -> str:
        e = self.endpoint
        return f"judge: {e.model} at {e.url}, {e.max_in_flight} requests in flight a rank"

    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _body(self, text: str, max_tokens: int) -> dict:
        e = self.endpoint
        body = {"model": e.model, "messages": [{"role": "user", "content": text}], "temperature": e.temperature,
                "max_tokens": max_tokens}
        if e.parse == "json":
            body["response_format"] = verdict_schema(e.field, e.scale_min, e.scale_max)
        return body

    def backoff(self, attempt: int) -> float:
        """Seconds before retry ``attempt`` (1, 2, ...): jittered exponential, from judge.backoff_s."""
        return self.endpoint.backoff_s * 2 ** (attempt - 1) * random.uniform(0.5, 1.5)

    def probe(self) -> None:
        """One short request: a refused key or an endpoint that cannot be reached is one clear error, now. It follows
        training's retry policy (429, 5xx, time-outs and dropped connections retried judge.max_retries times with
        backoff): an endpoint that answers some requests with HTTP 500 trains, so it starts too."""
        e = self.endpoint
        url = e.url.rstrip("/") + "/chat/completions"
        r, failure = None, None
        for attempt in range(e.max_retries + 1):
            if attempt:
                time.sleep(self.backoff(attempt))
            try:
                r = httpx.post(url, json=self._body("Reply OK.", 1), headers=self._headers(), timeout=e.timeout_s)
            except (httpx.TimeoutException, httpx.TransportError) as err:
                r, failure = None, err
                continue
            if r.status_code not in RETRIED:
                break
        if r is None:
            raise ValueError(f"judge endpoint {url} cannot be reached ({type(failure).__name__}: {failure}; "
                             f"{e.max_retries + 1} tries): check the judge's url and that its server is up") from None
        if r.status_code in (401, 403):
            raise ValueError(f"judge endpoint {url} refused the key (HTTP {r.status_code}): set the environment "
                             f"variable the config's api_key_env names to a valid key") from None
        if r.status_code >= 400:
            guided = " (parse json asks it for a JSON verdict by response_format: a server without guided decoding " \
                     "refuses it; use parse auto or score)" if self.endpoint.parse == "json" else ""
            tries = f" ({e.max_retries + 1} tries)" if r.status_code in RETRIED else ""
            raise ValueError(f"judge endpoint {url} answered a probe with HTTP {r.status_code}{tries}: "
                             f"{r.text[:200]}{guided}")

    def _answers(self, todo: dict[str, str], counts: dict[str, int]) -> dict[str, Answer]:
        return asyncio.run(self._ask_all(todo, counts))

    async def _ask_all(self, todo: dict[str, str], counts: dict[str, int]) -> dict[str, Answer]:
        """Every request at once, at most max_in_flight in flight; what is not back by the deadline is DEADLINE."""
        answers: dict[str, Answer] = {}
        gate = asyncio.Semaphore(self.endpoint.max_in_flight)
        async with httpx.AsyncClient(timeout=self.endpoint.timeout_s) as client:
            tasks = {key: asyncio.create_task(self._ask(client, gate, text, counts)) for key, text in todo.items()}
            await asyncio.wait(tasks.values(), timeout=self.endpoint.deadline_s)
            for key, task in tasks.items():
                if not task.done():
                    task.cancel()
                    answers[key] = DEADLINE
                else:
                    answers[key] = task.result()
            await asyncio.gather(*tasks.values(), return_exceptions=True)
        return answers

    async def _ask(self, client: httpx.AsyncClient, gate: asyncio.Semaphore, text: str,
                   counts: dict[str, int]) -> Answer:
        """One verdict's text and whether it was cut, or the status of a request that got none."""
        e = self.endpoint
        url = e.url.rstrip("/") + "/chat/completions"
        async with gate:
            for attempt in range(e.max_retries + 1):
                if attempt:
                    await asyncio.sleep(self.backoff(attempt))
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
