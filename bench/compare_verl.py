"""Our DataProto and RL math against verl 0.9.1's on the same inputs, side by side.

    python bench/compare_verl.py [--rows 4096] [--tokens 2048] [--batch 16384] [--n 16] [--env .bench_envs/verl]

verl runs in its own throw-away environment (made on first use under --env: torch as ours, verl 0.9.1 without its
dependencies, then only what verl.protocol and core_algos import; ray, the heavy distributed dependency, is a
stub module there, since neither path calls it). Prints:
1. DataProto ops on rows x tokens (8 tensor fields, 3 object fields): median ms each side, the ratio, and GB/s for
   the ops that copy, against the machine's torch.cat speed on the same bytes.
2. GRPO and RLOO advantages at B sequences in groups of n: ms each side, and the largest difference.
3. Karmarkar-Karp into 8 and 64 equal-size parts of 1024 lengths: ms, and the largest part over the ideal.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
import shared_cases as cases  # noqa: E402
from lib import algos  # noqa: E402
from lib.balance import karmarkar_karp  # noqa: E402
from lib.protocol import DataProto  # noqa: E402

VERL = "verl==0.9.1"
# what verl.protocol and verl.trainer.ppo.core_algos import (verl's own pins where it has them)
VERL_IMPORTS = ["numpy", "tensordict", "omegaconf", "packaging", "codetiming", "orjson",
                "transformers>=5.5.3,<5.11,!=5.6.0"]
RAY_STUB = '''"""Stand-in for ray in the comparison environment: verl.protocol imports it, the compared code never calls it."""
class ObjectRef: pass
def get(x): return x
def put(x): return x
def remote(*args, **kwargs): return args[0] if args and callable(args[0]) else (lambda f: f)
'''


def ensure_env(path: str) -> str:
    python = os.path.join(path, "bin", "python")
    if os.path.isfile(os.path.join(path, ".ready")):
        return python
    print(f"making the verl environment in {path} (once) ...", file=sys.stderr, flush=True)
    subprocess.run([sys.executable, "-m", "venv", path], check=True)
    pip = [python, "-m", "pip", "install", "-q"]
    subprocess.run(pip + [f"torch=={torch.__version__.split('+')[0]}", *VERL_IMPORTS], check=True)
    subprocess.run(pip + ["--no-deps", VERL], check=True)
    site = subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    os.makedirs(os.path.join(site, "ray"), exist_ok=True)
    with open(os.path.join(site, "ray", "__init__.py"), "w") as f:
        f.write(RAY_STUB)
    open(os.path.join(path, ".ready"), "w").close()
    return python


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=4096)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=16384)
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--env", default=os.path.join(ROOT, ".bench_envs", "verl"))
    ap.add_argument("--protocol-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.protocol_only:  # our side of 1., in a fresh process as verl's is (allocator state matters to copies)
        print(json.dumps(cases.protocol_ops(DataProto, args.rows, args.tokens)))
        return
    python = ensure_env(args.env)
    x = cases.advantage_inputs(args.batch, args.n)
    with tempfile.TemporaryDirectory() as tmp:
        torch.save(x, f"{tmp}/in.pt")
        run = subprocess.run([python, os.path.join(HERE, "verl_side.py"), f"{tmp}/in.pt", f"{tmp}/out.pt",
                              str(args.rows), str(args.tokens)], capture_output=True, text=True)
        if run.returncode:
            raise SystemExit(f"verl side failed:\n{run.stderr[-3000:]}")
        theirs = json.loads(run.stdout.strip().splitlines()[-1])
        their_adv = torch.load(f"{tmp}/out.pt", weights_only=False)
    mine = subprocess.run([sys.executable, __file__, "--protocol-only", "--rows", str(args.rows), "--tokens",
                           str(args.tokens)], capture_output=True, text=True, check=True)
    ours = {"protocol": json.loads(mine.stdout.strip().splitlines()[-1])}
    copy_speed = cases.memcpy_gbs(args.rows, args.tokens)

    print(f"1. DataProto, {args.rows} x {args.tokens} (8 tensor fields, {args.rows * args.tokens * (4 * 8 + 4 * 4) / 1e9:.2f} GB), "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs; torch.cat of the same bytes: {copy_speed:.1f} GB/s")
    print(f"{'op':<30}{'ours ms':>10}{'verl ms':>10}{'ours/verl':>11}{'ours GB/s':>11}{'verl GB/s':>11}")
    for name, (ms, gb) in ours["protocol"].items():
        vms, _ = theirs["protocol"][name]
        speed = lambda t: f"{gb / (t / 1e3):>11.1f}" if gb else f"{'view':>11}"  # noqa: E731
        print(f"{name:<30}{ms:>10.3f}{vms:>10.3f}{ms / vms:>11.2f}{speed(ms)}{speed(vms)}")

    print(f"\n2. advantages, B={args.batch} in groups of {args.n}, response width 64")
    print(f"{'estimator':<12}{'ours ms':>10}{'verl ms':>10}{'ours/verl':>11}{'max |diff|':>12}")
    for name, fn in (("grpo", lambda: algos.grpo(x["rewards"], x["mask"], x["index"])),
                     ("rloo", lambda: algos.rloo(x["rewards"], x["mask"], x["index"]))):
        (adv, _), ms = cases.timed(fn)
        diff = float((adv - their_adv[name]).abs().max())
        print(f"{name:<12}{ms:>10.2f}{theirs[f'{name}_ms']:>10.2f}{ms / theirs[f'{name}_ms']:>11.2f}{diff:>12.2e}")

    weights = cases.partition_inputs()
    print(f"\n3. Karmarkar-Karp, {len(weights)} lengths in [16, 8192), equal-size parts")
    print(f"{'parts':<8}{'ours ms':>10}{'verl ms':>10}{'ours max/ideal':>16}{'verl max/ideal':>16}")
    for k in (8, 64):
        parts, ms = cases.timed(lambda: karmarkar_karp(weights, k, equal_size=True))
        vms, vq = theirs[f"kk{k}"]
        print(f"{k:<8}{ms:>10.2f}{vms:>10.2f}{cases.partition_quality(weights, parts):>16.5f}{vq:>16.5f}")


if __name__ == "__main__":
    main()
