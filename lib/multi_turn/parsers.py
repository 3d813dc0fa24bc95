"""Tool-call parsers: the text of one assistant turn -> the calls it makes, and what was malformed; and their
writers: calls -> the text a model of the format writes for them.

Registries by name (``multi_turn.format``, ``agent.format``). Each parser returns ``Parsed(calls, errors)``: a
malformed call is not dropped silently, its error text becomes an observation for the model. A writer's text parses
back to the same calls. This module stays free of torch: tool workers import it.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass
class Call:
    name: str
    arguments: dict[str, Any]


@dataclass
class Parsed:
    calls: list[Call] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    @property
    def any(self) -> bool:
        """The turn tried to call a tool (well-formed or not): the episode goes on."""
        return bool(self.calls or self.errors)


def _call_from(obj: Any, arguments_key: str) -> Call | str:
    """A parsed JSON object -> a Call, or the error text saying what is wrong with it."""
    if not isinstance(obj, dict):
        return f"a tool call must be a JSON object with \"name\" and \"{arguments_key}\", got {type(obj).__name__}"
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return "a tool call needs a string \"name\""
    args = obj.get(arguments_key, obj.get("arguments", obj.get("parameters", {})))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except ValueError:
            return f"the arguments of {name} are not valid JSON"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"the arguments of {name} must be a JSON object"
    return Call(name, args)


HERMES = re.compile(r"<tool_call>(.*?)(</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> Parsed:
    """Hermes and Qwen: each call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``. An unclosed tag
    or a body that is not a JSON object with a name is an error."""
    out = Parsed()
    for body, close in HERMES.findall(text):
        if not close:
            out.errors.append("a <tool_call> was not closed with </tool_call>")
            continue
        try:
            obj = json.loads(body.strip())
        except ValueError as e:
            out.errors.append(f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
            continue
        call = _call_from(obj, "arguments")
        (out.calls if isinstance(call, Call) else out.errors).append(call)
    return out


def parse_llama3_json(text: str) -> Parsed:
    """Llama-3.1/3.2 with JSON tools: the whole turn is one JSON object ``{"name": ..., "parameters": {...}}``,
    optionally after ``<|python_tag|>``; several calls may be separated by ``;``. A turn that does not start with
    ``{`` is an answer, not a call."""
    body = text.strip()
    if body.startswith("<|python_tag|>"):
        body = body[len("<|python_tag|>"):].strip()
    out = Parsed()
    if not body.startswith("{"):
        return out
    decoder = json.JSONDecoder()
    pos = 0
    while pos < len(body):
        try:
            obj, end = decoder.raw_decode(body, pos)
        except ValueError as e:
            out.errors.append(f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
            break
        call = _call_from(obj, "parameters")
        (out.calls if isinstance(call, Call) else out.errors).append(call)
        pos = end
        while pos < len(body) and body[pos] in " \n\t;":
            pos += 1
    return out


PARSERS: dict[str, Callable[[str], Parsed]] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}


def write_hermes(calls: list[Call]) -> str:
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` a call, as Hermes and Qwen write them."""
    return "".join(f'<tool_call>{json.dumps({"name": c.name, "arguments": c.arguments})}</tool_call>' for c in calls)


def write_llama3_json(calls: list[Call]) -> str:
    """``{"name": ..., "parameters": {...}}`` a call, separated by ``; `` (Llama-3.1/3.2 with JSON tools)."""
    return "; ".join(json.dumps({"name": c.name, "parameters": c.arguments}) for c in calls)


WRITERS: dict[str, Callable[[list[Call]], str]] = {"hermes": write_hermes, "llama3_json": write_llama3_json}
