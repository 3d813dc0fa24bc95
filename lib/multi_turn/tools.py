"""Tools: Python functions the policy calls by name, loaded like custom reward functions and run in worker
processes (lib/rewards/pool.py, mode ``tools``) under a per-call time limit.

``--multi_turn.tools path/to/file.py:name``, where ``name`` is a function, a list of functions or a dict of name ->
function. A tool's schema (what the chat template shows the model) comes from its signature and docstring
(``transformers.utils.get_json_schema``: a description, and an ``Args:`` line per parameter).

Every call costs its own result only. A call that raises, names no known tool, passes arguments the function does
not take, runs past ``multi_turn.tool_timeout_s`` (its worker is killed) or kills its worker is answered with an
error text the model sees as the observation, and counted by kind. This module stays free of torch: the workers
import it.
"""

from __future__ import annotations

import inspect
import json
from typing import Any, Callable

from lib.rewards import load_object

KINDS = ("errors", "invalid", "timeouts", "crashes")
"""How a tool call can fail: the tool raised; the call named no known tool or passed arguments it does not take;
it ran past the time limit; it killed its worker process."""


def load_tools(spec: str) -> dict[str, Callable]:
    """``path/to/file.py:name`` -> {tool name: function}."""
    obj = load_object(spec, "multi_turn.tools")
    if isinstance(obj, type):
        raise ValueError(f"multi_turn.tools {spec}: {obj.__name__} is a class; environments are not supported yet, "
                         f"give a function, a list of functions or a dict of name -> function")
    if callable(obj):
        tools = {obj.__name__: obj}
    elif isinstance(obj, dict):
        tools = dict(obj)
    elif isinstance(obj, (list, tuple)):
        tools = {getattr(fn, "__name__", str(i)): fn for i, fn in enumerate(obj)}
    else:
        raise ValueError(f"multi_turn.tools {spec}: a {type(obj).__name__} is not a function, a list of functions or "
                         f"a dict of name -> function")
    bad = [name for name, fn in tools.items() if not callable(fn) or not isinstance(name, str)]
    if not tools or bad:
        raise ValueError(f"multi_turn.tools {spec}: {bad or 'nothing'} is not a function; give functions")
    return tools


def schemas(tools: dict[str, Callable], spec: str = "") -> dict[str, dict]:
    """OpenAI function schemas of the tools, by name, from their signatures and docstrings."""
    from transformers.utils import get_json_schema

    out = {}
    for name, fn in tools.items():
        try:
            schema = get_json_schema(fn)
        except Exception as e:  # noqa: BLE001 - transformers raises its own types for a docstring it cannot read
            raise ValueError(f"multi_turn.tools {spec}: the schema of tool {name!r} cannot be read from its signature "
                             f"and docstring ({type(e).__name__}: {e}); give it a description, type hints, and an "
                             f"'Args:' section with a line per parameter") from None
        schema["function"]["name"] = name
        out[name] = schema
    return out


def row_tools(row_schemas: Any, tools_kwargs: Any, all_schemas: dict[str, dict]) -> list[dict]:
    """The schemas one data row offers: its ``tools`` column (OpenAI schemas) if it has one, else those named in
    ``extra_info.tools_kwargs`` (verl's layout), else every loaded tool. A named tool that is not loaded is an error."""
    if row_schemas is not None and len(row_schemas):
        chosen = list(row_schemas)
        names = [s.get("function", s).get("name") for s in chosen]
    elif isinstance(tools_kwargs, dict) and tools_kwargs:
        names = list(tools_kwargs)
        chosen = [all_schemas[n] for n in names if n in all_schemas]
    else:
        return list(all_schemas.values())
    missing = [n for n in names if n not in all_schemas]
    if missing:
        raise ValueError(f"the row offers tools {missing} that multi_turn.tools does not define (it has "
                         f"{sorted(all_schemas)})")
    return chosen


def bound_kwargs(tools_kwargs: Any, name: str) -> dict:
    """Keyword arguments the row binds to a tool, as verl's ``extra_info.tools_kwargs[name].create_kwargs`` (e.g.
    the ground truth a checking tool compares with); the model's arguments cannot override them."""
    if not isinstance(tools_kwargs, dict):
        return {}
    entry = tools_kwargs.get(name) or {}
    kwargs = entry.get("create_kwargs") if isinstance(entry, dict) else None
    return dict(kwargs) if isinstance(kwargs, dict) else {}


def as_text(result: Any) -> str:
    if isinstance(result, str):
        return result
    try:
        return json.dumps(result)
    except (TypeError, ValueError):
        return str(result)


def run_call(tools: dict[str, Callable], name: str, arguments: dict, bound: dict) -> tuple[str, str, str]:
    """In a worker: one call -> (observation text, failure kind or "", message)."""
    fn = tools.get(name)
    if fn is None:
        return failed("invalid", f"unknown tool {name!r}; the tools are {sorted(tools)}")
    kwargs = {**arguments, **bound}
    try:
        inspect.signature(fn).bind(**kwargs)
    except TypeError as e:
        return failed("invalid", f"bad arguments for {name}: {e}")
    except ValueError:  # no signature to check (a builtin): let the call say
        pass
    try:
        return as_text(fn(**kwargs)), "", ""
    except SystemExit as e:
        return failed("errors", f"{name} called sys.exit({e.code!r})")
    except BaseException as e:  # noqa: BLE001 - the tool's failure costs its call only
        return failed("errors", f"{name} raised {type(e).__name__}: {e}")


def failed(kind: str, message: str) -> tuple[str, str, str]:
    """A failed call's result: the model reads the message as the tool's answer."""
    return f"Error: {message}", kind, message
