"""The start-up self-check: the user's own model proves each mode it will train in, before step 1.

Packing (remove padding) and Ulysses sequence parallelism compute the model's forward another way than the padded
batch does: every layer that mixes along the sequence must keep to each packed sequence (lib/attention.py,
lib/mixers.py) and see the whole sequence under SP. An architecture nobody has tested may have a layer that does
not, and would then train another model without a word. So before the first step the packed forward (split over
the SP group when sp_size > 1) is compared with the padded one on two short random sequences of the real model,
and a difference beyond the dtype's tolerance stops the run naming the mode and the fix. The check computes in fp32
on every device (lib/startup.py runs it under lib.fsdp.fp32_compute), so its tolerance is fp32's on a GPU too; there
the packed attention then takes its plain path (the varlen kernels take half precision only), and the kernels are
checked against that path by tests/test_attention.py's gpu-marked tests. Cost: two forwards of about 40 tokens
(the log line gives the seconds).

The fused LM head (model.fused_head) is checked the same way: its log-probs and entropy against the whole logits' on
the same rows. A model that changes its logits after a plain head (Falcon-H1 multiplies them by its muP factor)
cannot take it; lib.forward.fuses_head's list of known attributes is the fast path, this comparison the safety.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lib import routing
from lib.dist import Topology
from lib.forward import fuses_head, response_log_probs
from lib.models import UNFUSED_HEAD_ATTR, padded_attention
from lib.protocol import DataProto

# max |log p| difference allowed between the packed and the padded forward of the probe. fp32: the zoo's 21
# architectures differ by at most 4.8e-7 on it; a mixer blind to the packed bounds differs by 6.5e-5 (LFM2) to 0.22
# (Granite-4). Half precision: the two paths round differently (2.3e-2 on the 0.5B shape on an H200), so a leak as
# small as LFM2's cannot be told from rounding there: the start-up check runs in fp32 on every device
# (lib.fsdp.fp32_compute; the master weights are fp32), and the half-precision entries serve other callers only.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1e-1, torch.float16: 1e-1}


def probe_rows(vocab_size: int, seed: int = 0) -> DataProto:
    """Two rows of random tokens as the rollout lays them out, a left-padded prompt of one token and right-padded
    responses of 15 and 12: every position but the first is compared, the first tokens after a packed bound too,
    where a leak from the sequence before shows most (LFM2's convolutions blind to the bounds: 1.6e-5 at the ends of
    the zoo's rollouts, 6.5e-5 here). The same on every rank (a fixed generator), as SP and FSDP need."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens, response_lens, width, response_width = (1, 1), (15, 12), 1, 15
    ids = torch.zeros(2, width + response_width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        ids[row, width - p:width + r] = torch.randint(1, vocab_size, (p + r,), generator=g)
        mask[row, width - p:width + r] = 1
    position_ids = (mask.cumsum(1) - 1).clamp(min=0)
    responses = ids[:, width:]
    return DataProto.from_dict({"input_ids": ids, "attention_mask": mask, "position_ids": position_ids,
                                "responses": responses, "response_mask": mask[:, width:]})


@contextlib.contextmanager
def padded_forwards(model: nn.Module) -> Iterator[None]:
    """Within the block, a model built for packed rows makes padded forwards: every config of the model that attends
    through its packed implementation (the text config of a multimodal one too; not its vision tower's, which keeps
    its own) attends through the padded one, and back after. Each config is set alone: transformers' setter of a
    composite config passes the value on to every sub-config, the vision tower's too."""
    packed_impl = model.config.get_text_config()._attn_implementation
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "_attn_implementation", None) == packed_impl}
    for config in configs.values():
        config._attn_implementation_internal = padded_attention(model.config)
    try:
        yield
    finally:
        for config in configs.values():
            config._attn_implementation_internal = packed_impl


def _world_max(value: float, device: torch.device) -> float:
    """The largest of every rank's ``value`` (world: every rank then takes the same path)."""
    worst = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    return float(worst)


