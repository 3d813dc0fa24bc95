"""Rollout routing replay (R3, Ma et al. 2025, arXiv 2510.11370) for mixture-of-experts models.

The engine records, for every token of prompt and response, the top-k expert ids each MoE layer chose; the trainer's
forwards (old log-probs, the reference, the update, a gradient-checkpointing recompute) send every token to exactly
those experts. The gate *weights* are recomputed from the trainer's own router logits at the replayed ids, with the
family's formula (read from each router class of transformers), so the router still gets its gradient:

- softmax (Qwen2/3-MoE, Qwen3-Next, OLMoE: renormalised when ``norm_topk_prob``; Mixtral, Qwen3.5-MoE: always):
  ``w = softmax(logits)[ids]``, ``w / sum(w)``;
- sigmoid (DeepSeek-V3, GLM-4.5): ``w = sigmoid(logits)[ids]``, ``w / (sum(w) + 1e-20)`` when ``norm_topk_prob``,
  times ``routed_scaling_factor``; the correction bias and the group top-k only choose ids, which are replayed;
- top-k softmax (gpt-oss): ``w = softmax(logits[ids])``.

Routes travel with the batch as ``routed_experts`` (B, L, num MoE layers, k) int16, aligned with ``input_ids``, -1
where no engine recorded one (padding, and the last response token, which no engine feeds back): there the trainer's
own router chooses, as it would without replay. The hooks are forward hooks on the routers, so they run in every
forward and recompute; ``use`` sets the routes of the next forwards, flattened as the routers flatten their input
(rows times columns, or the packed row).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from lib import models

Tensor = torch.Tensor
KEY = "routed_experts"
"""The batch key of the routes: (B, L, num MoE layers, k) int16, -1 where none was recorded."""

# router class (transformers 5) -> its weight formula
KINDS = {
    "Qwen2MoeTopKRouter": "softmax", "Qwen3MoeTopKRouter": "softmax", "Qwen3NextTopKRouter": "softmax",
    "OlmoeTopKRouter": "softmax", "MixtralTopKRouter": "softmax_norm", "Qwen3_5MoeTopKRouter": "softmax_norm",
    "DeepseekV3TopkRouter": "sigmoid", "Glm4MoeTopkRouter": "sigmoid", "GptOssTopKRouter": "topk_softmax",
}
# config model_type -> whether its routers are in KINDS (the start-up check, before any model is built)
MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "qwen3_next", "olmoe", "mixtral", "qwen3_5_moe_text", "deepseek_v3",
               "glm4_moe", "gpt_oss")


def gate_weights(kind: str, router: nn.Module, logits: Tensor, ids: Tensor) -> Tensor:
    """The gate weights (N, k) of experts ``ids`` (N, k) from the router's logits (N, E), by the family's formula."""
    if kind == "sigmoid":
        w = logits.sigmoid().gather(1, ids)
        if router.norm_topk_prob:
            w = w / (w.sum(-1, keepdim=True) + 1e-20)
        return w * router.routed_scaling_factor
    if kind == "topk_softmax":
        return torch.softmax(logits.gather(1, ids), dim=1, dtype=logits.dtype)
    w = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, ids)
    if kind == "softmax_norm" or router.norm_topk_prob:
        w = w / w.sum(-1, keepdim=True)
    return w.to(logits.dtype)


def count_moe_layers(config: Any) -> int:
    """The MoE layers (routers) of a model of ``config``, counted on the model built on the meta device: the config's
    own rules for which layers are sparse (mlp_only_layers, decoder_sparse_step, first_k_dense_replace) as the model
    class applies them."""
    return len(routers(models.build_empty(config, "causal_lm", "sdpa")))


def routers(model: nn.Module) -> list[nn.Module]:
    """The model's MoE routers in layer order (dense layers have none)."""
    return [m for m in model.modules() if type(m).__name__ in KINDS]


@dataclass
class Routing:
    """The replay state of one model: its routers, the routes of the next forwards, what its routers chose."""

    layers: int
    top_k: int
    routes: Tensor | None = None  # (N, layers, k) long: the next forwards' tokens, -1: the router's own choice
    recorded: list[list[Tensor]] | None = None  # per layer, each forward's own ids (N, k), while recording
    flips: Tensor = field(default_factory=lambda: torch.zeros(2, dtype=torch.float64))  # (differing, compared)
    handles: list[Any] = field(default_factory=list)  # the routers' hooks (``uninstall`` removes them)


