"""The OpenAI side of the agents' endpoint (lib/agents/endpoint.py): a call's kept tokens, the error bodies, reading
messages (their text, their tool calls, whether two say the same), rendering them, and server-sent events."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from lib.multi_turn.parsers import Call as ToolCall


@dataclass
class Call:
    """One completion call of an episode, as the engine saw and sampled it."""

    prompt_ids: list[int]
    ids: list[int]
    """The sampled ids, a stop token included; cut after a ``stop`` string where the request gave one."""
    logps: list[float]
    stopped: bool
    """Ended on the engine's stop token (not cut by the token cap or a stop string)."""
    kept: list[int] | None = None
    extends: bool = False
    """Its prompt is the episode's previous call's prompt and sampled ids, then the new messages."""
    start: int = 0
    """The prompt length of the row it belongs to (its own, or the first call's of the calls it continues)."""
    text: str = ""
    """The reply's text (the content; a chat reply's tool calls as the model wrote them)."""


@dataclass
class Last:
    """An episode's last chat call: its messages, the assistant message returned, its tokens."""

    messages: list[dict]
    tools: Any
    reply: dict
    call: Call


class EngineError(RuntimeError):
    """The engine's call for a request failed (HTTP 500 to the agent; the rank's caller gets the error itself)."""


class Refused(ValueError):
    """A request the endpoint does not take: OpenAI's error body, HTTP ``status``."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.param, self.code, self.status = param, code, status

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}


def text_of(content: Any) -> str:
    """A message's content as text: a string, or the text parts of a list of parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")


def calls_of(message: dict) -> list[tuple[str, dict]]:
    """A message's tool calls as (name, arguments) pairs, the arguments parsed where they came as JSON text."""
    out = []
    for c in message.get("tool_calls") or []:
        f = c.get("function", c)
        args = f.get("arguments") or {}
        if isinstance(args, str):
            try:
                args = json.loads(args)
            except ValueError:
                args = {"_text": args}
        out.append((f.get("name", ""), args))
    return out


def writes_calls(tokenizer: Any) -> bool:
    """Whether the chat template writes an assistant message's ``tool_calls`` itself (Qwen's, Llama's, ...: a probe
    message's call comes out in its text)."""
    probe = [{"role": "user", "content": "?"}, {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "call_0", "function": {"name": "probe_call_7f3", "arguments": {"a": 1}}}]}]
    try:
        return "probe_call_7f3" in tokenizer.apply_chat_template(probe, tokenize=False)
    except Exception:  # noqa: BLE001 - a template that cannot take the message does not write calls
        return False


def render(tokenizer: Any, messages: list[dict], tools: Any, write_calls: Callable, structured: bool) -> str:
    """The chat template's text of ``messages`` (then the assistant's turn). An assistant message's tool calls go in
    as ``tool_calls`` (``structured``: the template writes them, as the model was taught), or as the text of the
    run's format (``write_calls``, lib.multi_turn.parsers.WRITERS), which is also what a template that refuses the
    structured calls gets (Llama-3.1's takes one a message)."""
    def text(structured: bool) -> str:
        plain = []
        for m in messages:
            out = {"role": m.get("role"), "content": text_of(m.get("content"))}
            for k in ("name", "tool_call_id"):
                if m.get(k):
                    out[k] = m[k]
            calls = calls_of(m)
            if calls and structured:
                out["tool_calls"] = [{"type": "function", "id": c.get("id"), "function": {"name": n, "arguments": a}}
                                     for c, (n, a) in zip(m["tool_calls"], calls)]
            elif calls:
                out["content"] += write_calls([ToolCall(n, a) for n, a in calls])
            plain.append(out)
        return tokenizer.apply_chat_template(plain, tools=tools or None, add_generation_prompt=True, tokenize=False)

    if structured:
        try:
            return text(True)
        except Exception:  # noqa: BLE001 - calls the template cannot take: the format's text
            pass
    return text(False)


def same(a: dict, b: dict) -> bool:
    """Two messages say the same (the fields a chat template reads; absent and empty alike)."""
    keys = ("role", "name", "tool_call_id")
    return all((a.get(k) or None) == (b.get(k) or None) for k in keys) and text_of(a.get("content")) == \
        text_of(b.get("content")) and calls_of(a) == calls_of(b) and \
        [c.get("id") for c in a.get("tool_calls") or []] == [c.get("id") for c in b.get("tool_calls") or []]


def events(chunks: list[dict]) -> Iterator[str]:
    """Server-sent events: one ``data:`` line a chunk, then ``[DONE]``."""
    for chunk in chunks:
        yield f"data: {json.dumps(chunk)}\n\n"
    yield "data: [DONE]\n\n"
