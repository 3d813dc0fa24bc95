"""``python -m lib.view RUN_DIR``: the run's viewer, a local page to open in a browser (docs/viewer.md)."""

from __future__ import annotations

import argparse
import os

try:
    from lib.view.page import serve
except ModuleNotFoundError as e:  # the view extra not installed: said once the arguments are read
    if e.name != "nicegui":
        raise
    serve = None


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m lib.view", description="A run's curves and samples in the browser: "
                                "a finished run, one in progress (its new steps appear) or one copied from a cluster.")
    p.add_argument("run", help="the run folder (runs/<name>); one not made yet is waited for")
    p.add_argument("--host", default="127.0.0.1", help="0.0.0.0 to open it from another machine")
    p.add_argument("--port", type=int, default=8080)
    a = p.parse_args(argv)
    run = os.path.abspath(a.run)
    if not os.path.isdir(run) and not os.path.isdir(os.path.dirname(run)):
        raise SystemExit(f"error: {a.run} is no run folder, nor is its parent: point lib.view at runs/<name>")
    if serve is None:
        raise SystemExit("error: the viewer needs nicegui: pip install -e '.[view]' (bash test.sh adds it to .venv)")
    print(f"viewer of {run}: open http://{a.host}:{a.port}/ in a browser (Ctrl-C stops it)", flush=True)
    serve(run, a.host, a.port)


if __name__ == "__main__":
    main()