def install(model: nn.Module) -> Routing:
    """Forward hooks on each of the model's routers (once); returns the model's replay state."""
    if (state := getattr(model, "_routing", None)) is not None:
        return state
    found = routers(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no mixture-of-experts router that routing replay knows "
                         f"({', '.join(sorted(KINDS))})")
    state = Routing(len(found), found[0].top_k)
    for layer, router in enumerate(found):
        state.handles.append(router.register_forward_hook(_hook(state, layer, KINDS[type(router).__name__])))
    model._routing = state
    return state


def uninstall(model: nn.Module) -> None:
    """The model's replay hooks removed (the start-up self-check installs them for a check of its own)."""
    state = state_of(model)
    if state is not None:
        for handle in state.handles:
            handle.remove()
        del model._routing


@contextmanager
def recorded(model: nn.Module) -> Iterator[None]:
    """The block's forwards recorded (``recording``), with the replay hooks installed for the block where the model
    had none (removed after: the start-up self-check records without replay being on)."""
    mine = state_of(model) is None
    install(model)
    try:
        with recording(model):
            yield
    finally:
        if mine:
            uninstall(model)


def first_routes(model: nn.Module, shape: tuple[int, int]) -> Tensor:
    """Inside ``recorded``: the routes the routers chose in the block's first forward, over (B, L) = ``shape`` padded
    rows, as (B, L, layers, k) int16 (the batch's layout)."""
    flat = torch.stack([calls[0] for calls in state_of(model).recorded], 1).to(torch.int16)
    return flat.reshape(*shape, *flat.shape[1:])


def _hook(state: Routing, layer: int, kind: str):
    def hook(router: nn.Module, args: Any, out: tuple[Tensor, Tensor, Tensor]) -> tuple[Tensor, Tensor, Tensor] | None:
        logits, _, own = out
        if state.recorded is not None:
            state.recorded[layer].append(own.detach())
        if state.routes is None:
            return None
        replay = state.routes[:, layer]
        if replay.shape[0] != own.shape[0]:
            raise RuntimeError(f"routing replay: {replay.shape[0]} routes for {own.shape[0]} tokens at MoE layer "
                               f"{layer}: the routes are not aligned with the tokens")
        missing = (replay < 0).any(-1, keepdim=True)
        ids = torch.where(missing, own, replay.to(own.dtype))
        if not torch.is_grad_enabled():  # the no-grad passes (old log-probs) count, not the update's recompute
            compared = ~missing.squeeze(-1)
            differ = (ids.sort(-1).values != own.sort(-1).values).any(-1) & compared
            state.flips = state.flips.to(own.device) + torch.stack([differ.sum(), compared.sum()]).double()
        return logits, gate_weights(kind, router, logits, ids), ids

    return hook


def state_of(model: nn.Module) -> Routing | None:
    return getattr(model, "_routing", None)


def flat_routes(routes: Tensor, valid: Tensor | None = None) -> Tensor:
    """(B, L, layers, k) -> the routers' token order: (B * L, layers, k), or the packed row's (N, layers, k) when
    ``valid`` (B, L) marks the packed tokens."""
    flat = routes.reshape(-1, *routes.shape[2:])
    return flat if valid is None else flat[valid.reshape(-1).bool()]


def sp_slice(routes: Tensor, sp_size: int, start: int, length: int) -> Tensor:
    """An SP rank's slice of the packed row's routes, the row padded to a multiple of sp as lib.ulysses pads it (the
    padding with -1: its own segment, routed as the router chooses)."""
    pad = (-routes.shape[0]) % sp_size
    if pad:
        routes = torch.cat([routes, routes.new_full((pad, *routes.shape[1:]), -1)])
    return routes[start:start + length]


@contextmanager
def use(model: nn.Module, routes: Tensor | None) -> Iterator[None]:
    """The model's next forwards replay ``routes`` (N, layers, k) (None: the routers choose). The routes stay set
    after the block, until the next ``use``: a gradient-checkpointing recompute runs in the backward, after the
    forward's block has closed, and must replay the same routes. Every forward of a replaying model goes through
    ``use`` (lib/forward.py), so no later forward meets another's routes."""
    state = state_of(model)
    if state is None:
        yield
        return
    if routes is not None and (routes.dim() != 3 or routes.shape[1:] != (state.layers, state.top_k)):
        raise ValueError(f"routing replay: routes for {routes.shape[1] if routes.dim() == 3 else '?'} MoE layers; the "
                         f"model has {state.layers} routers of top-{state.top_k} (routes of shape "
                         f"{tuple(routes.shape)}, want (tokens, {state.layers}, {state.top_k}))")
    state.routes = None if routes is None else routes.to(torch.long)
    yield


