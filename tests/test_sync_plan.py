"""The weight sync's plan (lib.engine.plan) against an engine model laid out as vLLM lays out its weights: q/k/v (and
their biases) fused into one qkv, gate/up into one gate_up, a mixture of experts stacked into w13/w2 by expert, a
vocabulary padded with zero rows, a head tied to the embedding. No vLLM needed: the loaders here write as vLLM's do
(narrowed copies by shard id and expert), and one layer's post-load processing packs its weight, as vLLM's CPU build
does. The plan, recorded from these loaders, must write what they write, bit for bit, and leave the packed layer to
its loader; vLLM's own loaders are checked the same way in tests/test_rollout.py (vllm marker)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from torch import nn

from lib.engine.plan import Recorder, SyncPlan
from lib.engine.vllm_sync import EngineSync, tensor_names

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, EXPERTS, VOCAB, PADDED = 64, 4, 2, 16, 96, 4, 1000, 1024
VISION = 48  # the vision tower's width (3 heads of 16)


class Fused(nn.Module):
    """A linear whose output rows hold several checkpoint tensors (vLLM's QKVParallelLinear, MergedColumnParallel)."""

    def __init__(self, shards: dict[str, int], in_size: int, bias: bool = False):
        super().__init__()
        self.offsets, start = {}, 0
        for shard, size in shards.items():
            self.offsets[shard] = (start, size)
            start += size
        self.weight = nn.Parameter(torch.zeros(start, in_size), requires_grad=False)
        self.weight.weight_loader = self.load
        if bias:
            self.bias = nn.Parameter(torch.zeros(start), requires_grad=False)
            self.bias.weight_loader = self.load

    def load(self, param: torch.Tensor, loaded: torch.Tensor, shard: str) -> None:
        start, size = self.offsets[shard]
        param.data.narrow(0, start, size).copy_(loaded)


class Plain(nn.Module):
    def __init__(self, *shape: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape), requires_grad=False)
        self.weight.weight_loader = lambda param, loaded: param.data.copy_(loaded)


class Embedding(Plain):
    """Rows padded to a multiple of 64, the padding zero-filled by the loader (vLLM's VocabParallelEmbedding)."""

    def __init__(self):
        super().__init__(PADDED, HIDDEN)
        self.weight.weight_loader = self.load

    def load(self, param: torch.Tensor, loaded: torch.Tensor) -> None:
        param.data[:loaded.shape[0]].copy_(loaded)
        param.data[loaded.shape[0]:].fill_(0)


class Experts(nn.Module):
    """Experts stacked by expert id: w13 (gate rows, then up rows) and w2 (vLLM's FusedMoE)."""

    def __init__(self):
        super().__init__()
        self.w13_weight = nn.Parameter(torch.zeros(EXPERTS, 2 * INTER, HIDDEN), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.zeros(EXPERTS, HIDDEN, INTER), requires_grad=False)
        for p in (self.w13_weight, self.w2_weight):
            p.weight_loader = self.load

    def load(self, param: torch.Tensor, loaded: torch.Tensor, shard: str, expert: int) -> None:
        if shard == "w2":
            param.data[expert].copy_(loaded)
        else:
            param.data[expert].narrow(0, 0 if shard == "w1" else INTER, INTER).copy_(loaded)


class FusedCheckpoint(Fused):
    """A fused layer whose checkpoint tensor is fused too (a Qwen2.5-VL vision block's ``attn.qkv``): the loader cuts
    the one tensor it gets into its shards itself."""

    def load(self, param: torch.Tensor, loaded: torch.Tensor, shard: str | None = None) -> None:
        for start, size in self.offsets.values():
            param.data.narrow(0, start, size).copy_(loaded.narrow(0, start, size))


