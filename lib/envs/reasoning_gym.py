"""reasoning-gym's procedural tasks as prompt data, made offline: a data file named

    reasoning_gym:TASK[,TASK...][:size=N][:seed=S][:system=NAME][:TASK.key=value ...]

in ``--data.train_files`` or ``--data.val_files`` becomes a JSON-lines file of rows in our layout (written once under
the output root, named by the spec's hash): N entries of each task (default 1000) from the library's generator with
seed S (default 0; give validation another seed so its entries differ), the generator's settings from the
``TASK.key=value`` parts (a value is read as JSON, else taken as text). Each row: the prompt (the library's system
prompt NAME, default ``default``, which asks for the answer in <answer> tags; ``none``: no system message; and the
question), ``data_source`` ``reasoning_gym/TASK`` (validation reports each task apart), the entry's answer as the
ground truth, and in ``extra_info.reasoning_gym`` what makes the entry again, which the scorer uses
(lib/rewards/reasoning_gym.py: the library's own score_answer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from lib.envs.rows import written
from lib.rewards.reasoning_gym import SOURCE_PREFIX, dataset, library

PREFIX = "reasoning_gym:"
USAGE = "reasoning_gym:TASK[,TASK...][:size=N][:seed=S][:system=NAME][:TASK.key=value ...]"


@dataclass
class Spec:
    tasks: list[str]
    size: int = 1000
    seed: int = 0
    system: str = "default"
    settings: dict[str, dict] = field(default_factory=dict)  # task -> generator keyword arguments


def is_spec(name: str) -> bool:
    return isinstance(name, str) and name.startswith(PREFIX)


def parse(name: str) -> Spec:
    """The spec of a ``reasoning_gym:...`` data name; ValueError naming the fix."""
    head, *options = name[len(PREFIX):].split(":")
    tasks = [t.strip() for t in head.split(",") if t.strip()]
    if not tasks:
        raise ValueError(f"data file {name!r} names no task; write {USAGE}")
    spec = Spec(tasks)
    for option in options:
        key, eq, value = option.partition("=")
        if not eq:
            raise ValueError(f"data file {name!r}: {option!r} is not key=value; write {USAGE}")
        if key in ("size", "seed"):
            try:
                setattr(spec, key, int(value))
            except ValueError:
                raise ValueError(f"data file {name!r}: {key}={value!r} is not an integer") from None
        elif key == "system":
            spec.system = value
        elif "." in key and key.split(".", 1)[0] in tasks:
            task, setting = key.split(".", 1)
            try:
                parsed = json.loads(value)
            except ValueError:
                parsed = value
            spec.settings.setdefault(task, {})[setting] = parsed
        else:
            raise ValueError(f"data file {name!r}: unknown option {key!r} (size, seed, system, or TASK.setting for "
                             f"one of {tasks}); write {USAGE}")
    if spec.size < 1:
        raise ValueError(f"data file {name!r}: size={spec.size} must be >= 1")
    return spec


def rows(spec: Spec) -> list[dict]:
    """The rows of a spec, task by task; ValueError for a task or setting the library does not have."""
    rg = library()
    prompts = rg.utils.SYSTEM_PROMPTS
    if spec.system != "none" and spec.system not in prompts:
        raise ValueError(f"reasoning_gym system={spec.system!r} is not one of the library's system prompts "
                         f"{sorted(prompts)} (or none)")
    known = set(rg.factory.DATASETS)
    unknown = [t for t in spec.tasks if t not in known]
    if unknown:
        raise ValueError(f"reasoning_gym has no task {unknown}; its {len(known)} tasks include "
                         f"{sorted(known)[:12]} ... (python -c 'import reasoning_gym.factory as f; "
                         f"print(sorted(f.DATASETS))' lists them)")
    out = []
    for task in spec.tasks:
        settings = json.dumps(spec.settings.get(task, {}), sort_keys=True)
        try:
            ds = dataset(task, spec.seed, spec.size, settings)
        except (TypeError, ValueError, AssertionError) as e:  # the generator's config refuses a setting
            raise ValueError(f"reasoning_gym task {task} refuses the settings {settings}: {type(e).__name__}: {e}") \
                from None
        system = [] if spec.system == "none" else [{"role": "system", "content": prompts[spec.system]}]
        for index in range(spec.size):
            entry = ds[index]
            out.append({"prompt": system + [{"role": "user", "content": entry["question"]}],
                        "data_source": SOURCE_PREFIX + task,
                        "reward_model": {"ground_truth": "" if entry["answer"] is None else str(entry["answer"]),
                                         "style": "rule"},
                        "extra_info": {"index": len(out),
                                       "reasoning_gym": {"task": task, "seed": spec.seed, "size": spec.size,
                                                         "settings": settings, "index": index}}})
    return out


def build(name: str, root: str) -> str:
    """The JSON-lines file of a ``reasoning_gym:...`` name under ``root`` (written once, atomically)."""
    spec = parse(name)
    return written(root, "reasoning_gym", "+".join(spec.tasks), name, lambda: rows(spec))
