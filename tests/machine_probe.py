"""How fast this machine is now, in one line, before the tests run (test.sh): the test command's time varies with
the machine more than with the code (the same tests took 23.7 min one day and 68.2 min the next on the same kind of
2-core machine; docs/testing.md), so each run says what it ran on, and two runs' times can be compared.

    python tests/machine_probe.py

Three fixed workloads, each on one core: a pure-Python loop (the trainer's and the tests' host work), a float32
matmul loop in torch on one thread (the CPU runs' arithmetic), and ``import torch`` in a fresh interpreter (what every
rank, check and worker process pays at its start: most of a short run's time on a small machine). Also the CPU's
model, the cores and the load average when it ran. A few seconds in all."""

from __future__ import annotations

import os
import subprocess
import sys
import time


def python_loop_s(n: int = 5_000_000) -> float:
    start = time.perf_counter()
    total = 0
    for i in range(n):
        total += i & 7
    return time.perf_counter() - start


def matmul_s(size: int = 256, repeats: int = 200) -> float:
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a = torch.ones(size, size)
        torch.mm(a, a)
        start = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, a)
        return time.perf_counter() - start
    finally:
        torch.set_num_threads(threads)


def import_torch_s() -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import torch"], check=True)
    return time.perf_counter() - start


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def main() -> str:
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    line = (f"machine probe: {cpu_model()}, {os.cpu_count()} cores, load {load:.2f}; one core: python loop "
            f"{python_loop_s():.2f} s, torch matmul {matmul_s():.2f} s, import torch {import_torch_s():.2f} s")
    print(line, flush=True)
    return line


if __name__ == "__main__":
    main()
