"""A judge model decoding in vLLM, in a child process of the rank (``judge.engine vllm``).

vLLM keeps one sleep-mode allocator per process (vLLM's ``CuMemAllocator`` is a process-wide singleton; its docs:
"sleep mode ... only one LLM instance per process"), so a second engine that sleeps cannot live beside the policy's
in the trainer's process. The judge's lives in a process of its own, started by the rank at start-up on the rank's
device, and answers over a socket pair:

    parent -> child                                   child -> parent
    {"op": "start", <the engine's arguments>}         {"ok": ..., "sleep_mode": bool}  (the weights loaded, asleep)
    {"op": "wake"} / {"op": "sleep"}                  {"ok": ...}                      (level 1: weights to host memory)
    {"op": "generate", prompts, caps, ...}            {"ok": ..., "turns": [(ids, stopped), ...]}
    {"op": "close"}                                   (exits)

An error in the child comes back as ``{"error": text}`` and is raised in the rank; a child that dies is an error
naming its exit code. The child ends when the rank closes it, and when the rank's end of the socket closes (the rank
died). Without sleep mode (vLLM's CPU build) sleep and wake only change what the rank's event log says.

With judge.tp_size > 1 the children of each tp_size consecutive ranks form a world of their own (``TPLayout``: vLLM's
external launcher, their own rendezvous port, their group's GPUs visible) and hold the judge together; their ranks
gather the group's prompts, every child generates them all (the same requests, so the same tokens), and each rank
keeps its own rows (lib/judges/local.py), as the policy's engine does with rollout.tp_size.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch.distributed as dist

from lib.dist import free_port
from lib.engine import Turn, awake, call_seed, request_seeds
from lib.engine.vllm_adapter import SHM_PREFIX, name_cpu_shm

# what torchrun gives a rank: the child is a process of its own, one device, no process group
RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
            "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT",
            "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_USE_AGENT_STORE", "TORCH_NCCL_ASYNC_ERROR_HANDLING")
START_TIMEOUT_S = 1800.0


@dataclass
class TPLayout:
    """The world the children of one judge TP group form: this child's rank in it, its size, the rendezvous port
    (the group's first rank picked it), the group's GPUs (physical indices, in rank order; none on CPU) and the name
    of vLLM's CPU shared-memory segments for it (lib.engine.vllm.name_cpu_shm)."""

    rank: int
    size: int
    port: int
    devices: list[str]
    shm_prefix: str


def tp_layout(size: int, device: Any) -> tuple[Any, TPLayout]:
    """World collective: the judge TP groups of ``size`` consecutive ranks (each a gloo group of the ranks, for the
    prompts they gather) and this rank's child's layout in its group."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group(list(range(start, start + size)), backend="gloo") for start in range(0, world, size)]
    lead = rank - rank % size
    known: list[Any] = [None] * world  # the group's rendezvous port is its first rank's pick
    dist.all_gather_object(known, (free_port() if rank == lead else 0, physical_device(device), os.getpid()))
    members = known[lead:lead + size]
    return groups[rank // size], TPLayout(rank % size, size, members[0][0], [m[1] for m in members],
                                          f"{SHM_PREFIX}-{members[0][2]}-judge")


def physical_device(device: Any) -> str:
    """The physical index of the rank's GPU (read through the rank's CUDA_VISIBLE_DEVICES); "" on CPU."""
    if device.type != "cuda":
        return ""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    index = device.index or 0
    return visible.split(",")[index] if visible else str(index)


def child_env(device: Any, tp: TPLayout | None = None) -> dict[str, str]:
    """The rank's environment for its judge's child: the torchrun variables removed, the rank's own GPU the only one
    visible, vLLM's engine in the child's process (the sleep-mode allocator is then the child's). ``tp``: the world
    of the group's children instead (their ranks and rendezvous, the group's GPUs visible, this child's by its
    rank)."""
    env = {k: v for k, v in os.environ.items() if k not in RANK_ENV}
    env["CUDA_VISIBLE_DEVICES"] = physical_device(device)
    if tp is not None:
        env.update({"RANK": str(tp.rank), "LOCAL_RANK": str(tp.rank), "WORLD_SIZE": str(tp.size),
                    "LOCAL_WORLD_SIZE": str(tp.size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(tp.port)})
        if device.type == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = ",".join(tp.devices)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    env.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # the rank's output stays its own; the child's errors are raised
    return env


class ChildEngine:
    """The judge's engine in a child process: ``wake_up``, ``sleep`` and ``generate_ids`` as an engine of this process
    has them (lib/judges/local.py takes turns with it exactly as with the HF engine)."""

    def __init__(self, name: str, device: Any, spec: dict, seed: int = 0, tp: TPLayout | None = None):
        """Start the child on ``device`` (its output goes to the rank's) and build the engine of ``spec`` there
        (``engine_args``: vLLM's arguments; ``eos``: the stop ids; ``temperature``; ``schema``: a JSON schema every
        verdict is decoded into, or None; ``shm_prefix``: a TP group's name for its CPU segments); returns once its
        weights are loaded and it sleeps. ``tp``: the child is one of its TP group's world (every rank of the group
        starts its own at the same time)."""
        self.name, self.device, self.seed, self.level = name, device, seed, 1
        mine, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "lib.judges.vllm_child", str(theirs.fileno())],
                                         pass_fds=[theirs.fileno()], env=child_env(device, tp),
                                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
        finally:
            theirs.close()
        self.conn = Connection(mine.detach())
        self._ask({"op": "start", **spec}, START_TIMEOUT_S)

    def _ask(self, message: dict, timeout_s: float = 3600.0) -> dict:
        try:
            self.conn.send(message)
        except OSError:
            pass  # the child is gone: said below, with its exit code
        deadline = time.monotonic() + timeout_s
        while not self.conn.poll(0.2):
            code = self.proc.poll()
            if code is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the judge's vLLM child process (pid {self.proc.pid}) "
                                   f"{'exited with code ' + str(code) if code is not None else 'did not answer'} "
                                   f"during {message['op']!r}; its output is above (or in the run's logs)")
        try:
            reply = self.conn.recv()
        except (EOFError, OSError):
            raise RuntimeError(f"the judge's vLLM child process (pid {self.proc.pid}) closed its end during "
                               f"{message['op']!r} (exit code {self.proc.wait()})") from None
        if "error" in reply:
            raise RuntimeError(f"the judge's vLLM engine failed during {message['op']!r}: {reply['error']}")
        return reply

    def wake_up(self, tags: Any = ("weights", "kv_cache")) -> None:
        if self.level:
            self._ask({"op": "wake"})
            self.level = 0
            awake.woke(self.name)

    def sleep(self, level: int = 1) -> None:
        """Level 1 whatever is asked: the weights are the folder's and stay in host memory (a level 2 would read
        them again)."""
        if not self.level:
            self._ask({"op": "sleep"})
            self.level = 1
            awake.slept(self.name)

    def generate_ids(self, prompts: list[list[int]], max_tokens: list[int], validate: bool, key: Any,
                     media: Any = None) -> list[Turn]:
        if self.level:
            raise RuntimeError("generate on a sleeping engine: call wake_up() first")
        seeds = request_seeds(call_seed(self.seed, 0, validate, key), len(prompts))
        reply = self._ask({"op": "generate", "prompts": prompts, "caps": max_tokens, "seeds": seeds})
        return [Turn(list(ids), [0.0] * len(ids), bool(stopped)) for ids, stopped in reply["turns"]]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.conn.send({"op": "close"})
            except OSError:
                pass
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.conn.close()


def _serve(conn: Connection) -> None:
    from vllm import LLM, SamplingParams
    from vllm.platforms import current_platform

    spec = conn.recv()
    if spec.get("shm_prefix"):  # a TP group on CPU: its segments named after the launch, apart from the policy's
        name_cpu_shm(spec["shm_prefix"])
    sleep_mode = current_platform.is_sleep_mode_available()
    guided, structured = {}, {}
    if spec.get("schema") is not None:  # JSON verdicts, written without the runs of whitespace a grammar allows
        from vllm.sampling_params import StructuredOutputsParams

        guided = {"structured_outputs": StructuredOutputsParams(json=spec["schema"])}
        structured = {"structured_outputs_config": {"backend": "xgrammar", "disable_any_whitespace": True}}
    llm = LLM(**spec["engine_args"], **structured, enable_sleep_mode=sleep_mode)
    if sleep_mode:
        llm.sleep(level=1)
    conn.send({"ok": True})
    while True:
        try:
            msg = conn.recv()
        except EOFError:  # the rank is gone
            return
        try:
            if msg["op"] == "close":
                return
            if msg["op"] == "wake":
                if sleep_mode:
                    llm.wake_up()
                    llm.reset_prefix_cache()
                conn.send({"ok": True})
            elif msg["op"] == "sleep":
                if sleep_mode:
                    llm.sleep(level=1)
                conn.send({"ok": True})
            elif msg["op"] == "generate":
                t = spec["temperature"]
                params = [SamplingParams(n=1, temperature=t, max_tokens=cap, stop_token_ids=spec["eos"],
                                         detokenize=False, seed=seed if t else None, **guided)
                          for cap, seed in zip(msg["caps"], msg["seeds"])]
                outs = llm.generate([{"prompt_token_ids": p} for p in msg["prompts"]], params, use_tqdm=False)
                conn.send({"ok": True, "turns": [(list(o.outputs[0].token_ids), o.outputs[0].finish_reason == "stop")
                                                 for o in outs]})
            else:
                conn.send({"error": f"unknown op {msg['op']!r}"})
        except Exception as e:  # noqa: BLE001 - said to the rank, which raises it
            conn.send({"error": f"{type(e).__name__}: {e}"})


def main(argv: list[str]) -> None:
    conn = Connection(int(argv[0]))
    try:
        _serve(conn)
    except Exception as e:  # noqa: BLE001 - a failed start: said to the rank, which raises it
        try:
            conn.send({"error": f"{type(e).__name__}: {e}"})
        except OSError:
            pass
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
