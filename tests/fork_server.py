"""A warm parent for tests/forked_torchrun.py: one interpreter that has imported the training scripts forks each launch,
so that a launch no longer pays the imports (~6 CPU-s on the 2-core machine: torch, transformers, lib) before its
ranks fork. Opt-in: with ``FORK_SERVER_DIR`` set, ``python tests/forked_torchrun.py ARGS`` hands its command line, its
working folder, its environment and its standard streams to the server for that environment (started on first use,
one a distinct environment, folder and state of the code, so that whatever a library reads from the environment at
import is what the launch set; its socket in Linux's abstract namespace), and the server forks a child that runs the
launch on those streams.

The launch's process stays what the test started: a thin client (standard library only) that relays the signals a test
sends it (TERM, INT, HUP, QUIT, USR1, USR2) to the child, and exits with the child's status (its exit code, or the
signal that ended it, raised on itself). A client killed outright (SIGKILL) closes its socket, and the child ends its
session (the launch's agent and ranks) at once. The server ends after ``IDLE_S`` with nothing to serve.

    FORK_SERVER_DIR=/tmp/fs python tests/forked_torchrun.py --standalone --nnodes 1 --nproc-per-node 2 train_grpo.py
"""

from __future__ import annotations

import array
import fcntl
import hashlib
import json
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

IDLE_S = 60.0
RELAYED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


OWN = ("PYTEST_CURRENT_TEST",)
"""Variables a launch's environment may differ in from its server's (pytest sets this one a test): the child gets the
launch's own values."""


def _code_stamp() -> float:
    """The scripts' and lib's newest modification: a server never runs code older than the tree's."""
    newest = 0.0
    for folder in ("lib", "tests"):
        for dirpath, _, names in os.walk(os.path.join(ROOT, folder)):
            newest = max([newest, *(os.stat(os.path.join(dirpath, n)).st_mtime for n in names if n.endswith(".py"))])
    for name in ("train_grpo.py", "train_ppo.py"):
        newest = max(newest, os.stat(os.path.join(ROOT, name)).st_mtime)
    return newest


def address(env: dict, cwd: str) -> str:
    """Where the server for this environment (but OWN), folder, interpreter and code keeps its lock and log (``.lock``,
    ``.log`` beside this path); its socket is ``_socket_name`` of it."""
    key = json.dumps([sys.executable, cwd, sorted((k, v) for k, v in env.items() if k not in OWN), _code_stamp()])
    return os.path.join(env["FORK_SERVER_DIR"], hashlib.sha256(key.encode()).hexdigest()[:20])


def _socket_name(path: str) -> str:
    """The server's socket: in Linux's abstract namespace (no file, no length limit from the folder's path, gone with
    the server)."""
    return "\0spmd-fork-server-" + hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:40]


def _read_line(conn: socket.socket) -> str:
    """One line from ``conn`` ("" where it closed first)."""
    out = b""
    while not out.endswith(b"\n"):
        part = conn.recv(1)
        if not part:
            return ""
        out += part
    return out.decode().strip()


# -- the client: the process the test started --------------------------------------------------------------------

def _connect(path: str) -> socket.socket | None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect(_socket_name(path))
        return conn
    except OSError:
        conn.close()
        return None