class UnquantizedMethod:
    """Post-load processing that keeps the bytes where they are (vLLM's unquantized layers on a GPU)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.weight.data = layer.weight.data  # the same tensor: nothing a copy misses


class PackedMethod:
    """Post-load processing that keeps a packed copy beside the weight (vLLM's CPU build: a oneDNN handle)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        layer.packed = layer.weight.t().contiguous()


class Scaled(Plain):
    """A loader that writes a computed tensor, not a copy of the one sent."""

    def __init__(self, *shape: int):
        super().__init__(*shape)
        self.weight.weight_loader = lambda param, loaded: param.data.copy_(loaded * 2)


class Absorbing(nn.Module):
    """A weightless layer whose processing derives a tensor from another layer's weight (MLA's absorbed weights)."""

    def __init__(self, source: nn.Module):
        super().__init__()
        self.source = [source]

    def process_weights_after_loading(self) -> None:
        self.absorbed = self.source[0].weight[:HEAD_DIM].clone()


class FakeEngineModel(nn.Module):
    """Two decoder layers (the second a mixture of experts), tied head, vLLM's names and fused layouts. As vLLM 0.25
    builds them: a tied head is the embedding module registered a second time, and the MoE block's router gate is
    registered again inside its experts (0.25's MoERunner holds it as its own child). ``head=False``: no head here
    (a wrapper holds it, as vLLM's ``...ForCausalLM`` does around its ``model``); ``defer``: each layer's loaders
    run once all of its tensors have arrived, as vLLM's layerwise reload runs them (a layer split across buckets
    is written while a later bucket is the current one)."""

    def __init__(self, packed_head_layer: bool = True, scaled: bool = False, absorbing: bool = False,
                 untied: bool = False, vision: bool = False, head: bool = True, defer: bool = False):
        super().__init__()
        self.embed_tokens = Embedding()
        if head:
            self.lm_head = Embedding() if untied else self.embed_tokens  # tied: the embedding itself, as vLLM does
        self.defer, self.pending, self.expected = defer, {}, {}
        if vision:  # one vision block (fused qkv in the checkpoint too) and the merger's projection
            self.visual = nn.Module()
            block = nn.Module()
            block.qkv = FusedCheckpoint({"q": VISION, "k": VISION, "v": VISION}, VISION, bias=True)
            block.proj = Plain(VISION, VISION)
            self.visual.blocks = nn.ModuleList([block])
            self.visual.merger = Plain(HIDDEN, VISION)
        self.layers = nn.ModuleList()
        for i in range(2):
            layer = nn.Module()
            layer.qkv_proj = Fused({"q": HEADS * HEAD_DIM, "k": KV_HEADS * HEAD_DIM, "v": KV_HEADS * HEAD_DIM},
                                   HIDDEN, bias=True)
            layer.o_proj = Plain(HIDDEN, HEADS * HEAD_DIM)
            layer.input_layernorm, layer.post_attention_layernorm = Plain(HIDDEN), Plain(HIDDEN)
            if i == 0:
                layer.gate_up_proj = Fused({"gate": INTER, "up": INTER}, HIDDEN)
                layer.down_proj = Scaled(HIDDEN, INTER) if scaled else Plain(HIDDEN, INTER)
            else:
                layer.gate = Plain(EXPERTS, HIDDEN)
                layer.experts = Experts()
                layer.experts.gate = layer.gate  # the runner's second path to the router
            if absorbing and i == 1:
                layer.attn = Absorbing(layer.qkv_proj)
            self.layers.append(layer)
        shared = UnquantizedMethod()  # one method object serving several layers, as a quant config may hand out
        for layer in self.layers:
            layer.input_layernorm.quant_method = layer.post_attention_layernorm.quant_method = shared
        if packed_head_layer:
            self.layers[0].o_proj.quant_method = PackedMethod()
        self.norm = Plain(HIDDEN)

    def route(self, name: str) -> tuple[nn.Module, nn.Parameter, tuple]:
        """HF name -> (layer, parameter, loader arguments), as vLLM's stacked-parameter mapping does."""
        parts = name.removeprefix("model.").split(".")
        if parts[0] in ("embed_tokens", "norm", "lm_head"):
            target, args = getattr(self, parts[0]), ()
        elif parts[0] == "visual":  # visual.blocks.0.attn.qkv.weight, visual.merger.mlp.0.weight
            target = self.visual.merger if parts[1] == "merger" else getattr(self.visual.blocks[int(parts[2])],
                                                                               parts[4])
            args = ()
        else:
            layer, rest = self.layers[int(parts[1])], parts[2:-1]  # e.g. [self_attn, q_proj], [mlp, gate]
            kind = rest[-1]
            if kind in ("q_proj", "k_proj", "v_proj"):
                target, args = layer.qkv_proj, (kind[0],)
            elif rest[:2] == ["mlp", "experts"]:
                shard = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}[kind]
                param = layer.experts.w2_weight if shard == "w2" else layer.experts.w13_weight
                return layer.experts, param, (shard, int(rest[2]))
            elif kind in ("gate_proj", "up_proj"):
                target, args = layer.gate_up_proj, (kind.removesuffix("_proj"),)
            else:  # o_proj, down_proj, the router (mlp.gate), the norms
                target, args = getattr(layer, kind), ()
        return target, getattr(target, parts[-1]), args

    def expect(self, weights) -> None:
        """The tensors each layer waits for (``defer``)."""
        self.expected = {}
        for name, _ in weights:
            layer = self.route(name)[0]
            self.expected[layer] = self.expected.get(layer, 0) + 1

    def load_weights(self, weights) -> set[str]:
        """Each tensor through its parameter's loader; returns the engine names written (vLLM's contract)."""
        own = {id(p): n for n, p in self.named_parameters()}
        loaded = set()
        for name, tensor in weights:
            layer, param, args = self.route(name)
            calls = [(param, tensor, args)]
            if self.defer:
                self.pending.setdefault(layer, []).append(calls[0])
                if len(self.pending[layer]) < self.expected[layer]:
                    continue
                calls = self.pending.pop(layer)
            for param, tensor, args in calls:
                param.weight_loader(param, tensor, *args)
                loaded.add(own[id(param)])
        return loaded

    def process(self) -> None:
        """What vLLM runs after loading: each layer's quant method's processing, then the weightless layers'."""
        for module in self.modules():
            method = getattr(module, "quant_method", None)
            if method is not None:
                method.process_weights_after_loading(module)
        for module in self.modules():
            if isinstance(module, Absorbing):
                module.process_weights_after_loading()


