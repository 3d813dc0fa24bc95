"""A child process of a rank that serves an OpenEnv app (``env.app``) with uvicorn and ends when the rank ends, even
one killed without a chance to stop it (it watches its parent):

    python -m lib.envs.serve MODULE:APP PORT APP_DIR
"""

from __future__ import annotations

import os
import sys
import threading
import time


def watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main(argv: list[str]) -> None:
    import uvicorn

    target, port, app_dir = argv
    threading.Thread(target=watch_parent, args=(os.getppid(),), daemon=True).start()
    sys.path.insert(0, app_dir)
    # uvicorn's websockets implementation: its sans-I/O one logs a traceback for every session openenv-core closes
    uvicorn.run(target, host="127.0.0.1", port=int(port), log_level="warning", ws="websockets")


if __name__ == "__main__":
    main(sys.argv[1:])
