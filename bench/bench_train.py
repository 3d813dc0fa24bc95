"""Forward+backward throughput of the policy update: padded micro-batches vs dynamic batching with packing.

    python bench/bench_train.py [--rows 64] [--max-len 1024] [--hidden 256] [--layers 4] [--device auto]

Long-tailed response lengths (log-normal, clipped to max-len). Baseline: fixed micro-batches of
--micro rows, padded to the batch's longest row, sdpa with a padding mask. Ours: dynamic micro-batches
of at most --max-tokens tokens, packed into one row (no pad compute). Prints valid tokens/s of each and
the ratio; on GPU also the model FLOPs utilisation (6 * matmul params * tokens + attention, over the bf16 peak; the
input embedding's lookup is no matmul). --heads/--kv-heads/--intermediate/--tied give a real model's shape.
--compare-head adds the packed side with model.fused_head off (the whole logits tensor made and kept for backward):
its tokens/s, and on GPU each side's peak memory. --compare-reduce adds the packed side with the other
fsdp.grad_reduce than the one auto chose (step: one parameter gather and one gradient reduction per optimizer step;
micro_batch: per micro-batch). It acts on FSDP units: on one GPU (bf16, the root unit: auto is step), or on CPU under
torchrun (each rank its own rows, the model sharded over the ranks: auto is micro_batch):

    torchrun --nproc-per-node 2 bench/bench_train.py --compare-reduce
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from lib.actor import Trainee, update_policy  # noqa: E402
from lib import liger  # noqa: E402
from lib.budget import size_from_memory  # noqa: E402
from lib.config import ActorConfig, BatchingConfig, FSDPConfig, ModelConfig, OptimConfig  # noqa: E402
from lib.dist import init_topology, reduce_metrics  # noqa: E402
from lib.fsdp import DEFER_FLAG, build_sharded_model  # noqa: E402
from lib.optim import build_optimizer  # noqa: E402
from lib.protocol import DataProto  # noqa: E402
from lib.engines import DEVICE_MARGIN_BYTES  # noqa: E402

PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}
LEVERS = ("fused_optim", "checkpointing", "compile", "budget", "budget_checkpointing", "liger")
"""--compare-levers' sides: issue 55's update levers, each the packed side with one switch on."""


def long_tailed_batch(rows: int, max_len: int, vocab: int, seed: int = 0) -> DataProto:
    rng = np.random.default_rng(seed)
    prompt_len = 64
    resp = np.clip(rng.lognormal(np.log(max_len / 8), 0.9, rows), 8, max_len - prompt_len).astype(int)
    R = int(resp.max())
    prompts = torch.from_numpy(rng.integers(3, vocab, (rows, prompt_len)))
    responses = torch.zeros(rows, R, dtype=torch.long)
    mask = torch.zeros(rows, R)
    for i, r in enumerate(resp):
        responses[i, :r] = torch.from_numpy(rng.integers(3, vocab, r))
        mask[i, :r] = 1
    attention = torch.cat([torch.ones(rows, prompt_len, dtype=torch.long), mask.long()], 1)
    return DataProto.from_dict({
        "input_ids": torch.cat([prompts, responses], 1), "responses": responses, "attention_mask": attention,
        "position_ids": (attention.cumsum(1) - 1).clamp(min=0), "response_mask": mask,
        "advantages": torch.from_numpy(rng.standard_normal((rows, 1))).float() * mask})


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--max-len", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=0, help="attention heads (0: hidden / 64)")
    ap.add_argument("--kv-heads", type=int, default=0, help="KV heads (0: hidden / 128)")
    ap.add_argument("--intermediate", type=int, default=0, help="MLP width (0: 4 x hidden)")
    ap.add_argument("--tied", action="store_true", help="tied input embedding and LM head (Qwen2.5 up to 3B)")
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=0, help="dynamic budget; 0: micro * mean row length")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--compare-head", action="store_true", help="also the packed side without the fused LM head")
    ap.add_argument("--compare-reduce", action="store_true", help="also the packed side with the other fsdp.grad_reduce")
    ap.add_argument("--compare-levers", action="store_true", help="also the packed side with AdamW's fused kernel "
                    "(optim.fused), with gradient checkpointing (model.gradient_checkpointing), with the decoder "
                    "layers compiled (model.compile_layers) and with the token budget sized from memory "
                    "(batching.token_budget memory, up to 16,384): issue 55's levers")
    ap.add_argument("--profile", default="", help="write a profile summary of 2 packed updates after the timed ones "
                    "to this file (bench/profile_summary.py: top kernels, shares, GPU idle, peak memory by phase)")
    return ap


def time_side(acfg: ActorConfig, batching: BatchingConfig, data: DataProto, topo, repeats: int
              ) -> tuple[float, int | None, Trainee]:
    """One side's best update time over ``repeats`` (the slowest rank's) after a warm-up, its peak memory (GPU),
    and its trainee. A budget sized from memory is sized here, as the trainer's start-up does, into
    ``acfg.batching``."""
    model = build_sharded_model(acfg.model, acfg.fsdp, topo, packed=batching.use_remove_padding)
    if batching.token_budget == "memory":  # sized as the trainer's start-up does (lib/budget.py)
        longest = int(data.batch["attention_mask"].sum(-1).max())
        acfg.batching, line = size_from_memory(batching, model, topo.device, model.config.vocab_size, longest,
                                               acfg.fsdp.optimizer_offload, DEVICE_MARGIN_BYTES)
        if topo.is_main:
            print(f"  (budget side: {line})")
    trainee = Trainee(model, *build_optimizer(model, acfg.optim), topo)
    update_policy(trainee, data, acfg)  # warm-up
    cuda = topo.device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        update_policy(trainee, data, acfg)
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak = torch.cuda.max_memory_allocated() if cuda else None
    return reduce_metrics({"t": min(times)}, None, "max")["t"], peak, trainee


def profile_updates(trainee: Trainee, data: DataProto, acfg: ActorConfig, topo, path: str, title: str) -> str:
    """Two more updates under torch.profiler, summed up into ``path`` (rank 0), with peak memory by phase; returns
    the summary's headline."""
    import profile_summary

    phases = profile_summary.PhasePeaks(trainee.optimizer)
    with profile_summary.profiled(topo.device) as prof:
        t0 = time.perf_counter()
        for _ in range(2):
            update_policy(trainee, data, acfg)
        if topo.device.type == "cuda":
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    text, headline = profile_summary.summary(prof, topo.device, wall, phases.close(), f"2 packed updates, {title}")
    if topo.is_main:
        with open(path, "w") as f:
            f.write(text)
    return headline