def hf_weights(seed: int, untied: bool = False, vision: bool = False) -> list[tuple[str, torch.Tensor]]:
    """A Qwen2-style checkpoint (q/k/v biases) whose second layer is a Qwen3-MoE block, in HF names, random values;
    ``untied``: with its own lm_head.weight; ``vision``: a Qwen2.5-VL-style vision block and merger first."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g)

    out = [("model.embed_tokens.weight", r(VOCAB, HIDDEN))]
    for i in range(2):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", r(HEADS * HEAD_DIM, HIDDEN)),
                (p + "self_attn.q_proj.bias", r(HEADS * HEAD_DIM)),
                (p + "self_attn.k_proj.weight", r(KV_HEADS * HEAD_DIM, HIDDEN)),
                (p + "self_attn.k_proj.bias", r(KV_HEADS * HEAD_DIM)),
                (p + "self_attn.v_proj.weight", r(KV_HEADS * HEAD_DIM, HIDDEN)),
                (p + "self_attn.v_proj.bias", r(KV_HEADS * HEAD_DIM)),
                (p + "self_attn.o_proj.weight", r(HIDDEN, HEADS * HEAD_DIM)),
                (p + "input_layernorm.weight", r(HIDDEN)), (p + "post_attention_layernorm.weight", r(HIDDEN))]
        if i == 0:
            out += [(p + "mlp.gate_proj.weight", r(INTER, HIDDEN)), (p + "mlp.up_proj.weight", r(INTER, HIDDEN)),
                    (p + "mlp.down_proj.weight", r(HIDDEN, INTER))]
        else:
            out += [(p + "mlp.gate.weight", r(EXPERTS, HIDDEN))]
            for e in range(EXPERTS):
                out += [(p + f"mlp.experts.{e}.gate_proj.weight", r(INTER, HIDDEN)),
                        (p + f"mlp.experts.{e}.up_proj.weight", r(INTER, HIDDEN)),
                        (p + f"mlp.experts.{e}.down_proj.weight", r(HIDDEN, INTER))]
    # the embedding mid-bucket: the padding's zeros belong to it, not to the bucket's first tensor
    out = out[1:4] + out[:1] + out[4:] + [("model.norm.weight", r(HIDDEN))]
    if untied:
        out.append(("lm_head.weight", r(VOCAB, HIDDEN)))
    if vision:
        out = [("model.visual.blocks.0.attn.qkv.weight", r(3 * VISION, VISION)),
               ("model.visual.blocks.0.attn.qkv.bias", r(3 * VISION)),
               ("model.visual.blocks.0.attn.proj.weight", r(VISION, VISION)),
               ("model.visual.merger.mlp.0.weight", r(HIDDEN, VISION))] + out
    return out


def bucketed(weights, size: int = 5) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Buckets cut from one flat buffer each, as the sync's gathers hand them (tensors share a storage), one at a
    time: a bucket no one holds is freed before the next is made."""
    for i in range(0, len(weights), size):
        chunk = weights[i:i + size]
        flat = torch.cat([t.reshape(-1) for _, t in chunk])
        views, start = [], 0
        for name, t in chunk:
            views.append((name, flat[start:start + t.numel()].view(t.shape)))
            start += t.numel()
        yield views


def record(model: FakeEngineModel, weights, size: int = 5) -> SyncPlan:
    recorder = Recorder(model)
    model.expect(weights)
    with recorder.watching_processing(model):
        for bucket in bucketed(weights, size):
            recorder.sending(bucket)
            with recorder:
                model.load_weights(bucket)
            del bucket
        with recorder:
            model.process()
    assert not model.pending  # every deferred layer written
    return recorder.build(model, tensor_names(model))


