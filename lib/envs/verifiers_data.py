"""A verifiers environment's taskset as prompt data: a data file named

    verifiers:ENV_ID[:key=value ...]

in ``--data.train_files`` or ``--data.val_files`` becomes a JSON-lines file of rows in our layout (written once under
the output root, named by the spec's hash): one row per task of the environment's taskset, made with the arguments
``key=value`` (a value is read as JSON, else taken as text; e.g. ``split=val``). Each row: the task's prompt (its
system prompt, then its prompt as chat messages), ``data_source`` ``verifiers/ENV_ID`` (validation reports each
environment apart), the task's ``answer`` (if it has one) as the ground truth, and in ``extra_info.verifiers`` what
finds the task again, which the scorer uses (lib/rewards/verifiers_score.py: the environment's own rewards).

verifiers 0.4 finds ENV_ID as an installed module (``-`` read as ``_``) whose ``__all__`` names one Taskset, or one of
its own tasksets (``openenv``, ``textarena``, ...). A task without a prompt (the environment opens the conversation, as
verifiers' openenv taskset does) makes a row whose prompt is its system prompt or nothing, ``extra_info.env_opens``
set: only ``--env.verifiers``, which plays the environment's turns, takes it (lib/envs/verifiers_play.py).
"""

from __future__ import annotations

import json
import re

from lib.envs.rows import written
from lib.rewards.verifiers_score import SOURCE_PREFIX, messages_of, tasks

PREFIX = "verifiers:"
USAGE = "verifiers:ENV_ID[:key=value ...]"


def is_spec(name: str) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def parse(name: str) -> tuple[str, dict]:
    # options split at a colon that starts the next key=: a value may hold colons (a URL, JSON)
    env_id, *options = re.split(r":(?=[A-Za-z_][\w.]*=)", name[len(PREFIX):])
    env_id, colon, stray = env_id.partition(":")
    if colon:  # an option before any key=value
        options.insert(0, stray)
    if not env_id:
        raise ValueError(f"data file {name!r} names no environment; write {USAGE}")
    arguments = {}
    for option in options:
        key, eq, value = option.partition("=")
        if not eq or not key:
            raise ValueError(f"data file {name!r}: {option!r} is not key=value; write {USAGE}")
        try:
            arguments[key] = json.loads(value)
        except ValueError:
            arguments[key] = value
    return env_id, arguments


def rows(name: str) -> list[dict]:
    env_id, arguments = parse(name)
    encoded = json.dumps(arguments, sort_keys=True)
    try:
        found = tasks(env_id, encoded)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - verifiers' own errors: no such module, a refused argument
        missing = missing_dependency(e, env_id)
        if missing:
            raise ValueError(f"verifiers environment {env_id!r} is installed but cannot be imported: it imports "
                             f"{missing!r}, which is not installed; install the package that provides {missing!r} "
                             f"(pip install ...)") from None
        raise ValueError(f"verifiers environment {env_id!r} with {encoded} cannot be loaded ({type(e).__name__}: "
                         f"{str(e)[:300]}); install its package (pip install ...) and check its arguments") from None
    out = []
    for index, task in enumerate(found):
        answer = getattr(task.data, "answer", None)
        extra = {"index": index, "verifiers": {"env": env_id, "arguments": encoded, "index": index}}
        if task.data.prompt is None:  # the environment's first message opens the conversation (env.verifiers)
            extra["env_opens"] = True
        out.append({"prompt": messages_of(task), "data_source": SOURCE_PREFIX + env_id,
                    "reward_model": {"ground_truth": "" if answer is None else str(answer), "style": "rule"},
                    "extra_info": extra})
    if not out:
        raise ValueError(f"verifiers environment {env_id!r} with {encoded} has no task")
    return out


def missing_dependency(error: BaseException, env_id: str) -> str | None:
    """The module really missing behind verifiers' "taskset ... not found": its loader raises that for every
    ModuleNotFoundError while importing the environment, the original chained to it. The name of a missing module
    other than the environment's own (a dependency the environment imports), else None."""
    own = env_id.rsplit("/", 1)[-1].split("@", 1)[0].replace("-", "_").lower()  # verifiers' module for the id
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        name = getattr(error, "name", None) if isinstance(error, ModuleNotFoundError) else None
        if name:
            top = name.split(".")[0]
            return None if top == own or name.endswith(f".{own}") else name
        error = error.__cause__ or error.__context__
    return None


def opened_by_env(path: str) -> bool:
    """Whether the rows at ``path`` (written by ``build``) open with the environment's first message."""
    with open(path) as f:
        return bool(json.loads(f.readline())["extra_info"].get("env_opens"))


def build(name: str, root: str) -> str:
    """The JSON-lines file of a ``verifiers:...`` name under ``root`` (written once, atomically)."""
    env_id, _ = parse(name)
    return written(root, "verifiers", env_id, name, lambda: rows(name))