def measure(args: argparse.Namespace) -> dict:
    """Both sides' best time over --repeats updates; the figures as a dict (printed by main)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    topo = init_topology(device=args.device)
    with tempfile.TemporaryDirectory() as own:
        tmp = [own]
        dist.broadcast_object_list(tmp)  # rank 0's folder: every rank of a torchrun launch reads the one model
        tmp = tmp[0]
        if topo.is_main:
            cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden,
                              intermediate_size=args.intermediate or 4 * args.hidden, num_hidden_layers=args.layers,
                              num_attention_heads=args.heads or max(1, args.hidden // 64),
                              num_key_value_heads=args.kv_heads or max(1, args.hidden // 128),
                              max_position_embeddings=args.max_len, tie_word_embeddings=args.tied)
            AutoModelForCausalLM.from_config(cfg).save_pretrained(tmp)
        dist.barrier()
        data = long_tailed_batch(args.rows, args.max_len, args.vocab, seed=topo.rank)
        valid_tokens = int(data.batch["attention_mask"].sum())
        mean_len = valid_tokens / args.rows
        all_tokens = int(reduce_metrics({"n": valid_tokens}, None, "sum")["n"])  # every rank's, for tokens/s
        budget = args.max_tokens or int(args.micro * mean_len)
        budget = max(budget, int(data.batch["attention_mask"].sum(-1).max()))
        results, peaks = {}, {}
        packed = BatchingConfig(use_dynamic_batching=True, max_tokens_per_rank=budget, use_remove_padding=True)
        sides = {"padded": (BatchingConfig(micro_batch_size_per_rank=args.micro, use_remove_padding=False), True),
                 "packed": (packed, True)}
        if args.compare_head:
            sides["whole"] = (packed, False)  # packed, dynamic, fused_head off
        if args.compare_reduce:
            sides["other_reduce"] = (packed, True)  # packed, dynamic, the grad_reduce that auto did not pick
        if args.compare_levers:
            sides["fused_optim"] = sides["checkpointing"] = sides["compile"] = (packed, True)
            # the budget sized from memory, up to the trainer's default 16,384 tokens, against the fixed one above
            sides["budget"] = sides["budget_checkpointing"] = (
                BatchingConfig(use_dynamic_batching=True, use_remove_padding=True, token_budget="memory"), True)
            sides["liger"] = (packed, True)  # last: Liger patches transformers' Qwen2 module for what follows
        reduce, failed, profiled, budgets = {}, {}, "", {}
        for name, (batching, fused) in sides.items():
            grad_reduce = "auto" if name != "other_reduce" else "micro_batch" if reduce["packed"] == "step" else "step"
            acfg = ActorConfig(model=ModelConfig(path=tmp, fused_head="on" if fused else "off",
                                                 gradient_checkpointing=name in ("checkpointing",
                                                                                 "budget_checkpointing"),
                                                 compile_layers=name == "compile", liger=name == "liger"),
                               optim=OptimConfig(lr=1e-6, fused=name == "fused_optim"), batching=batching,
                               fsdp=FSDPConfig(grad_reduce=grad_reduce))
            if name in LEVERS:
                why = liger.unusable("qwen2", topo.device.type == "cuda") if name == "liger" else ""
                if why:
                    failed[name] = f"not run: {why}"
                    continue
                try:  # a lever that fails here (a kernel this device lacks) costs its own row only
                    results[name], peaks[name], _ = time_side(acfg, batching, data, topo, args.repeats)
                    if batching.token_budget == "memory":
                        budgets[name] = acfg.batching.max_tokens_per_rank
                except Exception as e:  # noqa: BLE001 (the row says what it was)
                    failed[name] = f"{type(e).__name__}: {str(e)[:200]}"
                continue
            results[name], peaks[name], trainee = time_side(acfg, batching, data, topo, args.repeats)
            model = trainee.model
            # a plain replica (one CPU rank) has no FSDP unit: it averages its gradients once a step either way
            reduce[name] = ("step" if hasattr(model, DEFER_FLAG) else "micro_batch" if isinstance(model, FSDPModule)
                            else "replica")
            if name == "packed" and args.profile:
                profiled = profile_updates(trainee, data, acfg, topo, args.profile,
                                           f"{args.rows} rows, budget {budget} tokens")
            n_params = sum(p.numel() for p in model.parameters())
            # the input embedding is a lookup, no matmul: out of the FLOPs (a tied one is the LM head's matmul too)
            n_matmul = n_params - (0 if args.tied else args.vocab * args.hidden)
            del model, trainee
    peak = None
    if topo.device.type == "cuda":
        gpu = torch.cuda.get_device_name()
        peak = next((v for k, v in PEAK_BF16_TFLOPS.items() if k in gpu), None)
    lengths = data.batch["attention_mask"].sum(-1).double()
    flops = 6 * n_matmul * valid_tokens + 12 * args.layers * args.hidden * float((lengths ** 2).sum()) / 2
    base, ours, whole = results["padded"], results["packed"], results.get("whole")
    by_reduce = {reduce[k]: results[k] for k in ("packed", "other_reduce") if k in results}
    step, micro = by_reduce.get("step"), by_reduce.get("micro_batch")
    levers = {k: all_tokens / results[k] if k in results else None for k in LEVERS}
    return {"whole_tokens_per_s": all_tokens / whole if whole else None, "peak_bytes": peaks, "budgets": budgets,
            "levers_tokens_per_s": levers, "levers_failed": failed, "profile": profiled,
            "reduce": reduce, "step_tokens_per_s": all_tokens / step if step else None,
            "micro_tokens_per_s": all_tokens / micro if micro else None, "ranks": topo.world_size,
            "main": topo.is_main,
            "rows": args.rows, "valid_tokens": valid_tokens, "mean_len": mean_len, "max_len": int(lengths.max()),
            "width": data.batch["input_ids"].shape[1], "params_m": n_params / 1e6, "device": str(topo.device),
            "budget": budget, "padded_tokens_per_s": all_tokens / base, "packed_tokens_per_s": all_tokens / ours,
            "ratio": base / ours, "mfu_padded": flops / base / (peak * 1e12) if peak else None,
            "mfu_packed": flops / ours / (peak * 1e12) if peak else None,
            "mfu_step": flops / step / (peak * 1e12) if peak and step else None}


def main() -> None:
    r = measure(parser().parse_args())
    if not r["main"]:
        return
    print(f"update_policy fwd+bwd+step, {r['rows']} rows, {r['valid_tokens']} valid tokens (mean {r['mean_len']:.0f}, "
          f"max {r['max_len']}), padded width {r['width']}, model {r['params_m']:.1f}M params, {r['device']} x "
          f"{r['ranks']} (rows and tokens: rank 0's; tokens/s: all ranks'), dynamic budget {r['budget']} tokens")
    for name, side in (("padded, fixed micro-batches", "padded"), ("packed, dynamic micro-batches", "packed")):
        line = f"  {name:<32}{r[side + '_tokens_per_s']:>10.0f} tokens/s"
        if r["mfu_" + side] is not None:
            line += f"   MFU {r['mfu_' + side] * 100:.1f}%"
        print(line)
    print(f"  ratio packed+dynamic / padded: {r['ratio']:.2f}x tokens/s")
    if r["whole_tokens_per_s"]:
        print(f"  packed, whole logits (fused_head off) {r['whole_tokens_per_s']:>10.0f} tokens/s; fused / whole "
              f"{r['packed_tokens_per_s'] / r['whole_tokens_per_s']:.2f}x")
    if r["step_tokens_per_s"] and r["micro_tokens_per_s"]:
        print(f"  (packed with fsdp.grad_reduce auto: {r['reduce']['packed']})")
        for name in ("micro", "step"):
            print(f"  packed, grad_reduce {name:<18}{r[name + '_tokens_per_s']:>10.0f} tokens/s")
        print(f"  ratio one reduction a step / one a micro-batch: "
              f"{r['step_tokens_per_s'] / r['micro_tokens_per_s']:.2f}x tokens/s")
    for name in LEVERS:
        if name in r["levers_failed"]:
            why = r["levers_failed"][name]
            print(f"  lever {name}: {why if why.startswith('not run') else 'failed: ' + why}")
        elif r["levers_tokens_per_s"].get(name):
            budget = f" (budget {r['budgets'][name]} tokens)" if name in r["budgets"] else ""
            print(f"  packed + lever {name:<20}{r['levers_tokens_per_s'][name]:>10.0f} tokens/s, "
                  f"{r['levers_tokens_per_s'][name] / r['packed_tokens_per_s']:.2f}x the packed side{budget}")
    if r["peak_bytes"].get("packed") is not None:
        print("  peak GPU memory: " + ", ".join(f"{k} {v / 2**30:.1f} GiB" for k, v in r["peak_bytes"].items()))


if __name__ == "__main__":
    main()