@torch.no_grad()
def check_modes(model: nn.Module, topo: Topology, packed: bool, dtype: torch.dtype, replay: bool = False
                ) -> list[dict[str, Any]]:
    """Compare the packed forward of ``model`` (when ``packed``), then the packed forward split over the SP group
    (when sp_size > 1), with its padded forward on ``probe_rows``. Returns one {mode, max_diff, tolerance, seconds}
    per mode checked; raises ValueError naming the mode and the fix past the tolerance. Every rank of the world
    calls it (FSDP's and SP's collectives). ``replay`` (rollout.routing_replay on a mixture-of-experts model): the
    modes are compared under the routes the padded forward chose, as training replays the engine's routes (a route
    that flips on a near-tie between two forwards is then no difference of the modes)."""
    modes = ([("packing", None)] if packed else []) + ([(f"Ulysses sp_size {topo.sp_size}", topo)]
                                                         if topo.sp_size > 1 else [])
    if not modes:
        return []
    config = model.config
    rows = probe_rows(config.get_text_config().vocab_size).to(topo.device)
    mask = rows.batch["response_mask"].bool()
    tolerance = TOLERANCE.get(dtype, 1e-1)
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    replay = replay and bool(routing.routers(model))
    if replay:
        routing.install(model)  # for good: training installs it right after (lib/startup.py), the same state
    with padded_forwards(model), routing.recorded(model) if replay else contextlib.nullcontext():
        reference, _ = response_log_probs(model, rows, packed=False)
        if replay:  # the packed forwards below replay the routes the padded one chose
            rows.batch[routing.KEY] = routing.first_routes(model, rows.batch["input_ids"].shape)
    results = []
    try:
        for mode, sp in modes:
            logp, _ = response_log_probs(model, rows, packed=True, sp=sp)
            diff = _world_max((logp - reference)[mask].abs().max().item(), logp.device)  # every rank stops, or none
            results.append({"mode": mode, "max_diff": diff, "tolerance": tolerance,
                            "seconds": time.perf_counter() - t0})
            if not diff <= tolerance:
                routes = None if replay else same_routes_diff(model, rows, sp)
                if routes is not None and routes <= tolerance:
                    raise ValueError(router_refusal(model, mode, diff, routes, tolerance, dtype))
                raise ValueError(refusal(model, rows, mode, sp, diff, tolerance, dtype))
    finally:
        model.train(was_training)
    return results


@torch.no_grad()
def check_fused_head(model: nn.Module, topo: Topology) -> dict[str, Any] | None:
    """The fused head's log-probs and entropy against the whole logits' on ``probe_rows`` (padded forwards, the
    model's compute dtype: run it under lib.fsdp.fp32_compute). None where the model does not take the fused path
    (turned off, or a known post-processing attribute); else {class, max_diff, tolerance, fused, reason, seconds},
    ``fused`` False where they differ (or the fused forward found the head's output changed). Every rank of the
    world calls it (FSDP's collectives; the verdict is the world's)."""
    if getattr(model, UNFUSED_HEAD_ATTR, False) or not fuses_head(model):
        return None
    rows = probe_rows(model.config.get_text_config().vocab_size).to(topo.device)
    mask = rows.batch["response_mask"].bool()
    was_training = model.training
    model.eval()
    t0 = time.perf_counter()
    reason = ""
    try:
        setattr(model, UNFUSED_HEAD_ATTR, True)
        with padded_forwards(model):
            whole = response_log_probs(model, rows, packed=False, with_entropy=True)
        setattr(model, UNFUSED_HEAD_ATTR, False)
        try:
            with padded_forwards(model):
                fused = response_log_probs(model, rows, packed=False, with_entropy=True)
            diff = max((a - b)[mask].abs().max().item() for a, b in zip(fused, whole))
        except RuntimeError as e:  # lib.forward: the forward changed the head's output, or gave it other positions
            if "plain last layer" not in str(e):
                raise
            diff, reason = float("inf"), "its forward changes the LM head's output after the head"
    finally:
        if hasattr(model, UNFUSED_HEAD_ATTR):
            delattr(model, UNFUSED_HEAD_ATTR)
        model.train(was_training)
    tolerance = TOLERANCE[torch.float32]
    diff = _world_max(diff, topo.device)
    return {"class": type(model).__name__, "max_diff": diff, "tolerance": tolerance, "fused": diff <= tolerance,
            "reason": reason or ("" if diff <= tolerance else "its log-probs differ from the whole logits' (it "
                                 "changes its logits after the head)"), "seconds": time.perf_counter() - t0}


def same_routes_diff(model: nn.Module, rows: DataProto, sp: Any) -> float | None:
    """A mixture-of-experts model's modes compared under one set of routes (those the padded forward chose, replayed
    in the packed one): the world's max |diff| of the log-probs; None for a model without routers lib/routing knows.
    Every rank calls it."""
    if not routing.routers(model):
        return None
    mask = rows.batch["response_mask"].bool()
    with routing.recorded(model):
        with padded_forwards(model):
            reference, _ = response_log_probs(model, rows, packed=False)
        routes = routing.first_routes(model, rows.batch["input_ids"].shape)
        logp, _ = response_log_probs(model, DataProto.from_dict({**dict(rows.batch), routing.KEY: routes}),
                                     packed=True, sp=sp)
    return _world_max((logp - reference)[mask].abs().max().item(), logp.device)


