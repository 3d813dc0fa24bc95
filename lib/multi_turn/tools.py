"""Tools: Python functions the policy calls by name, loaded like custom reward functions and run in worker
processes (lib/rewards/pool.py, mode ``tools``) under a per-call time limit.

``--multi_turn.tools path/to/file.py:name``, where ``name`` is a function, a list of functions or a dict of name ->
function, or an environment: a class with ``reset(**row)``, public tool methods, ``reward()`` and ``close()``. Each
episode gets an instance of its own, in one worker (lib/rewards/pool.py pins its calls there): ``reset`` gets the
row (prompt, data_source, ground_truth, extra_info and the other columns), the model calls the tool methods, and
``reward()`` (a number, or a dict with ``score`` like a custom reward) is the episode's score. A tool's schema (what
the chat template shows the model) comes from its signature and docstring (``transformers.utils.get_json_schema``:
a description, and an ``Args:`` line per parameter).

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


ENV_METHODS = ("reset", "reward", "close")
LOST = "the episode's environment is gone (its reset failed, or its worker process was killed and replaced)"


def load_tools(spec: str) -> dict[str, Callable]:
    """``path/to/file.py:name`` -> {tool name: function} (an environment's: its public methods but reset, reward
    and close, unbound)."""
    return tools_of(load_object(spec, "multi_turn.tools"), spec)


def tools_of(obj: Any, spec: str) -> dict[str, Callable]:
    if isinstance(obj, type):
        missing = [m for m in ENV_METHODS if not callable(getattr(obj, m, None))]
        if missing:
            raise ValueError(f"multi_turn.tools {spec}: the environment {obj.__name__} has no {missing}; an "
                             f"environment is a class with reset(**row), tool methods, reward() and close()")
        tools = {name: fn for name, fn in inspect.getmembers(obj, inspect.isfunction)
                 if not name.startswith("_") and name not in ENV_METHODS}
    elif callable(obj):
        tools = {obj.__name__: obj}
    elif isinstance(obj, dict):
        tools = dict(obj)
    elif isinstance(obj, (list, tuple)):
        tools = {getattr(fn, "__name__", str(i)): fn for i, fn in enumerate(obj)}
    else:
        raise ValueError(f"multi_turn.tools {spec}: a {type(obj).__name__} is not a function, a list of functions, "
                         f"a dict of name -> function or an environment class")
    bad = [name for name, fn in tools.items() if not callable(fn) or not isinstance(name, str)]
    if not tools or bad:
        what = f"{bad[:3]}{f' and {len(bad) - 3} more' if len(bad) > 3 else ''} are not functions" if bad else \
            "there is no tool"
        raise ValueError(f"multi_turn.tools {spec}: {what}; give functions (or an environment with public tool "
                         f"methods)")
    return tools


def is_environment(spec: str) -> bool:
    return isinstance(load_object(spec, "multi_turn.tools"), type)


def schemas(tools: dict[str, Callable], spec: str = "") -> dict[str, dict]:
    """OpenAI function schemas of the tools, by name, from their signatures and docstrings."""
    # deferred: transformers is heavy, and every reward and tool worker process imports this module at its start
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


class ToolHost:
    """In a tool worker: runs the loop's operations, each ``(op, episode, *args)`` -> (text or value, failure kind or
    "", message). ``call``: (name, arguments, bound arguments) -> the tool's answer as text. With an environment
    also ``reset`` (row), ``reward`` (-> its raw value) and ``close``; the instances live here, by episode."""

    def __init__(self, spec: str):
        obj = load_object(spec, "multi_turn.tools")
        self.tools = tools_of(obj, spec)
        self.env_class = obj if isinstance(obj, type) else None
        self.envs: dict[Any, Any] = {}

    def __call__(self, op: str, episode: Any, *args: Any) -> tuple[Any, str, str]:
        if op == "call":
            return self.call(episode, *args)
        if op == "reset":
            self.envs.pop(episode, None)
            env = self.env_class()
            out = guarded(lambda: env.reset(**args[0]), "reset")
            if not out[1]:
                self.envs[episode] = env
            return out
        env = self.envs.get(episode)
        if env is None:  # lost with its worker, or never reset: nothing to close, no reward
            return ("", "", "") if op == "close" else failed("crashes", LOST)
        if op == "reward":
            return guarded(env.reward, "reward", as_value=True)
        if op == "close":
            del self.envs[episode]
            return guarded(env.close, "close")
        raise ValueError(f"unknown tool operation {op!r}")

    def call(self, episode: Any, name: str, arguments: dict, bound: dict) -> tuple[str, str, str]:
        if self.env_class is not None:
            env = self.envs.get(episode)
            if env is None:
                return failed("crashes", LOST)
            fn = getattr(env, name) if name in self.tools else None
        else:
            fn = self.tools.get(name)
        if fn is None:
            return failed("invalid", f"unknown tool {name!r}; the tools are {sorted(self.tools)}")
        kwargs = {**arguments, **bound}
        try:
            inspect.signature(fn).bind(**kwargs)
        except TypeError as e:
            return failed("invalid", f"bad arguments for {name}: {e}")
        except ValueError:  # no signature to check (a builtin): let the call say
            pass
        return guarded(lambda: fn(**kwargs), name)


def guarded(fn: Callable[[], Any], name: str, as_value: bool = False) -> tuple[Any, str, str]:
    """Run ``fn``; its failure is its result's only: (error text, "errors", message)."""
    try:
        out = fn()
    except SystemExit as e:
        return failed("errors", f"{name} called sys.exit({e.code!r})")
    except BaseException as e:  # noqa: BLE001 - the tool's failure costs its call only
        return failed("errors", f"{name} raised {type(e).__name__}: {e}")
    return (out if as_value else as_text(out)), "", ""


def failed(kind: str, message: str) -> tuple[str, str, str]:
    """A failed call's result: the model reads the message as the tool's answer."""
    return f"Error: {message}", kind, message
