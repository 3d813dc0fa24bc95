"""Rows made from a name (a task library's, an environment's), written once as JSON lines under the output root."""

from __future__ import annotations

import hashlib
import json
import os
from typing import Callable


def written(root: str, folder: str, stem: str, name: str, make: Callable[[], list[dict]]) -> str:
    """``root/folder/stem-<hash of name>.jsonl``, written (atomically) from ``make()`` the first time."""
    digest = hashlib.sha1(name.encode()).hexdigest()[:12]
    path = os.path.join(root, folder, f"{stem[:60]}-{digest}.jsonl")
    if os.path.isfile(path):
        return path
    made = make()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        for row in made:
            f.write(json.dumps(row) + "\n")
    os.replace(tmp, path)
    return path