def proved(model: FakeEngineModel, weights) -> SyncPlan:
    """Recorded from the loader, then proved with the same weights (the engine's first sync)."""
    plan = record(model, weights)
    plan.scramble()
    for bucket in bucketed(weights):
        for name, tensor in bucket:
            if plan.takes(name, tensor):
                plan.write(name, tensor)
    plan.prove()
    return plan


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("untied, vision", [(False, False), (True, False), (False, True)],
                         ids=["tied", "untied", "vision"])
def test_the_plan_writes_what_the_loader_writes_in_vllms_fused_layouts(untied, vision):
    engine = FakeEngineModel(untied=untied, vision=vision)
    plan = proved(engine, hf_weights(0, untied, vision))
    # everything but the packed layer's weight goes through plain copies; the packed layer keeps its loader
    assert plan.loader == {"model.layers.0.self_attn.o_proj.weight"}, plan.loader
    assert list(plan.fallback.values()) == ["its post-load processing makes new tensors (aten.clone.default)"]
    assert "proved bit for bit" in plan.summary() and "1 layer: its post-load processing makes" in plan.summary()
    qkv = plan.writes["model.layers.1.self_attn.k_proj.weight"]
    assert len(qkv) == 1 and qkv[0].name == "layers.1.qkv_proj.weight" and qkv[0].view.shape == (32, HIDDEN)
    assert len(plan.writes["model.embed_tokens.weight"]) == 2  # the rows, and the padding's zeros
    if untied:
        assert len(plan.writes["lm_head.weight"]) == 2 and plan.writes["lm_head.weight"][0].name == "lm_head.weight"
    if vision:  # one checkpoint tensor cut into three destinations by its loader
        assert [t.view.shape for t in plan.writes["model.visual.blocks.0.attn.qkv.weight"]] == [(VISION, VISION)] * 3
    # a later sync: new weights through the plan (and the loader for the rest) equal the loader alone, bit for bit
    reference = FakeEngineModel(untied=untied, vision=vision)  # a loader-only engine (every tensor written below)
    new = hf_weights(1, untied, vision)
    reference.load_weights(new)
    for bucket in bucketed(new):
        for name, tensor in bucket:
            if plan.takes(name, tensor):
                plan.write(name, tensor)
            else:
                engine.load_weights([(name, tensor)])
    ours, theirs = state(engine), state(reference)
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name].view(torch.int32), theirs[name].view(torch.int32)), name
    assert torch.equal(engine.lm_head.weight, engine.embed_tokens.weight) is not untied  # tied: the embedding itself
    assert not engine.embed_tokens.weight[VOCAB:].any()  # the padding rows
    assert plan.valid()


def test_a_plan_that_misses_bytes_fails_its_proof_and_its_layer_keeps_the_loader():
    engine = FakeEngineModel(packed_head_layer=False)
    weights = hf_weights(2)
    plan = record(engine, weights)
    loaded = state(engine)
    plan.writes["model.layers.0.self_attn.v_proj.weight"].clear()  # a plan that would leave v's rows stale
    plan.writes["model.layers.0.self_attn.v_proj.weight"].append(
        plan.writes.pop("model.layers.0.self_attn.k_proj.weight")[0])  # ... and write k's rows from v
    plan.scramble()
    for name, tensor in weights:
        if plan.takes(name, tensor):
            plan.write(name, tensor)
    failed = plan.prove()
    assert [type(m).__name__ for m in failed] == ["Fused"] and failed[engine.layers[0].qkv_proj].startswith(
        "the plan's copy of weight differs")
    # what the loader wrote is back, and every name writing into that qkv goes through the loader from now on
    for name, tensor in state(engine).items():
        assert torch.equal(tensor.view(torch.int32), loaded[name].view(torch.int32)), name
    assert {f"model.layers.0.self_attn.{x}_proj.{k}" for x in "qv" for k in ("weight", "bias")} <= plan.loader
    assert "model.layers.1.self_attn.q_proj.weight" in plan.writes  # the other layer's qkv keeps the plan


def test_a_loader_that_computes_and_processing_that_derives_keep_the_loader():
    engine = FakeEngineModel(packed_head_layer=False, scaled=True)
    plan = record(engine, hf_weights(3))
    assert "model.layers.0.mlp.down_proj.weight" in plan.loader
    assert plan.fallback[engine.layers[0].down_proj].startswith("its loader writes weight from a tensor the sync "
                                                                "did not send")
    # a weightless layer whose processing reads a synced weight: the whole model keeps the loader
    plan = record(FakeEngineModel(packed_head_layer=False, absorbing=True), hf_weights(3))
    assert not plan.writes and "Absorbing's post-load processing reads synced weights" in plan.summary()


