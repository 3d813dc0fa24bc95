"""An OpenAI-compatible endpoint over this rank's rollout engine, every call's tokens kept (issue 75).

An agent program written against the OpenAI API talks to ``Endpoint.base_url(episode)`` as to any server:
``/chat/completions`` (messages, ``tools``, ``tool_choice`` auto or none, ``max_tokens`` / ``max_completion_tokens``,
``stop``, ``stream`` as server-sent events with ``stream_options.include_usage``), ``/completions`` (a string or token
ids) and ``/models``. The episode in the path tells one agent's calls from the others' on the rank.

Tokens in, tokens out. A chat request is rendered with the model's chat template (its ``tools`` given to the
template), and the endpoint keeps what the engine saw and sampled (``Call``): the prompt ids, the sampled ids, their
log-probs and the top-k/top-p kept counts. A request that passes the episode's history back unchanged (the messages
of the previous call, the assistant message the endpoint returned, then tool or user messages) is not rendered again:
its prompt is the previous call's prompt and sampled ids, then the new messages rendered as the multi-turn loop
renders observations (lib/multi_turn/render.py), so that the two calls are one sequence of the model's own tokens
(``Call.extends``). A history the agent rewrote is rendered whole, and the call stands alone.

Threads: the HTTP server (uvicorn serving a Starlette app) runs in a thread of its own; a request is checked and
rendered there and waits; the rank's main thread, which owns the engine, answers in rounds (``serve``): once every
episode whose agent still runs has a request waiting (or has ended), one ``generate_ids`` call takes them all, in
the episodes' order. 64 agents' calls cost one batched call a round, as 64 samples do in the multi-turn loop's turns,
and the rounds do not depend on timing: the same agents sample the same tokens again (a stop redoes its step).

A row's size (``Call.start``): a call that does not continue its episode starts a row, and its prompt must fit
``max_prompt`` tokens; the calls that continue it share the row, whose tokens after that prompt (sampled and
observed) fit ``max_response``, as the trainer's rows do.

Refused with OpenAI's error body (HTTP 400, ``{"error": {"message", "type", "param", "code"}}``): n > 1, a
temperature or top_p other than the run's (the trainer recomputes the log-probs of what the run samples), a
``tool_choice`` that forces a call (the engine does not constrain its output), a prompt that leaves no room in the
context.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import queue
import socket
import threading
import time
import uuid
from collections import defaultdict
from typing import Any, Callable

try:  # the agents extra (lib.agents.config_problems names it when missing)
    import uvicorn
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route
except ImportError:
    uvicorn = None

from lib.agents.messages import Call, EngineError, Refused, Last, events, render, same, text_of, writes_calls
from lib.engine import Turn
from lib.multi_turn.parsers import PARSERS, WRITERS, Parsed
from lib.multi_turn.render import ObservationRenderer


class Endpoint:
    def __init__(self, tokenizer: Any, format: str, temperature: float, top_p: float, max_prompt: int,
                 max_response: int, model_name: str = "policy", host: str = "127.0.0.1"):
        """``format``: the tool calls' (a name of lib.multi_turn.parsers.PARSERS); ``max_prompt``: a row's prompt
        tokens at most (data.max_prompt_length); ``max_response``: a row's tokens after it
        (rollout.max_response_length)."""
        self.tokenizer, self.model_name = tokenizer, model_name
        self.parse, self.write_calls = PARSERS[format], WRITERS[format]
        self.template_writes_calls = writes_calls(tokenizer)  # a rewritten history's calls go in as tool_calls
        self.temperature, self.top_p = temperature, top_p
        self.max_prompt, self.max_response = max_prompt, max_response
        self.renderer = ObservationRenderer(tokenizer)
        self.calls: dict[str, list[Call]] = defaultdict(list)
        """Every call of every episode, in the order they were answered."""
        self.refused: dict[str, list[str]] = defaultdict(list)
        """Every refused request's message, per episode."""
        self.batches: list[int] = []
        """The requests of each engine call."""
        self.engine_s = 0.0
        """Seconds spent in the engine's calls (the rest of a rollout is the agents' and the endpoint's)."""
        self.late_rounds = 0
        """Rounds started without every running episode's request (``serve``'s ``wait_s`` passed)."""
        self.waited: dict[str, float] = defaultdict(float)
        """Seconds each episode's answered requests waited for their round and the engine."""
        self.asking: dict[str, float] = {}
        """The episodes with a request waiting now, and since when (the server queued it; time.monotonic)."""
        self._last: dict[str, Last] = {}
        self._queue: queue.Queue = queue.Queue()
        self._closed: set[str] = set()
        self._open: set[str] | None = None  # the episodes taken (None: any, before a rollout names them)
        self._engine_calls = 0
        routes = []
        for prefix, default in (("/e/{episode}/v1", None), ("/v1", "default")):
            routes += [Route(f"{prefix}/chat/completions", self._handler(self._chat, default), methods=["POST"]),
                       Route(f"{prefix}/completions", self._handler(self._completion, default), methods=["POST"]),
                       Route(f"{prefix}/models", self._handler(self._models, default), methods=["GET"])]
        # IPPROTO_TCP named: asyncio turns Nagle's algorithm off only on sockets that say so (else each response's
        # second write waits for the client's delayed ACK: ~40 ms a call, measured)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, 0))
        self.url = f"http://{host}:{sock.getsockname()[1]}"
        # an agent's connection may wait between calls as long as its episode lasts: kept open (uvicorn closes idle
        # ones after 5 s by default, and a client that sends on it then fails)
        # uvicorn's "auto" loop and HTTP parser: uvloop and httptools, which the agents extra installs (uvicorn's
        # standard set: 7.5 ms a call beyond the engine against 9.7 with asyncio and h11, the same tokens; bench
        # agents), else asyncio and h11
        config = uvicorn.Config(Starlette(routes=routes), log_level="warning", access_log=False, lifespan="off",
                                timeout_keep_alive=3600)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True,
                                        name="agent-endpoint")
        self._thread.start()
        deadline = time.monotonic() + 60
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the agent endpoint did not start on {self.url}")
            time.sleep(0.01)

    def base_url(self, episode: str) -> str:
        """The OpenAI base URL of one episode (``OPENAI_BASE_URL``)."""
        return f"{self.url}/e/{episode}/v1"

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)

    def reset(self, temperature: float, top_p: float, episodes: list[str] | None = None) -> None:
        """A new rollout: no call, this sampling (validation's may differ), only ``episodes`` taken (an agent of an
        earlier rollout still running past its time limit is refused, never mixed into a new episode)."""
        self.temperature, self.top_p = temperature, top_p
        self._open = None if episodes is None else set(episodes)
        for d in (self.calls, self.refused, self._last):
            d.clear()
        self._closed.clear()
        self.batches, self.engine_s, self._engine_calls, self.late_rounds = [], 0.0, 0, 0
        self.waited.clear()
        self.asking.clear()
        while True:  # a request of an earlier rollout's late agent, queued as its rollout ended: refused
            try:
                _, _, _, answer, _ = self._queue.get_nowait()
            except queue.Empty:
                break
            answer.set_exception(Refused("the episode is over (its rollout ended)", code="episode_over"))

    def end(self, episode: str) -> None:
        """The episode is over (its agent timed out): its later requests are refused, one waiting is answered so."""
        self._closed.add(episode)

    # ---- the engine's side (the rank's main thread)

    def serve(self, engine: Any, live: Callable[[], list[str]], key: Any, validate: bool = False,
              wait_s: float = 5.0, poll_s: float = 0.002) -> None:
        """Answer in rounds until no episode is live and nothing waits. ``live()``: the episodes whose agents still
        run, in order; a round starts once each of them has a request waiting (or once no request has come for
        ``wait_s``, without those that have not asked: ``late_rounds``), and its requests go to the engine in that
        order. The wait counts from the latest request, not the round's first: agents that are still sending (a loaded
        machine's hundreds of threads) are waited for, and only an episode whose agent went quiet is left out.
        ``key``: the sampling key of this serving (a step's), each round numbered under it."""
        waiting: dict[str, list] = {}
        since = 0.0
        while True:
            try:
                episode, prompt, cap, answer, asked = self._queue.get(timeout=poll_s)
                since = time.monotonic()  # the wait counts from the latest request: agents still asking are waited for
                waiting.setdefault(episode, []).append((prompt, cap, answer))
                # from when the server queued it: the time it waited for this thread (a round in the engine) is not
                # the agent's
                self.asking.setdefault(episode, asked)
                continue  # take all that came before deciding
            except queue.Empty:
                pass
            for episode in [e for e in waiting if e in self._closed or (self._open is not None
                                                                       and e not in self._open)]:
                self.asking.pop(episode, None)
                for _, _, answer in waiting.pop(episode):
                    answer.set_exception(Refused("the episode is over (its time limit passed)", code="episode_over"))
            order = live()
            if not waiting:
                if not order:
                    return
                continue
            if any(e not in waiting for e in order):
                if time.monotonic() - since < wait_s:
                    continue
                self.late_rounds += 1
            rank = {e: i for i, e in enumerate(order)}
            episodes = sorted(waiting, key=lambda e: rank.get(e, len(rank)))
            batch = [r for e in episodes for r in waiting[e]]
            waiting.clear()
            t0 = time.perf_counter()
            try:
                turns = engine.generate_ids([p for p, _, _ in batch], [c for _, c, _ in batch], validate,
                                            (key, self._engine_calls))
            except Exception as e:  # noqa: BLE001 - each waiting request is told, then the rank's caller
                for _, _, answer in batch:
                    answer.set_exception(e)
                raise
            self.engine_s += time.perf_counter() - t0
            now = time.monotonic()
            for e in episodes:
                self.waited[e] += now - self.asking.pop(e, now)
            self._engine_calls += 1
            self.batches.append(len(batch))
            for (_, _, answer), turn in zip(batch, turns):
                answer.set_result(turn)

    # ---- the HTTP side (the server's thread)

    def _handler(self, work: Callable, default: str | None) -> Callable:
        async def handle(request: Request):
            episode = request.path_params.get("episode", default)
            try:
                try:
                    body = await request.json() if request.method == "POST" else {}
                except ValueError as e:
                    raise Refused(f"the request body is not JSON ({e})") from None
                if not isinstance(body, dict):
                    raise Refused("the request body must be a JSON object")
                return await work(episode, body)
            except EngineError as e:  # the engine's error, told to the agent as OpenAI's servers do
                error = Refused(f"the engine failed: {e}", code="engine_error", status=500)
                return JSONResponse(error.body(), status_code=500)
            except Exception as e:  # noqa: BLE001 - a request the endpoint cannot read or render: the agent's
                error = e if isinstance(e, Refused) else Refused(
                    f"the request cannot be read or rendered ({type(e).__name__}: {str(e)[:300]})")
                self.refused[episode].append(f"{error.code or 'refused'}: {error}")
                return JSONResponse(error.body(), status_code=error.status)
        return handle

    async def _models(self, episode: str, body: dict) -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                                         "owned_by": "spmd-rl"}]})

    def _check_sampling(self, body: dict) -> None:
        if body.get("n") not in (None, 1):
            raise Refused(f"n={body['n']}: each call is one sample of its episode; ask n times", "n",
                          "unsupported_value")
        for name, ours in (("temperature", self.temperature), ("top_p", self.top_p)):
            given = body.get(name)
            if given is not None and abs(float(given) - ours) > 1e-6:
                raise Refused(f"{name}={given}: this run samples with {name} {ours:g} (the trainer recomputes the "
                              f"log-probs of what it samples); leave it out or send {ours:g}", name,
                              "unsupported_value")

    def _cap(self, body: dict, prompt_ids: list[int], start: int) -> int:
        """The tokens the call may sample: what it asks, within the room its row has left."""
        if start > self.max_prompt:
            raise Refused(f"the prompt is {start} tokens, over the {self.max_prompt} a row's prompt may hold "
                          f"(data.max_prompt_length)", "messages", "context_length_exceeded")
        room = self.max_response - (len(prompt_ids) - start)
        if room <= 0:
            raise Refused(f"the conversation has used the {self.max_response} tokens an episode's row holds after its "
                          f"prompt (rollout.max_response_length): no room for a response", "messages",
                          "context_length_exceeded")
        asked = body.get("max_completion_tokens") or body.get("max_tokens") or room
        return max(1, min(int(asked), room))

    async def _generate(self, episode: str, prompt_ids: list[int], cap: int) -> Turn:
        if episode in self._closed or (self._open is not None and episode not in self._open):
            raise Refused("the episode is over (its time limit passed, or its rollout ended)", code="episode_over")
        answer: concurrent.futures.Future = concurrent.futures.Future()
        self._queue.put((episode, prompt_ids, cap, answer, time.monotonic()))
        try:
            return await asyncio.wrap_future(answer)
        except Refused:
            raise
        except Exception as e:  # noqa: BLE001 - what the engine raised
            raise EngineError(f"{type(e).__name__}: {e}") from e

    def _stops(self, body: dict) -> list[str]:
        stop = body.get("stop") or []
        return [stop] if isinstance(stop, str) else list(stop)

    def _finish(self, turn: Turn, stops: list[str]) -> tuple[list[int], list[float], list[int] | None, bool, str, bool]:
        """The sampled ids kept (cut after a stop string), their log-probs and kept counts, whether they end on the
        engine's stop token, the text (the stop token and stop string left out), and whether a stop string cut it."""
        ids, logps, kept, stopped = turn.ids, turn.logps, turn.kept, turn.stopped
        body = ids[:-1] if stopped else ids
        text = self.tokenizer.decode(body, skip_special_tokens=True)
        hits = [text.find(s) for s in stops if s and s in text]
        if not hits:
            return ids, logps, kept, stopped, text, False
        at = min(hits)
        k = next(k for k in range(1, len(body) + 1)
                 if any(s in self.tokenizer.decode(body[:k], skip_special_tokens=True) for s in stops if s))
        return ids[:k], logps[:k], None if kept is None else kept[:k], False, text[:at], True

    def _prompt(self, episode: str, messages: list[dict], tools: Any) -> tuple[list[int], bool]:
        """The prompt ids of a chat request, and whether they continue the episode's last call (its row)."""
        last = self._last.get(episode)
        if last is not None and tools == last.tools:
            k = len(last.messages)
            new = messages[k + 1:]
            if len(messages) > k + 1 and all(same(a, b) for a, b in zip(messages[:k], last.messages)) \
                    and same(messages[k], last.reply) and all(m.get("role") in ("tool", "user") for m in new):
                c = last.call
                stop_text = self.tokenizer.decode(c.ids[-1:]) if c.stopped else ""
                rendered = [{"role": m["role"], "content": text_of(m.get("content")), "name": m.get("name"),
                             "tool_call_id": m.get("tool_call_id")} for m in new]
                return c.prompt_ids + c.ids + self.renderer.observation_ids(rendered, stop_text), True
        text = render(self.tokenizer, messages, tools, self.write_calls, self.template_writes_calls)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"], False

    async def _chat(self, episode: str, body: dict):
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise Refused("messages must be a non-empty list", "messages", "missing_messages")
        self._check_sampling(body)
        choice = body.get("tool_choice")
        if choice not in (None, "auto", "none"):
            raise Refused(f"tool_choice={json.dumps(choice)}: the engine samples freely, it cannot force a call; use "
                          f"auto or none", "tool_choice", "unsupported_value")
        tools = body.get("tools")
        prompt_ids, extends = self._prompt(episode, messages, tools)
        start = self._last[episode].call.start if extends else len(prompt_ids)
        turn = await self._generate(episode, prompt_ids, self._cap(body, prompt_ids, start))
        ids, logps, kept, stopped, text, cut = self._finish(turn, self._stops(body))
        call = Call(prompt_ids, ids, logps, stopped, kept, extends, start, text)
        parsed = self.parse(text) if tools and choice != "none" else Parsed()
        calls = [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                  "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in parsed.calls]
        # the text before the calls (hermes); a format whose calls are the whole text (llama3_json) leaves none
        content = (text.split("<tool_call>")[0].strip() if "<tool_call>" in text else "") if calls else text
        reply = {"role": "assistant", "content": content or None, **({"tool_calls": calls} if calls else {})}
        finish = "tool_calls" if calls else "stop" if stopped or cut else "length"
        self.calls[episode].append(call)
        self._last[episode] = Last(list(messages), tools, reply, call)
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                 "total_tokens": len(prompt_ids) + len(ids)}
        head = {"id": f"chatcmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_name}
        if not body.get("stream"):
            return JSONResponse({**head, "object": "chat.completion", "usage": usage, "choices": [
                {"index": 0, "message": reply, "finish_reason": finish, "logprobs": None}]})
        deltas = [{"role": "assistant", "content": ""}]
        if reply["content"]:
            deltas.append({"content": reply["content"]})
        if calls:
            deltas.append({"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]})
        chunks = [{**head, "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": d,
                                                                           "finish_reason": None}]} for d in deltas]
        chunks.append({**head, "object": "chat.completion.chunk",
                       "choices": [{"index": 0, "delta": {}, "finish_reason": finish}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({**head, "object": "chat.completion.chunk", "choices": [], "usage": usage})
        return StreamingResponse(events(chunks), media_type="text/event-stream")

    async def _completion(self, episode: str, body: dict):
        self._check_sampling(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            prompt_ids = list(prompt)
        else:
            raise Refused("prompt must be one string or one list of token ids", "prompt", "invalid_prompt")
        turn = await self._generate(episode, prompt_ids, self._cap(body, prompt_ids, len(prompt_ids)))
        ids, logps, kept, stopped, text, cut = self._finish(turn, self._stops(body))
        self.calls[episode].append(Call(prompt_ids, ids, logps, stopped, kept, False, len(prompt_ids), text))
        usage = {"prompt_tokens": len(prompt_ids), "completion_tokens": len(ids),
                 "total_tokens": len(prompt_ids) + len(ids)}
        head = {"id": f"cmpl-{uuid.uuid4().hex}", "created": int(time.time()), "model": self.model_name,
                "object": "text_completion"}
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "stop" if stopped or cut else "length"}
        if not body.get("stream"):
            return JSONResponse({**head, "choices": [choice], "usage": usage})
        chunks = [{**head, "choices": [choice]}]
        if (body.get("stream_options") or {}).get("include_usage"):
            chunks.append({**head, "choices": [], "usage": usage})
        return StreamingResponse(events(chunks), media_type="text/event-stream")
