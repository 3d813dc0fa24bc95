"""Rank balancing: bytes each rank receives and its peak extra memory, all-gather (the whole batch to every rank,
then a selection: the former lib.balance.balance_groups) against all-to-all (lib.dist.reshard: only the rows that
change rank move), at 2, 4 and 8 gloo ranks, in the same run.

    python bench/bench_balance.py [--ranks 2 4 8] [--rows 128] [--prompt 512] [--response 1536]

Each rank holds ``rows`` samples (groups of 8) with the rollout stage's fields (int64 ids, masks and positions
over prompt + response, float32 per-token fields over the response) plus object fields. Bytes received: the
output buffers of the collectives (counted by wrapping them). Peak extra memory: the rise of the rank's peak RSS
across the call, each method in a fresh launch.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile

import numpy as np
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def make_batch(rank: int, rows: int, prompt: int, response: int):
    from lib.protocol import DataProto

    g = torch.Generator().manual_seed(rank)
    total = prompt + response
    lengths = torch.randint(prompt // 4, total, (rows,), generator=g)
    ids = torch.randint(0, 32000, (rows, total), generator=g)
    mask = (torch.arange(total)[None] < lengths[:, None]).long()
    per_token = {k: torch.randn(rows, response, generator=g) for k in
                 ("response_mask", "rollout_log_probs", "old_log_probs", "ref_log_prob", "token_level_scores")}
    fields = {"input_ids": ids, "attention_mask": mask, "position_ids": mask.cumsum(1), "prompts": ids[:, :prompt],
              "responses": ids[:, prompt:], **per_token}
    objects = {"uid": [f"{rank}-{i // 8}" for i in range(rows)], "data_source": ["gsm8k"] * rows,
               "raw_prompt": ["x" * 400] * rows}
    return DataProto.from_dict(fields, objects)


def worker(method: str, rows: int, prompt: int, response: int, out_path: str) -> None:
    from lib import balance
    from lib.dist import all_gather, init_topology, reshard

    topo = init_topology()
    data = make_batch(topo.rank, rows, prompt, response)
    received = [0]

    def counting(fn, out_arg):
        def wrapped(*args, **kwargs):
            out = args[out_arg] if len(args) > out_arg else kwargs.get("output_tensor_list", kwargs.get("output"))
            tensors = out if isinstance(out, (list, tuple)) else [out]
            received[0] += sum(t.numel() * t.element_size() for t in tensors)
            return fn(*args, **kwargs)
        return wrapped

    dist.all_gather = counting(dist.all_gather, 0)
    dist.all_to_all_single = counting(dist.all_to_all_single, 0)
    if method == "all_gather":  # the former balance_groups: everything to everyone, then keep this rank's rows
        def old_reshard(d, assignment, group=None, pad_values=None):
            return all_gather(d, group, pad_values).select_idxs(np.asarray(assignment[dist.get_rank(group)]))
        balance.reshard = old_reshard
    else:
        balance.reshard = reshard
    dist.barrier()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out, _ = balance.balance_groups(data)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    rows_out = (len(out), int(out.batch["input_ids"].sum()), float(out.batch["old_log_probs"].sum()),
                list(out.non_tensor_batch["uid"]))  # what the rank got: the same either way
    stats = [None] * topo.world_size
    dist.all_gather_object(stats, (received[0], peak * 1024, rows_out))
    if topo.rank == 0:
        with open(out_path, "w") as f:
            json.dump(stats, f)
    dist.destroy_process_group()


def launch(ranks: int, method: str, args) -> list:
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        path = f.name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
           __file__, "--worker", method, "--rows", str(args.rows), "--prompt", str(args.prompt), "--response",
           str(args.response), "--out", path]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    subprocess.run(cmd, check=True, env=env, cwd=ROOT, capture_output=True)
    with open(path) as f:
        return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--response", type=int, default=1536)
    p.add_argument("--worker", default="")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.worker:
        return worker(args.worker, args.rows, args.prompt, args.response, args.out)
    mib = 2**20
    print(f"{args.rows} samples per rank of {args.prompt} + {args.response} tokens; per rank: max over ranks")
    print(f"{'ranks':>5} | {'all-gather MiB recv':>19} | {'all-to-all MiB recv':>19} | {'ratio':>5} | "
          f"{'all-gather peak MiB':>19} | {'all-to-all peak MiB':>19} | {'ratio':>5}")
    for ranks in args.ranks:
        old, new = launch(ranks, "all_gather", args), launch(ranks, "all_to_all", args)
        ro, rn = max(s[0] for s in old) / mib, max(s[0] for s in new) / mib
        po, pn = max(s[1] for s in old) / mib, max(s[1] for s in new) / mib
        assert [s[2] for s in old] == [s[2] for s in new]  # the same rows, in the same order, on every rank
        print(f"{ranks:>5} | {ro:>19.1f} | {rn:>19.1f} | {rn / ro:>5.2f} | {po:>19.1f} | {pn:>19.1f} | "
              f"{pn / max(po, 1e-9):>5.2f}")


if __name__ == "__main__":
    main()
