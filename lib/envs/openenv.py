"""The client side of an OpenEnv server (openenv-core's HTTP environment servers), and a server the run starts.

An episode is one WebSocket session on the server's ``/ws``: the server makes an environment instance for the
connection and drops it when the connection closes (its HTTP ``/reset`` and ``/step`` make a fresh instance per call,
so they cannot hold an episode). Messages are JSON, ``{"type": "reset" | "step" | "close", "data": {...}}``; the
server answers ``{"type": "observation", "data": {"observation": {...}, "reward": r, "done": d}}`` or
``{"type": "error", "data": {"message": ..., "code": ...}}``. A reset's data are the environment's reset keyword
arguments (the server passes those its ``reset`` takes); a step's data are the action's fields.

A server holds one session at a time unless its environment declares concurrent sessions (and the app was made with
``max_concurrent_envs``); a refusal for capacity is retried like a dropped connection.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
INSTALL = "pip install -e '.[openenv]' (or pip install websockets)"


class EnvFailure(Exception):
    """An episode's environment failed: ``kind`` (connect, reset, step, timeout, capacity) and the message."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclass
class Result:
    """A reset's or a step's answer: the observation's fields, the reward (None: none given), done; ``messages``:
    the observation as chat messages already (a verifiers environment's turn, lib/envs/verifiers_play.py); ``cut``:
    done because the loop ended the exchange (its last turn marked), not by the environment's own end."""

    observation: dict
    reward: Any
    done: bool
    messages: list | None = None
    cut: bool = False


def ws_url(url: str) -> str:
    """http(s)://host:port[/prefix] -> ws(s)://host:port[/prefix]/ws."""
    parts = urlparse(url)
    if parts.scheme not in ("http", "https", "ws", "wss") or not parts.netloc:
        raise ValueError(f"env.url={url!r} is not an http(s) URL; give the OpenEnv server's base URL, e.g. "
                         f"http://127.0.0.1:8000")
    scheme = {"http": "ws", "https": "wss"}.get(parts.scheme, parts.scheme)
    path = parts.path.rstrip("/")
    return f"{scheme}://{parts.netloc}{path if path.endswith('/ws') else path + '/ws'}"


def websockets_client() -> Any:
    try:
        from websockets.sync import client
    except ImportError:
        raise ValueError(f"env.url / env.app need the websockets package, which is not installed: {INSTALL}") from None
    return client


class Session:
    """One episode's connection to the server (one environment instance on it)."""

    concludes = False  # the server ends its episodes itself: an episode the loop ends early needs no "end"

    def __init__(self, url: str, timeout_s: float):
        self.url, self.timeout_s = url, timeout_s
        host = urlparse(url).hostname or ""
        local = host in ("127.0.0.1", "localhost", "::1")
        try:
            self.ws = websockets_client().connect(url, open_timeout=timeout_s, max_size=None, compression=None,
                                                  **({"proxy": None} if local else {})).__enter__()
        except TimeoutError:
            raise EnvFailure("timeout", f"connecting to {url} took over {timeout_s:g} s") from None
        except Exception as e:  # noqa: BLE001 - refused, reset, a handshake the server rejected
            raise EnvFailure("connect", f"cannot connect to {url} ({type(e).__name__}: {e})") from None

    def send(self, kind: str, data: dict, last: bool = False) -> Result:
        """``last``: the loop's last turn of the episode (the server ends an episode itself: not sent)."""
        try:
            self.ws.send(json.dumps({"type": kind, "data": data}))
        except Exception:  # noqa: BLE001 - closed by the server: what it said before closing is read below
            pass
        try:
            raw = self.ws.recv(timeout=self.timeout_s)
        except TimeoutError:
            raise EnvFailure("timeout", f"{kind} got no answer within {self.timeout_s:g} s") from None
        except Exception as e:  # noqa: BLE001 - the connection dropped mid-episode
            raise EnvFailure("connect", f"{kind}: the connection to {self.url} dropped ({type(e).__name__}: {e})") \
                from None
        try:
            message = json.loads(raw)
            body = message.get("data") or {}
        except (ValueError, AttributeError):
            raise EnvFailure(kind, f"{kind}: the server answered something that is not an OpenEnv message: "
                                   f"{str(raw)[:200]!r}") from None
        if message.get("type") == "error":
            code = str(body.get("code", ""))
            what = "capacity" if "CAPACITY" in code.upper() else kind
            raise EnvFailure(what, f"{kind} raised on the server ({code}): {str(body.get('message', ''))[:300]}")
        if message.get("type") != "observation":
            raise EnvFailure(kind, f"{kind}: the server answered a {message.get('type')!r} message, not an "
                                   f"observation")
        observation = body.get("observation")
        return Result(observation if isinstance(observation, dict) else {}, body.get("reward"),
                      bool(body.get("done", False)))

    def close(self) -> None:
        """A close message, then the server closes the connection and drops the episode's instance (a client that
        closed first would leave the server's own close to fail, noisily, in its log)."""
        try:
            self.ws.send(json.dumps({"type": "close", "data": {}}))
            self.ws.recv(timeout=min(self.timeout_s, 5.0))
        except Exception:  # noqa: BLE001 - the server's close ends the connection: the expected way out
            pass
        try:
            self.ws.close()
        except Exception:  # noqa: BLE001 - already gone
            pass