def test_the_plan_sees_its_tensors_move():
    engine = FakeEngineModel(packed_head_layer=False)
    plan = proved(engine, hf_weights(4))
    assert plan.valid()
    engine.norm.weight = nn.Parameter(engine.norm.weight.detach().clone(), requires_grad=False)
    assert not plan.valid()


def test_a_plans_checks_read_its_targets_once_and_still_see_a_move(monkeypatch):
    """valid() and takes() (issue 74, 1): the layers' tensors the plan writes and the lengths its copies need are read
    once, not a dict of a layer's tensors rebuilt and every target's extent summed at each sync (about 2 ms of Python a
    sync of the 0.5B shape). Each agrees with its plain reference, and valid() still sees a layer's tensor replaced
    (a new object) or moved (its storage swapped under the same object)."""
    from lib.engine import plan as plan_module

    engine = FakeEngineModel(packed_head_layer=False)
    weights = hf_weights(40)
    plan = proved(engine, weights)
    assert plan.valid() and plan.valid_reference()
    calls = {"_tensors": 0, "_fits": 0}
    for name in calls:
        def counted(*args, _name=name, _fn=getattr(plan_module, name)):
            calls[_name] += 1
            return _fn(*args)
        monkeypatch.setattr(plan_module, name, counted)
    for _ in range(3):
        assert plan.valid()
        assert all(plan.takes(name, tensor) for name, tensor in weights)
    assert calls == {"_tensors": 0, "_fits": 0}, calls  # before (issue 74): 111 and 108 calls
    monkeypatch.undo()
    name, tensor = "model.layers.0.self_attn.q_proj.weight", dict(weights)["model.layers.0.self_attn.q_proj.weight"]
    for sent in (tensor, tensor[:-1], tensor.t().contiguous().t(), tensor.reshape(-1), tensor.new_empty(0),
                 torch.cat([tensor.reshape(-1), tensor.reshape(-1)])):
        assert plan.takes(name, sent) == plan.takes_reference(name, sent), sent.shape
    assert not plan.takes(name, tensor[:-1]) and not plan.takes("model.unknown.weight", tensor)
    # moved: the storage under the same parameter object; replaced: a new parameter
    norm = engine.layers[1].input_layernorm.weight
    norm.data = norm.data.clone()
    assert not plan.valid() and not plan.valid_reference()
    plan = proved(engine, weights)
    assert plan.valid()
    engine.layers[0].qkv_proj.bias = nn.Parameter(engine.layers[0].qkv_proj.bias.detach().clone(), requires_grad=False)
    assert not plan.valid() and not plan.valid_reference()


def test_a_failed_proof_drops_its_names_from_takes():
    """The proof reads writes again after dropping a failed layer's names: takes() and valid() answer for what is
    left (a cache kept from before the proof would still take them)."""
    engine = FakeEngineModel(packed_head_layer=False)
    weights = hf_weights(41)
    plan = record(engine, weights)
    plan.writes["model.layers.0.self_attn.v_proj.weight"].clear()  # a plan that leaves v's rows stale
    plan.writes["model.layers.0.self_attn.v_proj.weight"].append(
        plan.writes.pop("model.layers.0.self_attn.k_proj.weight")[0])
    plan.scramble()
    for name, tensor in weights:
        if plan.takes(name, tensor):
            plan.write(name, tensor)
    assert plan.takes("model.layers.0.self_attn.q_proj.weight", dict(weights)["model.layers.0.self_attn.q_proj.weight"])
    plan.prove()
    for name, tensor in weights:
        assert plan.takes(name, tensor) == plan.takes_reference(name, tensor) == (name in plan.writes), name
    assert not plan.takes("model.layers.0.self_attn.q_proj.weight", dict(weights)["model.layers.0.self_attn.q_proj.weight"])
    assert plan.valid() and plan.valid_reference()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_cast_happens_inside_the_copy(dtype):
    """The trainer may send fp32 into a bf16 engine tensor: the copy casts, as the loader's copy_ does."""
    engine = FakeEngineModel(packed_head_layer=False).to(dtype)
    weights = [(n, t.to(dtype)) for n, t in hf_weights(5)]
    plan = proved(engine, weights)
    fp32 = hf_weights(6)
    reference = FakeEngineModel(packed_head_layer=False).to(dtype)
    reference.load_weights(fp32)
    for name, tensor in fp32:
        plan.write(name, tensor)
    for name, tensor in state(engine).items():
        assert torch.equal(tensor, state(reference)[name]), name


# ---- the sync's states (lib.engine.vllm_sync) over fakes laid out as vLLM 0.25 and 0.32 lay models out


