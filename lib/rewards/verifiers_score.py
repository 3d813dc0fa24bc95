"""A verifiers environment's own scoring as a rule scorer: a row whose data_source is ``verifiers/<env id>`` is scored
by its task's rewards (``await task.score(trace)``, verifiers 0.4's ``verifiers.v1``) on a trace of the row's prompt
and the response, the task found again from what the row names in ``extra_info.verifiers`` (the environment id, its
taskset arguments as JSON, the task's index). The score is the trace's weighted reward; each reward's own score
and each metric go to the metrics as ``reward/vf_<name>``.

Torch-free like the rest of lib/rewards: the reward workers import it. verifiers itself is imported on first use
(pip install -e '.[verifiers]').
"""

from __future__ import annotations

import asyncio
import functools
import json
from typing import Any

from lib.rewards.optional import Preload, optional

SOURCE_PREFIX = "verifiers/"
INSTALL = "pip install -e '.[verifiers]' (or pip install verifiers==0.4.0)"


def library() -> Any:
    return optional("verifiers.v1", "verifiers rows need the verifiers package (0.4)", INSTALL)


@functools.lru_cache(maxsize=16)
def tasks(env_id: str, arguments: str) -> list:
    """The tasks of environment ``env_id``'s taskset made with ``arguments`` (JSON), in its order."""
    vf = library()
    config = vf.taskset_config_type(env_id)(id=env_id, **json.loads(arguments))
    return list(vf.load_taskset(config))


def _key(extra_info: Any) -> tuple | None:
    where = extra_info.get("verifiers") if isinstance(extra_info, dict) else None
    try:
        return (where["env"], where.get("arguments", "{}"))
    except (AttributeError, KeyError, TypeError):
        return None


PRELOAD = Preload(_key, tasks)
"""verifiers and the row's environment's tasks, loaded by the reward worker before the sample's time starts."""


def messages_of(task: Any) -> list[dict]:
    """The task's prompt as chat messages: its system prompt, then its prompt (a text is one user message)."""
    data = task.data
    out = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if data.prompt is None:  # the environment opens the conversation
        return out
    if isinstance(data.prompt, str):
        return out + [{"role": "user", "content": data.prompt}]
    for m in data.prompt or []:
        m = m.model_dump() if hasattr(m, "model_dump") else dict(m)
        out.append({"role": m["role"], "content": m.get("content") if isinstance(m.get("content"), str) else
                    json.dumps(m.get("content"))})
    return out


def opening_trace(task: Any, **agent: Any) -> Any:
    """A verifiers trace holding the task's opening messages (messages_of), as its harness starts one; ``agent``:
    the AgentInfo's other fields (a seat's name)."""
    vf = library()
    kinds = {"system": vf.SystemMessage, "user": vf.UserMessage, "assistant": vf.AssistantMessage}
    trace = vf.Trace(task=vf.TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                     agent=vf.AgentInfo(config=vf.AgentConfig(), **agent))
    for m in messages_of(task):
        append(trace, kinds[m["role"]](content=m["content"]))
    return trace


def append(trace: Any, message: Any, sampled: bool = False) -> None:
    """One message after the trace's last (``sampled``: the model's)."""
    nodes = trace.nodes
    nodes.append(library().MessageNode(message=message, parent=len(nodes) - 1 if nodes else None, sampled=sampled))


def trace_of(task: Any, response: str) -> Any:
    """A verifiers trace of the task's prompt and one sampled reply, as its harness records a single turn."""
    trace = opening_trace(task)
    append(trace, library().AssistantMessage(content=response), sampled=True)
    return trace


def score(solution_str: str, ground_truth: Any = None, extra_info: Any = None) -> dict:
    """The environment's weighted reward of the response, and each of its rewards."""
    where = extra_info.get("verifiers") if isinstance(extra_info, dict) else None
    if not isinstance(where, dict):
        raise ValueError("a verifiers row has no extra_info.verifiers (env, arguments, index); make the rows with "
                         "--data.train_files verifiers:ENV_ID")
    task = tasks(where["env"], where.get("arguments", "{}"))[int(where["index"])]
    trace = trace_of(task, solution_str)
    asyncio.run(task.score(trace))
    out = {"score": float(trace.reward)}
    out.update({f"vf_{name}": float(r.score) for name, r in trace.rewards.items()})
    out.update({f"vf_{name}": float(v) for name, v in trace.metrics.items() if isinstance(v, (int, float))})
    return out
