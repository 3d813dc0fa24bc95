"""Agents as users write them (issue 75): a program written against the OpenAI API, trained through an endpoint that
serves this rank's rollout engine and keeps every token it saw and sampled.

- ``endpoint``: the OpenAI-compatible endpoint (chat completions with tools and streaming, completions, models), its
  rounds into the engine, the calls' tokens kept per episode;
- ``messages``: a call's kept tokens, OpenAI's error bodies, reading messages, server-sent events;
- ``samples``: an episode's calls as training rows (merged where a call continues the previous, split where the
  agent rewrote its history);
- ``runner``: the rollout: every sample's agent (``--agent.entry`` or ``--agent.command``) run while the rank serves;
- ``pool`` and ``worker``: function agents in worker processes of the rank (``--agent.workers``).
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.util
import inspect
import os
import shlex
import shutil
import sys
from typing import Any, Callable

from lib.envs import scored_episode_problems
from lib.multi_turn.parsers import PARSERS
from lib.rewards import load_object

INSTALL = "pip install -e '.[agents]' (uvicorn, starlette)"


def enabled(cfg: Any) -> bool:
    """``cfg``: the whole Config."""
    return bool(cfg.agent.entry or cfg.agent.command)


def config_problems(cfg: Any) -> list[str]:
    """What keeps the agent section's values from running (each naming the fix); nothing when it is off."""
    a = cfg.agent
    if not enabled(cfg):
        return []
    problems = []
    if a.entry and a.command:
        problems.append(f"agent.entry={a.entry!r} and agent.command={a.command!r} both name the agent; keep one")
    others = [name for name, on in (("multi_turn.tools", cfg.multi_turn.tools), ("env.url", cfg.env.url),
                                    ("env.app", cfg.env.app), ("env.verifiers", cfg.env.verifiers),
                                    ("rollout.partial", cfg.rollout.partial.enabled)) if on]
    if others:
        problems.append(f"agent drives its episodes' turns itself, and {', '.join(others)} would too (partial "
                        f"rollouts: an agent's episode lives within its step); drop {' and '.join(others)}")
    if cfg.rollout.tp_size > 1:
        problems.append(f"agents with rollout.tp_size={cfg.rollout.tp_size}: each rank's agents call its own engine in "
                        f"rounds of their own, which a tensor-parallel group cannot share; use rollout.tp_size 1")
    if a.format not in PARSERS:
        problems.append(f"agent.format={a.format!r}; use one of {sorted(PARSERS)}")
    problems += scored_episode_problems("agent", a, ("timeout_s", "round_wait_s"))
    if a.workers < 0:
        problems.append(f"agent.workers={a.workers} must be >= 0 (0: the agents in threads of the rank's process)")
    if a.workers and a.command:
        problems.append(f"agent.workers={a.workers} runs agent.entry's functions in worker processes; agent.command "
                        f"runs as a process of its own already: drop agent.workers")
    if a.max_in_flight < 0:
        problems.append(f"agent.max_in_flight={a.max_in_flight} must be >= 0 (0: all of a rank's episodes at once)")
    if not cfg.data.apply_chat_template:
        problems.append("agents send chat messages, rendered with the chat template: turn data.apply_chat_template on")
    if any(importlib.util.find_spec(m) is None for m in ("uvicorn", "starlette")):
        problems.append(f"agents talk to an endpoint served with uvicorn and starlette, which are not installed: "
                        f"{INSTALL}")
    return problems


def load_agent(spec: str) -> Callable:
    """agent.entry -> the function: ``path/to/file.py:name`` or ``package.module:name``. Raises ValueError naming
    the fix."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"agent.entry {spec!r} must look like path/to/agent.py:function or package.module:function")
    if path.endswith(".py") or os.sep in path:
        fn = load_object(spec, "agent.entry")
    else:
        try:
            module = importlib.import_module(path)
        except BaseException as e:  # noqa: BLE001 - user code: any failure to import is a config error
            raise ValueError(f"agent.entry {spec}: module {path!r} failed to import: {type(e).__name__}: {e}") \
                from None
        if not hasattr(module, name):
            raise ValueError(f"agent.entry {spec}: module {path} has no {name!r}")
        fn = getattr(module, name)
    if not callable(fn):
        raise ValueError(f"agent.entry {spec}: {type(fn).__name__} is not a function")
    try:
        inspect.signature(fn).bind({}, "")
    except TypeError as e:
        raise ValueError(f"agent.entry {spec}: it must take (row, base_url), and {e}") from None
    except ValueError:  # no signature to read (a builtin): called as it is
        pass
    return fn


def warm() -> None:
    """Where the agent imports the openai SDK: its first client and first ``client.chat.completions`` import the
    SDK's resources and their types (~1.3 s of a core measured, several times that on a loaded machine), done here
    once, when the process loads the agent, so that no episode's time limit pays for it (a worker's first episodes
    timed out at 3 s on a loaded 2-core machine). Nothing where openai is not imported."""
    openai = sys.modules.get("openai")
    if openai is None or not hasattr(openai, "OpenAI"):
        return
    client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="unused", max_retries=0)
    try:
        client.chat.completions, client.completions, client.models  # noqa: B018 - the attributes' imports are the work
    finally:
        client.close()


def play(fn: Callable, row: dict, base_url: str) -> tuple[str, Any]:
    """One episode of a function agent, where it runs (a thread of the rank, or of a worker process): ("", what it
    returned) or ("error", why it failed). ``async def`` agents run in an event loop of their own."""
    try:
        out = fn(row, base_url)
        if inspect.isawaitable(out):
            out = asyncio.run(_awaited(out))
    except BaseException as e:  # noqa: BLE001 - the user's agent: whatever it raised fails its episode
        return "error", f"the agent raised {type(e).__name__}: {str(e)[:300]}"
    return "", out


async def _awaited(coroutine: Any) -> Any:
    return await coroutine


def check_command(command: str) -> list[str]:
    """agent.command -> its argument list; its program must exist. Raises ValueError naming the fix."""
    try:
        argv = shlex.split(command)
    except ValueError as e:
        raise ValueError(f"agent.command {command!r} cannot be split into arguments ({e})") from None
    if not argv:
        raise ValueError("agent.command is empty")
    program = argv[0]
    if shutil.which(program) is None and not (os.path.isfile(program) and os.access(program, os.X_OK)):
        raise ValueError(f"agent.command: {program!r} is not a program on PATH or an executable file")
    return argv