class LanguageModel(nn.Module):
    """vLLM's ``...ForCausalLM`` around its ``model``: a tied head registered as the embedding module itself (0.25's
    Qwen2/Qwen3: ``self.lm_head = self.model.embed_tokens``) or a head module of its own sharing the embedding's
    parameter (0.32's ``ParallelLMHead.tie_weights``, 0.25's Qwen3-MoE)."""

    def __init__(self, head: str = "module", **kw):
        super().__init__()
        self.model = FakeEngineModel(head=False, **kw)
        if head == "module":
            self.lm_head = self.model.embed_tokens
        else:
            self.lm_head = Embedding()
            self.lm_head.weight = self.model.embed_tokens.weight

    def load_weights(self, weights) -> set[str]:
        return {f"model.{n}" for n in self.model.load_weights(weights)}


class VisionLanguage(nn.Module):
    """vLLM's Qwen2.5-VL / Qwen3-VL top level (0.25 and 0.32 alike): no ``lm_head`` of its own, only its language
    model's (``get_language_model()``)."""

    def __init__(self, head: str = "module", **kw):
        super().__init__()
        self.language_model = LanguageModel(head, **kw)

    def get_language_model(self) -> nn.Module:
        return self.language_model

    def load_weights(self, weights) -> set[str]:
        return {f"language_model.{n}" for n in self.language_model.load_weights(weights)}


def inner(top: nn.Module) -> FakeEngineModel:
    return top if isinstance(top, FakeEngineModel) else inner(getattr(top, "language_model", None) or top.model)


def engine_sync(top: nn.Module, use_plan: bool = True, dtype: torch.dtype | None = None) -> EngineSync:
    """EngineSync over a fake: the reload's close runs the layers' processing, as vLLM's finalize does."""
    def reload(begin: bool, layers) -> None:
        if not begin:
            inner(top).process()
    return EngineSync(lambda fn: fn(top), reload, frozenset(n for n, _ in top.named_parameters()), tied_head=True,
                      use_plan=use_plan, dtype=dtype)


def sync(es: EngineSync, top: nn.Module | None, weights, size: int = 5) -> int:
    """One sync as lib.sync.sync_weights runs it (again while finish asks), then the KV wake's close. Returns the
    passes. ``top``: the fake engine model told what each layer waits for (None: a reload that counts for itself)."""
    if top is not None:
        inner(top).expect(weights)
    passes, again = 0, True
    while again:
        for bucket in bucketed(weights, size):
            es.load(bucket)
        again = es.finish()
        passes += 1
    es.finish_load()
    return passes


def assert_holds(top: nn.Module, weights) -> None:
    """The engine's tensors are the sent weights, as vLLM's loader alone writes them (padding rows zero)."""
    reference = FakeEngineModel(packed_head_layer=False)
    reference.load_weights(weights)
    theirs = state(reference)
    for name, tensor in state(inner(top)).items():
        assert torch.equal(tensor.view(torch.int32), theirs[name].view(torch.int32)), name
    head = top.get_language_model().lm_head if isinstance(top, VisionLanguage) else top.lm_head
    assert torch.equal(head.weight, inner(top).embed_tokens.weight)


@pytest.mark.parametrize("layout", ["causal-lm", "vision-language"])
@pytest.mark.parametrize("head", ["module", "shared"], ids=["head-is-embedding", "head-shares-parameter"])
def test_syncs_of_a_tied_model_as_vllm_lays_it_out_write_every_parameter(layout, head):
    """Issue 63, 1-3: the plan names a tensor by its first path, as named_parameters() does (a tied head that is the
    embedding module, the MoE runner's second path to the router); before, the second sync raised "left 1 vLLM
    parameters unwritten: ['model.embed_tokens.weight']". A vision-language top level has no lm_head of its own:
    the head is its language model's (before: AttributeError at the first sync, with or without the plan)."""
    top = (LanguageModel if layout == "causal-lm" else VisionLanguage)(head, packed_head_layer=False)
    es = engine_sync(top)
    for step in range(3):
        weights = hf_weights(10 + step)
        assert sync(es, top, weights) == (2 if step == 0 else 1)
        assert_holds(top, weights)
        if step:
            assert es.counts == {"plan": len(weights), "loader": 0}, es.counts  # the whole model through the plan
    named = {n for n, _ in top.named_parameters()}
    reported = {t.name for targets in es.plan.writes.values() for t in targets}
    assert reported <= named, reported - named
    router = [n for n in reported if n.endswith("layers.1.gate.weight")]
    assert len(router) == 1 and ".experts." not in router[0]
    # the loader alone, every sync: the tied head loaded through its own layer where it has one
    top = (LanguageModel if layout == "causal-lm" else VisionLanguage)(head, packed_head_layer=False)
    es = engine_sync(top, use_plan=False)
    for step in range(2):
        assert sync(es, top, hf_weights(20 + step)) == 1
        assert_holds(top, hf_weights(20 + step))