@contextmanager
def recording(model: nn.Module) -> Iterator[list[list[Tensor]]]:
    """Collect the ids each router chooses in the forwards of the block: per layer, one (N, k) per forward."""
    state = state_of(model)
    state.recorded = [[] for _ in range(state.layers)]
    try:
        yield state.recorded
    finally:
        state.recorded = None


def take_flips(model: nn.Module) -> tuple[float, float]:
    """(routes the trainer's own routers would have chosen differently, routes compared) since the last call."""
    state = state_of(model)
    if state is None:
        return 0.0, 0.0
    differ, compared = state.flips.tolist()
    state.flips.zero_()
    return differ, compared


# ---- the engines' side: routes recorded while generating, in the batch's layout


def none_routes(rows: int, width: int, layers: int, k: int) -> Tensor:
    """(rows, width, layers, k) of -1: no route recorded (the trainer's router chooses)."""
    return torch.full((rows, width, layers, k), -1, dtype=torch.int16)


def from_calls(recorded: list[list[Tensor]], prefill_rows: int, repeat: int) -> Tensor:
    """One generation's routes from the routers' ids, per layer one (N, k) per model call: the prefill's
    (prefill_rows x P') first, then one (rows, k) per decoding step. ``repeat``: the prefill's rows copied to that
    many samples each (its cache copied). Returns (rows, P' + steps, layers, k)."""
    per_layer = []
    for calls in recorded:
        prefill = calls[0].reshape(prefill_rows, -1, calls[0].shape[-1]).repeat_interleave(repeat, 0)
        per_layer.append(torch.cat([prefill, *(c[:, None] for c in calls[1:])], 1))
    return torch.stack(per_layer, 2).to(torch.int16)


def place(routes: Tensor, start: int, width: int) -> Tensor:
    """Routes (rows, T, layers, k) whose first column is the batch's column ``start`` (a prompt's first token after
    its left padding), in the batch's layout (rows, width, layers, k): -1 before ``start`` and past T."""
    out = none_routes(routes.shape[0], width, *routes.shape[2:])
    take = min(routes.shape[1], width - start)
    out[:, start:start + take] = routes[:, :take].cpu()
    return out


def moe_layers(model: nn.Module) -> list[int]:
    """The decoder-layer index of each router, in router order (from its module name, ``...layers.<i>....``)."""
    index = []
    for name, module in model.named_modules():
        if type(module).__name__ in KINDS:
            parts = name.split(".")
            index.append(int(parts[parts.index("layers") + 1]))
    return index


def from_vllm(rows: list[Any], prompt_lens: list[int], prompt_width: int, width: int, layers: list[int],
              k: int) -> Tensor:
    """vLLM's ``CompletionOutput.routed_experts`` of each request (numpy, [prompt + response - 1 tokens, every
    decoder layer or the MoE layers alone, k]; a dense layer's rows zero; None where the request returned none) ->
    (rows, width, MoE layers, k) in the batch's layout: a prompt of ``prompt_lens[i]`` tokens sits left-padded in
    ``prompt_width`` columns, its response after them; the last sampled token has no row (vLLM never feeds it)."""
    out = none_routes(len(rows), width, len(layers), k)
    for i, (arr, plen) in enumerate(zip(rows, prompt_lens)):
        if arr is None:
            continue
        arr = torch.as_tensor(arr)
        # every decoder layer (0.25, 0.32): as many as the model has, more than its last MoE layer where the last
        # decoder layers are dense (mlp_only_layers, decoder_sparse_step)
        if arr.dim() != 3 or arr.shape[2] != k or (arr.shape[1] != len(layers) and arr.shape[1] <= max(layers)):
            raise ValueError(f"vLLM returned routes of shape {tuple(arr.shape)}; the trainer has {len(layers)} MoE "
                             f"layers (decoder layers {layers}) of top-{k}")
        if arr.shape[1] != len(layers):  # every decoder layer: keep the MoE ones
            arr = arr[:, layers]
        out[i] = place(arr[None].to(torch.int16), prompt_width - plen, width)[0]
    return out