def _server(path: str) -> socket.socket | None:
    """A connection to the server at ``path``, started here where none answers (under a lock: one a path); None
    where it could not start (its log says why)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        conn = _connect(path)
        if conn is not None:
            return conn
        with open(path + ".log", "a") as log:
            server = subprocess.Popen([sys.executable, os.path.abspath(__file__), path], stdin=subprocess.DEVNULL,
                                      stdout=log, stderr=log, start_new_session=True)
        while server.poll() is None:  # a state: the server listens (after its imports), or it ended
            conn = _connect(path)
            if conn is not None:
                return conn
            time.sleep(0.05)
        return None


def launch(argv: list[str]) -> None:
    """Runs ``argv`` (forked_torchrun.py's arguments) in a child of the server and exits with its status; returns
    where no server could take it (the caller then launches in this process)."""
    if not sys.platform.startswith("linux") or sys.warnoptions or sys._xoptions or sys.flags.optimize:
        return  # the socket is Linux's (abstract namespace); a server runs without the interpreter's options
    env, cwd = dict(os.environ), os.getcwd()
    path = address(env, cwd)
    for _ in range(3):  # a server that ended while this one connected: the next start serves
        conn = _server(path)
        if conn is None:
            return
        request = json.dumps({"argv": argv, "cwd": cwd, "env": env}).encode()
        try:
            sent = conn.sendmsg([len(request).to_bytes(8, "big")],
                                [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
            if sent != 8:
                raise OSError("the request's head was cut short")
            conn.sendall(request)
            ack = _read_line(conn)
        except OSError:
            ack = ""
        if ack.startswith("P"):
            break
        conn.close()
    else:
        return

    def relay(n: int, _frame) -> None:
        try:
            conn.sendall(f"S{n}\n".encode())
        except OSError:
            pass  # the child ended meanwhile: its status follows

    for sig in RELAYED:
        signal.signal(sig, relay)
    status = _read_line(conn)
    if status.startswith("K"):  # ended by a signal: so does this process
        sig = int(status[1:])
        if sig not in (signal.SIGKILL, signal.SIGSTOP):  # (those two cannot be handled, nor their handling reset)
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
        raise SystemExit(128 + sig)
    raise SystemExit(int(status[1:]) if status.startswith("X") else 1)


# -- the server ------------------------------------------------------------------------------------------------

def _child(conn: socket.socket, request: dict, fds: list[int]) -> None:
    """The forked child: the client's streams, folder, environment and command line, then the launch."""
    os.setsid()  # its own session: the agent and the ranks it forks end together where the client is gone
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for sig in RELAYED:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [os.path.join(ROOT, "tests", "forked_torchrun.py"), *request["argv"]]

    def relay() -> None:
        while True:
            line = _read_line(conn)
            if not line:  # the client is gone: so is this launch
                os.killpg(0, signal.SIGKILL)
            os.kill(os.getpid(), int(line[1:]))

    threading.Thread(target=relay, daemon=True).start()
    from tests import forked_torchrun

    code = 0
    try:
        forked_torchrun.main(request["argv"])
    except SystemExit as e:  # as the interpreter ends on it: a message to stderr and 1, a number, or 0
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except KeyboardInterrupt:  # as the interpreter ends on it: by SIGINT
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 - what an uncaught error does to a script
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _receive(conn: socket.socket) -> tuple[dict, list[int]]:
    """A request and its three streams (closed here where the request is not whole)."""
    fds = array.array("i")
    head, ancillary, _, _ = conn.recvmsg(8, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[:len(data) - len(data) % fds.itemsize])
    try:
        size, body = int.from_bytes(head, "big"), b""
        while len(body) < size:
            part = conn.recv(size - len(body))
            if not part:
                raise ConnectionError("the request was cut short")
            body += part
        if len(head) != 8 or len(fds) != 3:
            raise ConnectionError(f"a request of {len(head)} head bytes and {len(fds)} streams")
        return json.loads(body), list(fds)
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def serve(path: str) -> None:
    """Imports the launcher's scripts once, then forks a child a request, and tells each client how its child ended;
    ends after IDLE_S with no request and no child."""
    sys.path.insert(0, ROOT)
    from tests import forked_torchrun  # noqa: F401 - the imports every child inherits

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(_socket_name(path))
    listener.listen(16)
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    children: dict[int, socket.socket] = {}
    last = time.monotonic()
    served = 0
    while children or time.monotonic() - last < IDLE_S:
        if selector.select(timeout=0.2):
            conn, _ = listener.accept()
            try:
                request, fds = _receive(conn)
            except (OSError, ValueError) as e:
                print(f"a request refused: {e}", flush=True)
                conn.close()
                continue
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                selector.close()
                listener.close()
                for other in children.values():
                    other.close()
                _child(conn, request, fds)
            for fd in fds:
                os.close(fd)
            try:
                conn.sendall(f"P{pid}\n".encode())
            except OSError:
                pass  # the client is gone: the child sees its socket closed and ends
            children[pid] = conn
            served += 1
            last = time.monotonic()
            print(f"launch {served}: pid {pid}: {' '.join(request['argv'])[:300]}", flush=True)
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            conn = children.pop(pid, None)
            if conn is None:
                continue
            end = f"K{os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else f"X{os.waitstatus_to_exitcode(status)}"
            try:
                conn.sendall(f"{end}\n".encode())
            except OSError:
                pass  # the client is gone
            conn.close()
            last = time.monotonic()
    with open(path + ".lock", "w") as lock:  # where clients look for a server: none from now
        fcntl.flock(lock, fcntl.LOCK_EX)
        listener.close()
    print(f"idle for {IDLE_S:.0f} s after {served} launches: ended", flush=True)


if __name__ == "__main__":
    serve(sys.argv[1])