def router_refusal(model: nn.Module, mode: str, diff: float, routes: float, tolerance: float,
                   dtype: torch.dtype) -> str:
    """The message where the routers explain the difference: under one set of routes the modes agree."""
    return (f"self-check: {class_name(model)}'s log-probs under {mode} differ from the padded forward's by {diff:.3g} "
            f"(tolerance {tolerance:g} in {str(dtype).removeprefix('torch.')}), and by {routes:.3g} under the same "
            f"routes: its mixture-of-experts routers chose other experts between the two forwards (near-ties), no "
            f"layer mixes tokens across sequences. Train with --rollout.routing_replay (the trainer replays the "
            f"engine's routes, and this check compares the modes under one set of routes), or without the mode.")


def refusal(model: nn.Module, rows: DataProto, mode: str, sp: Any, diff: float, tolerance: float,
            dtype: torch.dtype) -> str:
    """The self-check's message: the mode, the difference, the first layer whose output differs (packing), and the
    two ways on: the flag that turns the mode off, and where to make the layer keep to each sequence."""
    head = (f"self-check: {class_name(model)} computes another model under {mode}: its log-probs differ from the "
            f"padded forward's by {diff:.3g} (tolerance {tolerance:g} in {str(dtype).removeprefix('torch.')})")
    if sp is not None:
        return (f"{head}; some layer of this architecture mixes tokens across SP slices. Train without it "
                f"(--trainer.sp_size 1), and report the architecture.")
    found = first_leaking_layer(model, rows, tolerance)
    where = (f"the first output that differs is {found[0]} ({found[1]}, in {found[2]}), which mixes tokens across "
             f"packed sequences" if found else "some layer mixes tokens across packed sequences")
    culprit = found[2] if found else "the layer's class"
    return (f"{head}; {where}. Train without packing (--actor.batching.no-use-remove-padding), or make that layer "
            f"keep to each sequence: add {culprit!r} to NAMES in lib/mixers.py (its forward then runs once per packed "
            f"sequence), and report the architecture.")


@torch.no_grad()
def first_leaking_layer(model: nn.Module, rows: DataProto, tolerance: float) -> tuple[str, str, str] | None:
    """(module name, its class, the class of the decoder layer's child it sits in) of the first module, in the order
    the forward finishes them, whose output on the probe's tokens differs between the packed and the padded forward
    beyond ``tolerance``; None if no module's output can be matched. Every rank calls it (FSDP's collectives)."""
    mask = rows.batch["attention_mask"].bool()
    outputs: dict[str, dict[str, torch.Tensor]] = {"padded": {}, "packed": {}}
    order: list[str] = []  # the packed forward's modules, as each finishes
    names = {m: n for n, m in model.named_modules()}

    def hook(kind: str):
        def record(module: nn.Module, args: Any, out: Any) -> None:
            t = out[0] if isinstance(out, (tuple, list)) and out else out
            if torch.is_tensor(t) and t.is_floating_point():
                outputs[kind][names.get(module, "")] = t.detach().float()
                if kind == "packed":
                    order.append(names.get(module, ""))
        return record

    for kind in ("padded", "packed"):
        handles = [m.register_forward_hook(hook(kind)) for m in model.modules()]
        try:
            with padded_forwards(model) if kind == "padded" else contextlib.nullcontext():
                response_log_probs(model, rows, packed=kind == "packed")
        finally:
            for h in handles:
                h.remove()
    padded, packed = outputs["padded"], outputs["packed"]
    kinds = set(getattr(model, "_no_split_modules", None) or [])
    layers = {n for n, m in model.named_modules() if class_name(m) in kinds}
    for name in order:
        a, b = padded.get(name), packed.get(name)
        if a is None or b is None or a.dim() < 2 or b.dim() < 2 or a.shape[:2] != mask.shape or b.shape[0] != 1:
            continue
        a = a[mask]
        if a.shape != b[0].shape:
            continue
        if float((a - b[0]).abs().max()) > tolerance:
            # the decoder layer's child the module sits in: the layer to bound (lib/mixers.py), not its projection
            parent = next((f"{layer}.{name[len(layer) + 1:].split('.')[0]}" for layer in layers
                           if name.startswith(layer + ".")), name)
            return name, class_name(model.get_submodule(name)), class_name(model.get_submodule(parent))
    return None


def class_name(module: nn.Module) -> str:
    """A module's own class name (FSDP2 wraps a sharded module in a subclass named FSDP<name>)."""
    return type(module).__name__.removeprefix("FSDP")