@pytest.mark.parametrize("wide", [False, True], ids=["all-bf16", "norm-kept-fp32"])
@pytest.mark.parametrize("head", ["module", "shared"], ids=["head-is-embedding", "head-shares-parameter"])
def test_fp32_shards_sent_uncast_reach_a_bf16_engine_as_a_cast_does(head, wide):
    """lib.sync sends a whole fp32 shard uncast: the plan's foreach copy casts it, and whatever goes through vLLM's
    loader (the record sync, the tied head, a layer that keeps the loader) is cast to the engine's dtype first (its
    loaders are written for it). Three syncs of fp32 weights into a bf16 engine: the loader sees bf16 only, the plan
    takes every tensor from the second sync on, and the engine holds, bit for bit, what the loader alone writes from
    the weights cast to bf16. An engine tensor kept in fp32 (``wide``: the final norm) gets the bf16-rounded value
    through the plan as through the loader (else the proof fails and its layer keeps the loader every sync)."""
    def engine_model(top):
        if wide:
            inner(top).norm.weight.data = inner(top).norm.weight.data.float()
        return top

    top = engine_model(LanguageModel(head, packed_head_layer=False).to(torch.bfloat16))
    seen: list[torch.dtype] = []
    loader = top.load_weights
    top.load_weights = lambda weights: (seen.extend(t.dtype for _, t in weights), loader(weights))[1]
    es = engine_sync(top, dtype=torch.bfloat16)
    for step in range(3):
        weights = hf_weights(50 + step)
        assert all(t.dtype == torch.float32 for _, t in weights)
        assert sync(es, top, weights) == (2 if step == 0 else 1)
        if step:
            assert es.counts == {"plan": len(weights), "loader": 0}, es.counts
        reference = engine_model(FakeEngineModel(packed_head_layer=False).to(torch.bfloat16))
        reference.load_weights([(n, t.to(torch.bfloat16)) for n, t in weights])
        for name, tensor in state(inner(top)).items():
            kept = torch.float32 if wide and name == "norm.weight" else torch.bfloat16
            assert tensor.dtype == kept and torch.equal(tensor, state(reference)[name]), (step, name)
        assert torch.equal(top.lm_head.weight, inner(top).embed_tokens.weight)
    assert seen and set(seen) == {torch.bfloat16}, set(seen)


def test_a_sync_plan_names_nothing_named_parameters_does_not():
    """The check behind issue 63's first two failures: what the plan reports is what named_parameters() names."""
    model = FakeEngineModel()
    plan = proved(model, hf_weights(7))
    named = {n for n, _ in model.named_parameters()}
    assert {t.name for targets in plan.writes.values() for t in targets} <= named
    assert plan.writes["model.embed_tokens.weight"][0].name == "embed_tokens.weight"


def test_a_layer_split_across_buckets_and_loaded_late_keeps_the_plan():
    """Issue 63, 4: vLLM's layerwise reload runs a layer's loaders once all of it has arrived, so q (bucket k) is
    copied while bucket k+1 is current. The recorder knows every sent tensor that still lives; before, it knew only
    the current bucket and the fused qkv kept the loader, "from a tensor the sync did not send"."""
    for size in (3, 5, 7):  # cuts between q, k and v, and between gate and up
        engine = FakeEngineModel(defer=True)
        plan = record(engine, hf_weights(8), size)
        assert plan.loader == {"model.layers.0.self_attn.o_proj.weight"}, (size, plan.fallback)
    # the same through the engine's states, a tied model split every three tensors, three syncs
    top = LanguageModel(packed_head_layer=False, defer=True)
    es = engine_sync(top)
    for step in range(3):
        assert sync(es, top, hf_weights(30 + step), size=3) == (2 if step == 0 else 1)
        assert_holds(top, hf_weights(30 + step))
    assert not es.plan.fallback and not es.plan.loader


def test_a_sync_keeps_no_embedding_and_a_closed_engine_no_plan():
    """Issue 63, 5: the sent embedding is let go when the proof ends (before: kept through the first rollout), never
    taken under a plan that writes the head; close() drops the plan (its views hold the engine's weights)."""
    top = LanguageModel(packed_head_layer=False)
    es = engine_sync(top)
    sync(es, top, hf_weights(40))
    assert es.embedding is None and es.state == "ready"
    weights = hf_weights(41)
    es.load(weights[:4])  # the embedding among them
    assert es.embedding is None
    es.load(weights[4:])
    es.finish()
    es.close()
    assert es.plan is None and es.recorder is None and es.state == "off"