def probe(url: str, timeout_s: float, tries: int, backoff_s: float) -> None:
    """One session opened and closed (retried ``tries`` times): a server that cannot be reached, or refuses
    sessions, is one clear error at start-up."""
    target = ws_url(url)
    failure = None
    for attempt in range(tries):
        if attempt:
            time.sleep(backoff_s * 2 ** (attempt - 1))
        try:
            Session(target, timeout_s).close()
            return
        except EnvFailure as e:
            failure = e
    raise ValueError(f"the OpenEnv server at {url} cannot be reached ({failure}; {tries} tries): check env.url and "
                     f"that the server is up (its /ws endpoint takes sessions)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def app_target(app: str) -> tuple[str, str, str]:
    """``env.app`` -> (module, attribute, the folder to import it from); ValueError for one that cannot be."""
    target, _, name = app.rpartition(":")
    if not target or not name:
        raise ValueError(f"env.app={app!r} must look like package.module:app or path/to/server.py:app")
    if target.endswith(".py"):
        if not os.path.isfile(target):
            raise ValueError(f"env.app: the file {target!r} does not exist")
        return os.path.basename(target)[:-3], name, os.path.dirname(os.path.abspath(target))
    return target, name, os.getcwd()


def check_app(app: str) -> None:
    """An env.app whose file or module cannot be found, or whose source binds no such name: one clear error before
    any rank starts (the server itself starts on each rank, later, and only then imports the module)."""
    module, name, folder = app_target(app)  # a file: it exists
    target = app.rpartition(":")[0]
    if target.endswith(".py"):
        source = target
    else:
        top = module.split(".")[0]
        if importlib.util.find_spec(top) is None and not any(os.path.exists(os.path.join(folder, top + end))
                                                             for end in ("", ".py")):
            raise ValueError(f"env.app {app}: no module {top!r} is installed or in {folder}; install "
                             f"the environment's package (pip install ...) or give path/to/server.py:app")
        source = module_source(module, folder)
    if source is not None and binds(open(source, encoding="utf-8").read(), name) is False:
        raise ValueError(f"env.app {app}: {source} defines no {name!r} at its top level; name the app it makes "
                         f"(module:app, e.g. app = create_app(...))")


def module_source(module: str, folder: str) -> str | None:
    """The Python source file of ``module`` as the server will import it (``folder`` first on its path), found
    without running it; None where there is none to read (a compiled module, a namespace package)."""
    base = os.path.join(folder, *module.split("."))
    for path in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(path):
            return path
    try:
        spec = importlib.util.find_spec(module)  # a dotted name imports its parent packages, not the module
    except (ImportError, ValueError):
        return None
    origin = getattr(spec, "origin", None)
    return origin if origin and origin.endswith(".py") and os.path.isfile(origin) else None


SCOPES = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)
"""Nodes whose bodies bind names of their own scope, not the module's."""


def binds(source: str, name: str) -> bool | None:
    """Whether a module's top level binds ``name`` (any name stored outside a function or class body: an assignment,
    a loop or with target, a walrus; a def or class, an import, an except or match capture, a ``global``): True,
    False, or None where reading cannot tell (a star import, a module ``__getattr__``, ``globals()`` or ``exec``).
    Lenient where unsure: a name a comprehension stores counts."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None  # the server's own import reports it, with its traceback in its log
    found = {n for node in ast.walk(tree) if isinstance(node, ast.Global) for n in node.names}
    unknown = False
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, SCOPES):  # its body is a scope of its own, not walked
            if not isinstance(node, ast.Lambda):
                found.add(node.name)
            continue
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            found.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            unknown |= any(alias.name == "*" for alias in node.names)
            found |= {alias.asname or alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, (ast.ExceptHandler, ast.MatchAs, ast.MatchStar)) and node.name:
            found.add(node.name)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("globals", "exec"):
            unknown = True
        todo += ast.iter_child_nodes(node)
    if name in found:
        return True
    return None if unknown or "__getattr__" in found else False


class LocalServer:
    """An OpenEnv app served by uvicorn in a child process on a free local port (``env.app``): ``module:app`` or
    ``path/to/file.py:app``. Its output goes to ``log``."""

    def __init__(self, app: str, log: str, start_timeout_s: float = 120.0):
        target, name, app_dir = app_target(app)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        os.makedirs(os.path.dirname(os.path.abspath(log)), exist_ok=True)
        self.log = log
        with open(log, "ab") as out:
            self.process = subprocess.Popen(  # lib/envs/serve.py: it ends with this process
                [sys.executable, "-m", "lib.envs.serve", f"{target}:{name}", str(self.port), app_dir],
                stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                env={**os.environ, "PYTHONUNBUFFERED": "1",
                     "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))})
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.process.poll() is not None:
                raise ValueError(f"env.app {app}: the server exited with code {self.process.returncode} before "
                                 f"taking connections; its output: {self.tail()}")
            try:
                Session(ws_url(self.url), 5.0).close()
                return
            except EnvFailure:
                if time.monotonic() > deadline:
                    self.close()
                    raise ValueError(f"env.app {app}: the server took no connection within {start_timeout_s:g} s; "
                                     f"its output: {self.tail()}") from None
                time.sleep(0.2)

    def tail(self, lines: int = 8) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return " | ".join(f.read().strip().splitlines()[-lines:]) or "(none)"
        except OSError:
            return "(none)"

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
