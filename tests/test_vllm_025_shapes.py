"""The CUDA path's shapes as vLLM 0.25 hands them over, checked on CPU (review of 2026-11-29, sections (a), (c) and
(d), their "smallest CPU test"): the sync plan under 0.25's layerwise reload counting (a padded, tied embedding only
processed when the reload closes) and Transformers 5's fused experts loaded as per-expert views; routes shaped as 0.25
returns them; and, with vLLM's CPU build, the top-k/top-p rule the engine pins (the log-probs mode it asks for is
asserted in tests/test_rollout.py's vLLM engine test, which starts an engine anyway). The sync fakes are
tests/test_sync_plan.py's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from lib import routing
from lib.engine.vllm_sync import EngineSync
from tests import test_sync_plan as fakes
from tests.test_sync_plan import (EXPERTS, HIDDEN, INTER, Experts, FakeEngineModel, Plain, VisionLanguage,
                                  hf_weights, inner, state)

# ---- vLLM 0.25's layerwise reload (model_loader/reload/layerwise.py, meta.py), as a fake around the fakes' loaders


class CopyCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """The elements ``copy_`` writes (0.25's ``reload/meta.py: CopyCounter``): a fill is not counted."""

    def __init__(self):
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.copy_.default:
            self.numel += args[0].numel()
        return func(*args, **(kwargs or {}))


class LayerwiseReload025:
    """What 0.25's layerwise reload does with each layer that holds tensors: its kernel tensors kept aside, meta
    tensors in their place, each loader wrapped; a wrapped loader runs the loader on meta under a ``CopyCounter``,
    buffers its arguments (the sent tensor with them) and adds the count, capped at the parameter's numel
    (``get_numel_loaded``); once the layer's count reaches its numel the layer is processed: real tensors, the
    buffered loads, its quant method's processing, the result copied into the kernel tensors, put back. A padded
    embedding (34 rows sent into 64) never reaches its numel: it is processed when the reload closes ("Delayed
    processing", ``finalize_layerwise_processing``). ``delayed``: the layers processed there, in the last reload."""

    def __init__(self, top: nn.Module):
        self.top, self.layers, self.delayed = top, {}, []

    def __call__(self, begin: bool, layers: list[nn.Module] | None) -> None:
        if begin:
            self.begin(layers)
        else:
            self.finalize()

    def begin(self, only: list[nn.Module] | None) -> None:
        self.layers, self.delayed = {}, []
        for layer in (only if only is not None else self.top.modules()):
            params = dict(layer._parameters)
            if not params:
                continue
            info = {"kernel": params, "loaded": [], "numel": 0, "total": sum(p.numel() for p in params.values())}
            self.layers[layer] = info
            for name, kernel in params.items():
                meta = nn.Parameter(kernel.detach().to("meta"), requires_grad=False)
                meta.weight_loader = self._counting(layer, info, name, kernel.weight_loader)
                layer._parameters[name] = meta

    def _counting(self, layer: nn.Module, info: dict, name: str, original):
        def online_process_loader(param, loaded, *args):
            info["loaded"].append((name, original, loaded, args))  # holds the sent tensor until processed
            with CopyCounter() as counter:
                original(param, loaded, *args)
            info["numel"] += min(counter.numel, param.numel())
            if info["numel"] >= info["total"]:
                self._process(layer, info)
        return online_process_loader

    def _process(self, layer: nn.Module, info: dict) -> None:
        for name, kernel in info["kernel"].items():
            layer._parameters[name] = nn.Parameter(torch.empty_like(kernel, device="cpu"), requires_grad=False)
        for name, original, loaded, args in info["loaded"]:
            original(layer._parameters[name], loaded, *args)
        method = getattr(layer, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(layer)
        for name, kernel in info["kernel"].items():
            kernel.data.copy_(layer._parameters[name])  # into the original storage (CUDA graphs keep it)
            layer._parameters[name] = kernel
        self.layers.pop(layer)

    def finalize(self) -> None:
        for layer, info in list(self.layers.items()):
            if info["numel"] > 0:
                self.delayed.append(layer)
                self._process(layer, info)
            else:  # nothing loaded: the kernel tensors back ("Failed to load weights")
                layer._parameters.update(info["kernel"])
                self.layers.pop(layer)


def engine_sync_025(top: nn.Module) -> tuple[EngineSync, LayerwiseReload025]:
    reload = LayerwiseReload025(top)
    return EngineSync(lambda fn: fn(top), reload, frozenset(n for n, _ in top.named_parameters()), tied_head=True,
                      use_plan=True), reload


# ---- (a) 1: a padded, tied embedding under 0.25's reload counting


@pytest.mark.parametrize("head", ["module", "shared"], ids=["head-is-embedding", "head-shares-parameter"])
def test_a_padded_tied_embedding_processed_at_the_reloads_close_goes_through_the_plan(monkeypatch, head):
    """The Qwen2.5-VL toy on 0.25: vocabulary 34 padded to 64, the head its language model's, tied as the embedding
    module. 0.25 counts at most a parameter's numel per load, so the embedding (34 of 64 rows copied) is processed
    only when the reload closes, inside the record sync's recorder, from the sent tensor its buffered load holds:
    the copy and the padding's zero fill are recorded there, the zeros under the embedding's name."""
    monkeypatch.setattr(fakes, "VOCAB", 34)
    monkeypatch.setattr(fakes, "PADDED", 64)
    top = VisionLanguage(head, packed_head_layer=False, vision=True)
    embedding = inner(top).embed_tokens
    es, reload = engine_sync_025(top)
    for step in range(3):
        weights = hf_weights(70 + step, vision=True)
        assert fakes.sync(es, None, weights) == (2 if step == 0 else 1)
        if step == 0:
            # the layers processed at the close, not on arrival: the embedding, and a head module of its own
            assert set(reload.delayed) == {embedding, top.language_model.lm_head}
        reference = FakeEngineModel(packed_head_layer=False, vision=True)  # the loader alone
        reference.load_weights(weights)
        ours, theirs = state(inner(top)), state(reference)
        for name in theirs:
            assert torch.equal(ours[name].view(torch.int32), theirs[name].view(torch.int32)), name
        assert top.language_model.lm_head.weight is embedding.weight and not embedding.weight[34:].any()
        if step:
            assert es.counts == {"plan": len(weights), "loader": 0}, es.counts  # every tensor through the plan
    plan = es.plan
    assert plan.proven and not plan.fallback and not plan.loader, plan.summary()
    # the sent rows and the padding's zeros, both under the embedding's name (a head module sharing the parameter
    # repeats them: its own delayed load, from the same sent tensor, into the same tensor)
    targets = plan.writes["model.embed_tokens.weight"]
    assert {(t.view.storage_offset(), tuple(t.view.shape), t.value) for t in targets} == {
        (0, (34, HIDDEN), None), (34 * HIDDEN, (30, HIDDEN), 0.0)}
    assert {t.name for t in targets} == {"language_model.model.embed_tokens.weight"}
    assert all(t.view.untyped_storage().data_ptr() == embedding.weight.untyped_storage().data_ptr() for t in targets)


# ---- (a) 2: Transformers 5's fused experts through 0.25's RoutedExperts


class RoutedExperts(Experts):
    """0.25's ``RoutedExperts`` (fused_moe/routed_experts.py): Transformers 5's 3-D ``gate_up_proj`` [E, 2I, H] cut
    into per-expert gate and up views (``chunk(2, 1)``, ``unbind``), ``down_proj`` [E, H, I] unbound; each view
    through the stacked parameter's loader. Reports its names relative to itself."""

    def load_weights(self, weights) -> list[str]:
        loaded = []
        for name, tensor in weights:
            if name == "gate_up_proj":
                gate, up = tensor.chunk(2, 1)
                for e, (g, u) in enumerate(zip(gate.unbind(), up.unbind())):
                    self.w13_weight.weight_loader(self.w13_weight, g, "w1", e)
                    self.w13_weight.weight_loader(self.w13_weight, u, "w3", e)
                loaded.append("w13_weight")
            else:
                for e, d in enumerate(tensor.unbind()):
                    self.w2_weight.weight_loader(self.w2_weight, d, "w2", e)
                loaded.append("w2_weight")
        return loaded


class Contiguous:
    """The Triton MoE backend's conversion on SM90 (oracle/unquantized.py): ``.contiguous()``, bytes in place."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.w13_weight.data = layer.w13_weight.data.contiguous()
        layer.w2_weight.data = layer.w2_weight.data.contiguous()


class MoERunner(nn.Module):
    """0.25's fused-MoE layer: the block's router held again as its own child, the experts in ``routed_experts``,
    whose names it passes up unchanged (``...mlp.experts.w13_weight``, not ``...routed_experts.w13_weight``)."""

    def __init__(self, gate: nn.Module):
        super().__init__()
        self.gate = gate
        self.routed_experts = RoutedExperts()
        self.routed_experts.quant_method = Contiguous()

    def load_weights(self, weights) -> list[str]:
        return self.routed_experts.load_weights(weights)


class Qwen3Moe(nn.Module):
    """Two Qwen3-MoE blocks (router and experts) and the final norm, as 0.25 builds them; the checkpoint in
    Transformers 5's names (``mlp.experts.gate_up_proj``, ``mlp.experts.down_proj``: no ``.weight``)."""

    def __init__(self):
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList()
        for _ in range(2):
            layer = nn.Module()
            layer.mlp = nn.Module()
            layer.mlp.gate = Plain(EXPERTS, HIDDEN)
            layer.mlp.experts = MoERunner(layer.mlp.gate)
            self.model.layers.append(layer)
        self.model.norm = Plain(HIDDEN)

    def load_weights(self, weights) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            parts = name.split(".")
            if parts[1] == "norm":
                param = self.model.norm.weight
                param.weight_loader(param, tensor)
                loaded.add(name)
            elif parts[4] == "gate":
                param = self.model.layers[int(parts[2])].mlp.gate.weight
                param.weight_loader(param, tensor)
                loaded.add(name)
            else:
                prefix = ".".join(parts[:5])
                runner = self.model.layers[int(parts[2])].mlp.experts
                loaded |= {f"{prefix}.{n}" for n in runner.load_weights([(parts[5], tensor)])}
        return loaded


def moe_weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(2):
        p = f"model.layers.{i}.mlp."
        out += [(p + "gate.weight", torch.randn(EXPERTS, HIDDEN, generator=g)),
                (p + "experts.gate_up_proj", torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=g)),
                (p + "experts.down_proj", torch.randn(EXPERTS, HIDDEN, INTER, generator=g))]
    return out + [("model.norm.weight", torch.randn(HIDDEN, generator=g))]


def test_transformers_5s_fused_experts_loaded_as_per_expert_views_go_through_the_plan():
    """Each expert's gate, up and down written from views of the sent 3-D tensors (3E writes a layer), found as
    views of what was sent; the reported names map back through the runner's aliases; the proof holds and every
    later sync writes every tensor through the plan, bit for bit what the loader writes."""
    top = Qwen3Moe()
    reload = LayerwiseReload025(top)
    es = EngineSync(lambda fn: fn(top), reload, frozenset(n for n, _ in top.named_parameters()), tied_head=False,
                    use_plan=True)
    for step in range(3):
        weights = moe_weights(80 + step)
        assert fakes.sync(es, None, weights, size=2) == (2 if step == 0 else 1)
        if step == 0:
            assert reload.delayed == []  # every layer reached its numel on arrival
        else:
            assert es.counts == {"plan": len(weights), "loader": 0}, es.counts
        reference = Qwen3Moe()
        reference.load_weights(weights)
        ours, theirs = state(top), state(reference)
        assert ours.keys() == theirs.keys()
        for name in ours:
            assert torch.equal(ours[name], theirs[name]), name
    plan = es.plan
    assert plan.proven and not plan.fallback and not plan.loader, plan.summary()
    for i in range(2):
        experts = top.model.layers[i].mlp.experts.routed_experts
        gate_up = plan.writes[f"model.layers.{i}.mlp.experts.gate_up_proj"]
        down = plan.writes[f"model.layers.{i}.mlp.experts.down_proj"]
        assert len(gate_up) + len(down) == 3 * EXPERTS
        assert {t.module for t in gate_up + down} == {experts}
        assert {t.name for t in gate_up} == {f"model.layers.{i}.mlp.experts.routed_experts.w13_weight"}
        assert [t.view.shape for t in down] == [(HIDDEN, INTER)] * EXPERTS
    router = {t.name for t in plan.writes["model.layers.1.mlp.gate.weight"]}
    assert router == {"model.layers.1.mlp.gate.weight"}  # the first path, not the runner's


# ---- (d): routes as 0.25 returns them


@pytest.mark.parametrize("layers", [[1, 3], [1, 2]], ids=["first-dense", "first-and-last-dense"])
def test_routes_shaped_as_vllm_025_returns_them_align_with_the_batch(layers):
    """0.25's ``routed_experts``: uint8 [prompt + response - 1, every decoder layer, k], a dense layer's rows zero
    (routed_experts_capturer.py), for left-padded prompts: the prompt's rows after its padding, the response's after
    the prompt width, -1 in the padding and in the last response column (a token vLLM never feeds back). A model
    whose last decoder layer is dense (mlp_only_layers) has more decoder layers than its last MoE layer + 1."""
    num_layers, k, prompt_width = 4, 2, 6
    prompt_lens, response_lens = [3, 6], [4, 2]
    width = prompt_width + max(response_lens)
    rows = []
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        arr = np.zeros((p + r - 1, num_layers, k), dtype=np.uint8)
        for t in range(p + r - 1):
            for j, layer in enumerate(layers):
                arr[t, layer] = [10 * i + t, 100 + j]
        rows.append(arr)
    out = routing.from_vllm(rows, prompt_lens, prompt_width, width, layers, k)
    assert out.shape == (2, width, len(layers), k) and out.dtype == torch.int16
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        cols = list(range(prompt_width - p, prompt_width + r - 1))
        for t, col in enumerate(cols):
            assert out[i, col].tolist() == [[10 * i + t, 100 + j] for j in range(len(layers))], (i, col)
        assert (out[i, prompt_width + r - 1] == -1).all()  # the last response token: no row
        assert (out[i, [c for c in range(width) if c not in cols]] == -1).all()


# ---- (c): vLLM's top-k/top-p rule and log-probs mode (vLLM's CPU build)


@pytest.mark.vllm
def test_the_exact_filter_rule_keeps_vllms_triton_kernel_out(monkeypatch):
    """``exact_filter_rule`` turns vLLM's Triton top-k/top-p kernel off (16 rows: over the 8 from which 0.25 takes
    it on CUDA; 0.32 takes it always): with the kernel made to raise, ``apply_top_k_top_p`` runs the sort-based rule,
    equal to it and to the trainer's kept sets (lib.logprobs.kept_mask), for the V1 and the V2 model runner."""
    from vllm.v1.sample.ops import topk_topp_sampler
    from vllm.v1.worker.gpu.sample import states

    from lib.engine import SamplingConfig
    from lib.engine.vllm_adapter import exact_filter_rule
    from lib.logprobs import kept_mask

    def kernel(*args, **kwargs):
        raise AssertionError("the Triton top-k/top-p kernel ran")

    monkeypatch.setattr(topk_topp_sampler, "apply_top_k_top_p_triton", kernel, raising=False)
    monkeypatch.setattr(topk_topp_sampler, "HAS_TRITON", True, raising=False)  # as on a GPU: the kernel's turn
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 300, generator=g) * 3
    top_k = torch.full((16,), 20, dtype=torch.long)
    top_p = torch.full((16,), 0.8)
    top_k[::4], top_p[1::4] = 300, 1.0  # rows with only one of the two filters
    with pytest.raises(AssertionError, match="Triton"):  # the module's switch, read at every call
        topk_topp_sampler.apply_top_k_top_p(logits.clone(), top_k, top_p)
    exact_filter_rule(torch.device("cuda"), SamplingConfig(temperature=1.0, top_k=20, top_p=0.8))
    assert topk_topp_sampler.HAS_TRITON is False
    out = topk_topp_sampler.apply_top_k_top_p(logits.clone(), top_k, top_p)
    exact = topk_topp_sampler.apply_top_k_top_p_pytorch(logits.clone(), top_k, top_p)
    assert torch.equal(out, exact)
    kept = torch.stack([kept_mask(logits[i:i + 1], int(top_k[i]), float(top_p[i]))[0] for i in range(16)])
    assert torch.equal(out > float("-inf"), kept)
    # the V2 model runner imports the function, not the switch: the same function, reading the same module's switch
    assert states.apply_top_k_top_p.__globals__ is vars(topk_topp_sampler)