def test_a_loader_that_does_not_say_what_it_wrote_beside_the_plan():
    """Issue 63, 5: a loader returning None (nothing to check against) in a sync whose later buckets go through the
    plan; before, the next plan write raised TypeError (None |= set)."""
    top = LanguageModel()  # the packed o_proj keeps the loader
    es = engine_sync(top)
    sync(es, top, hf_weights(50))
    top.load_weights = lambda weights, own=top.load_weights: own(weights) and None
    weights = hf_weights(51)
    order = sorted(weights, key=lambda w: "o_proj" not in w[0])  # the loader's tensor first, then the plan's
    for bucket in bucketed(order, 5):
        es.load(bucket)
    es.finish()
    es.finish_load()
    assert es.written is None and es.counts == {"plan": len(weights) - 1, "loader": 1}


class ScaleFromWeights(nn.Module):
    """A loader that sets a tensor to a value it reads from the sent one (vLLM 0.25's mllama4: ``fill_(x.item())``)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(4), requires_grad=False)
        self.weight = nn.Parameter(torch.zeros(4, 4), requires_grad=False)

    def load_weights(self, weights) -> set[str]:
        for name, tensor in weights:
            if name == "scale":  # the value read first, a copy between, then the fill
                value = tensor.reshape(-1)[0].item()
                self.scale.data[:1].copy_(tensor)
                self.scale.data[1:].fill_(value)
            elif name == "staged":  # through a tensor of the loader's own
                staging = torch.empty_like(tensor)
                staging.copy_(tensor)
                self.weight.data.copy_(staging)
            else:
                self.weight.data.copy_(tensor)
        return {n for n, _ in weights}


def test_a_fill_with_a_value_read_from_the_weights_keeps_the_loader():
    """Issue 63, 5: the proof sends the same weights, so a value read out of them looks constant to it; the recorder
    marks the layer instead (before: replayed with the first sync's value forever)."""
    model = ScaleFromWeights()
    recorder = Recorder(model)
    weights = [("weight", torch.randn(4, 4)), ("scale", torch.tensor([0.5]))]
    recorder.sending(weights)
    with recorder:
        model.load_weights(weights)
    plan = recorder.build(model, tensor_names(model))
    assert "scale" in plan.loader and "weight" in plan.loader  # one layer: both keep the loader
    assert plan.fallback[model].startswith("its loader fills scale with a value read from a sent tensor")


def test_a_moe_runners_fused_router_follows_the_synced_gates():
    """vLLM's MoE runner caches cat(gate, shared-expert gate) at its first forward (ROCm's fused shared experts:
    Qwen3-Next, Qwen3.5-MoE) and no reload refreshes it: after a sync the engine refreshes it in place."""
    from lib.engine.vllm_adapter import refresh_fused_gates

    runner = nn.Module()
    runner.gate, runner.shared_expert_gate = Plain(EXPERTS, HIDDEN), Plain(1, HIDDEN)
    runner._combined_gate_weight = torch.zeros(EXPERTS + 1, HIDDEN)  # as made from the dummy weights
    cached = runner._combined_gate_weight
    model = nn.Sequential(runner, Plain(HIDDEN))
    with torch.no_grad():  # a sync writes the gates
        runner.gate.weight.normal_()
        runner.shared_expert_gate.weight.normal_()
    assert refresh_fused_gates(model) == 1 and runner._combined_gate_weight is cached
    assert torch.equal(cached, torch.cat([runner.gate.weight, runner.shared_expert_gate.weight]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_buckets_copies_in_one_foreach_equal_one_copy_each(dtype):
    """SyncPlan.write_all (one torch._foreach_copy_ a bucket, casting inside it) against write, its plain reference:
    the same bits in every engine tensor, fp32 sent into the engine's dtype."""
    engines = [FakeEngineModel(packed_head_layer=False).to(dtype) for _ in range(2)]
    plans = [proved(e, [(n, t.to(dtype)) for n, t in hf_weights(60)]) for e in engines]
    for bucket in bucketed(hf_weights(61), 7):
        plans[0].write_all(bucket)
        for name, tensor in bucket:
            plans[1].write(name, tensor)
    ours, theirs = state(engines[0]), state(engines[1])
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name


def test_a_loader_that_stages_a_sent_tensor_keeps_the_whole_model_on_the_loader():
    """A loader copying a sent tensor into a tensor no layer holds (a staging buffer): the plan cannot follow the
    bytes, so no part of the model is replayed, said in one line (before: TypeError in the recorder)."""
    model = ScaleFromWeights()
    recorder = Recorder(model)
    weights = [("staged", torch.randn(4, 4))]
    recorder.sending(weights)
    with recorder:
        model.load_weights(weights)
    plan = recorder.build(model, tensor_names(model))
    assert not plan.writes and "a loader copies staged into a tensor that no layer holds" in plan.summary()
