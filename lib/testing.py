"""Run a function on N gloo ranks in fresh processes, for tests and benches.

``run_distributed(fn, world_size=2)`` starts N processes, sets the torchrun environment, starts a gloo
process group, calls ``fn(*args)`` on every rank and returns the per-rank results. A rank that raises
has its traceback shown; ranks that hang (a mismatched collective, usually) are killed at the timeout.
``fn`` must be a module-level function (it is imported by file path in the child).

The ranks are forked from a server process that has imported torch, transformers and the trainer's modules once
(multiprocessing's forkserver, PRELOAD): a spawned rank spent ~5 s of a core importing them, every call. The server
imports only (no CUDA, no threads started), so each rank is as fresh as a spawned one: the caller's environment,
working folder and import path are set in it before ``fn`` runs, and what the caller's process changed in its own
modules (a monkeypatch) does not reach it.
"""

from __future__ import annotations

import importlib.util
import multiprocessing as mp
import os
import pickle
import queue
import sys
import time
import traceback
from multiprocessing import forkserver
from typing import Any, Callable

from lib.dist import free_port

PRELOAD = ["lib.startup", "lib.testing"]
"""What the server the ranks are forked from imports once: lib.startup brings torch, transformers and the rest of
the trainer."""
_CONTEXT: Any = None


def _context() -> Any:
    """The forkserver context, its server started now: with PYTORCH_NVML_BASED_CUDA_CHECK=1 in its environment, so
    that a CUDA query made while importing (torch.cuda.is_available() starts the driver otherwise) leaves the
    ranks forked from it free to start CUDA themselves; they run under the caller's environment (_worker)."""
    global _CONTEXT
    if _CONTEXT is None:
        context = mp.get_context("forkserver")
        context.set_forkserver_preload(PRELOAD)
        saved = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
        os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
        try:
            forkserver.ensure_running()
        finally:
            if saved is None:
                del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
            else:
                os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = saved
        _CONTEXT = context
    return _CONTEXT


def _load(path: str, module: str, qualname: str) -> Callable:
    mod = sys.modules.get(module)
    if mod is None or getattr(mod, "__file__", None) != path:
        spec = importlib.util.spec_from_file_location(module, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[module] = mod
        spec.loader.exec_module(mod)
    obj: Any = mod
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _worker(rank: int, world: int, port: int, target: tuple[str, str, str], args: tuple, results: Any,
            backend: str, caller: tuple[dict, str, list]) -> None:
    env, cwd, path = caller  # the caller's, as a spawned child would have them
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.path[:] = path
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # N ranks share a small CPU; oversubscription makes gloo tests crawl
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group("cpu:gloo,cuda:nccl" if backend == "nccl" else backend)
        ok = False
        try:
            # plain pickle bytes: torch's queue pickler would share tensors by file descriptor, gone when we exit
            results.put((rank, "ok", pickle.dumps(_load(*target)(*args)), 0.0))
            ok = True
        except BaseException:  # noqa: BLE001 - the parent shows it
            # Report before the group is torn down: that teardown is what makes the other ranks fail.
            results.put((rank, "error", traceback.format_exc(), time.time()))
        if dist.is_initialized():  # a vLLM engine's close() tears down the default group itself
            if ok:  # every rank done first: rank 0 hosts the store, and a rank still making a group of its own (a
                # mesh axis of size 1) failed with "Broken pipe" once rank 0 had finished and left (seen under load)
                dist.barrier()
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - before the body ran: the rendezvous, not the test, failed
        results.put((rank, "setup_error", traceback.format_exc(), time.time()))


class _SetupFailed(AssertionError):
    pass


def run_distributed(fn: Callable, *args: Any, world_size: int = 2, timeout: float = 180.0,
                    backend: str = "gloo") -> list[Any]:
    """``fn(*args)`` on ``world_size`` ranks (gloo, or nccl with one GPU per rank); returns
    ``[result of rank 0, rank 1, ...]``. A failure to start the process group (a port taken between our
    pick and the bind, say) is retried once on a new port; failures of ``fn`` never are."""
    try:
        return _run_once(fn, args, world_size, timeout, backend)
    except _SetupFailed:
        return _run_once(fn, args, world_size, timeout, backend)


def _run_once(fn: Callable, args: tuple, world_size: int, timeout: float, backend: str) -> list[Any]:
    target = (os.path.abspath(sys.modules[fn.__module__].__file__), fn.__module__, fn.__qualname__)
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    caller = (dict(os.environ), os.getcwd(), list(sys.path))
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, target, args, results, backend, caller),
                         daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    outputs: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outputs) + len(errors) < world_size:
            # After one rank fails the others usually wait in a collective forever: give them a moment only.
            wait = min(deadline, time.monotonic() + 10) if errors else deadline
            try:  # wake every few seconds: ranks that died without reporting (killed, os._exit) end the wait
                rank, status, payload, when = results.get(timeout=max(0.1, min(wait - time.monotonic(), 5.0)))
            except queue.Empty:
                if errors or time.monotonic() >= deadline:
                    break
                if not any(p.is_alive() for p in procs) and results.empty():
                    break
                continue
            if status == "ok":
                outputs[rank] = pickle.loads(payload)
            else:
                errors[rank] = (when, payload, status)
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        rank = min(errors, key=lambda r: errors[r][0])  # the first to fail is the cause, usually
        others = f" (then also ranks {sorted(set(errors) - {rank})})" if len(errors) > 1 else ""
        kind = _SetupFailed if errors[rank][2] == "setup_error" else AssertionError
        raise kind(f"rank {rank} of {world_size} failed{others}:\n{errors[rank][1]}")
    missing = [r for r in range(world_size) if r not in outputs]
    if missing:
        codes = {r: procs[r].exitcode for r in missing}
        if time.monotonic() < deadline:  # every rank gone before the deadline: none hung, some died unreported
            raise AssertionError(f"ranks {missing} of {world_size} exited without a result (exit codes {codes}): "
                                 f"killed, or os._exit before returning")
        raise AssertionError(f"ranks {missing} of {world_size} did not finish within {timeout:.0f}s "
                             f"(exit codes {codes}); a collective is probably mismatched")
    return [outputs[r] for r in range(world_size)]
