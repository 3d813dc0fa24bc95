"""Rollout routing replay (lib/routing): the replayed forward against the native one, the families' gate weights by
hand, and routes that land on their own tokens through padding, packing, rebalancing, Ulysses and checkpointing."""

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from lib import routing
from lib.testing import run_distributed
from tests import zoo
from tests.helpers import rl_batch

FAMILIES = ["qwen3_moe", "deepseek_v3", "glm4_moe"]


@pytest.fixture(scope="module")
def moe_root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("moe_zoo"))


def _model(root: str, name: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(zoo.build(name, root), dtype=torch.float32)
    with torch.no_grad():  # routers off their zero init, so that the routes are the weights' own choice
        for router in routing.routers(model):
            router.weight.normal_(0.0, 0.5)
    routing.install(model)
    return model


def _batch(rows: int = 4, seed: int = 0):
    data = rl_batch(rows, prompt_len=9, response_len=6, seed=seed, min_response=2)
    b = data.batch
    b["input_ids"] = b["input_ids"] % (zoo.VOCAB - 8) + 3
    return data


def _forward(model, data, routes=None):
    b = data.batch
    with routing.use(model, routes):
        return model(input_ids=b["input_ids"], attention_mask=b["attention_mask"], position_ids=b["position_ids"]).logits


def _recorded(model, data) -> torch.Tensor:
    """(B * L, layers, k): the ids each router chose in a native forward, in the routers' token order."""
    with torch.no_grad(), routing.recording(model) as rec:
        _forward(model, data)
    return torch.stack([torch.cat(layer) for layer in rec], 1)


def _loss(logits: torch.Tensor) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return (logits * torch.randn(logits.shape, generator=g)).sum()


@pytest.mark.parametrize("name", FAMILIES)
def test_replaying_the_models_own_routes_is_the_native_forward(moe_root, name):
    """Record, then replay with the model's own routes: logits and every gradient, the routers' included, equal the
    native forward's (the replayed gate weights are gathered from the same probabilities)."""
    model = _model(moe_root, name)
    data = _batch()
    native = _forward(model, data)
    _loss(native).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    routes = _recorded(model, data)
    model.zero_grad()
    replayed = _forward(model, data, routes)
    _loss(replayed).backward()
    torch.testing.assert_close(replayed, native, rtol=0, atol=0)
    assert any("gate" in n for n in grads)
    for n, g in grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[n].grad, g, rtol=1e-6, atol=1e-7, msg=n)


def _by_hand(name: str, router, x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """The family's gate weights from the modeling code's formula, written out: Qwen3-MoE a softmax over all experts
    gathered at the ids (renormalised with norm_topk_prob); DeepSeek-V3 and GLM-4.5 a sigmoid gathered, normalised
    with an epsilon of 1e-20, times routed_scaling_factor."""
    logits = x.double() @ weight.double().T
    if name == "qwen3_moe":
        e = torch.exp(logits - logits.max(-1, keepdim=True).values)
        w = (e / e.sum(-1, keepdim=True)).gather(1, ids)
        return w / w.sum(-1, keepdim=True) if router.norm_topk_prob else w
    w = (1 / (1 + torch.exp(-logits))).gather(1, ids)
    if router.norm_topk_prob:
        w = w / (w.sum(-1, keepdim=True) + 1e-20)
    return w * router.routed_scaling_factor


@pytest.mark.parametrize("name", FAMILIES)
def test_a_different_router_gets_the_replayed_experts_and_the_familys_weights(moe_root, name):
    """The engine's routes replayed into a trainer whose routers differ (other weights, and for the sigmoid families
    another correction bias): every expert block receives exactly the replayed ids, and the gate weights and the
    routers' gradients are the family's formula computed by hand at those ids."""
    model = _model(moe_root, name)
    data = _batch(seed=3)
    routes = _recorded(model, data)
    with torch.no_grad():
        for router in routing.routers(model):
            router.weight.add_(torch.randn_like(router.weight))
            if hasattr(router, "e_score_correction_bias"):
                router.e_score_correction_bias.add_(torch.randn_like(router.e_score_correction_bias))
    gate_in, expert_in = [], []
    hooks = [r.register_forward_pre_hook(lambda m, a: gate_in.append(a[0].reshape(-1, a[0].shape[-1]).detach()))
             for r in routing.routers(model)]
    experts = [m for m in model.modules() if type(m).__name__.endswith("Experts")]
    assert len(experts) == len(routing.routers(model))

    def keep(module, args):
        args[2].retain_grad()
        expert_in.append(args)

    hooks += [m.register_forward_pre_hook(keep) for m in experts]
    _loss(_forward(model, data, routes)).backward()
    for h in hooks:
        h.remove()
    differ, compared = 0, 0
    for layer, (router, x, (_, ids, w)) in enumerate(zip(routing.routers(model), gate_in, expert_in)):
        assert torch.equal(ids, routes[:, layer]), layer
        weight = router.weight.detach().clone().requires_grad_(True)
        hand = _by_hand(name, router, x, weight, ids)
        torch.testing.assert_close(w.double(), hand, rtol=1e-5, atol=1e-6)  # fp32 against float64
        (grad,) = torch.autograd.grad(hand, weight, w.grad.double())
        torch.testing.assert_close(router.weight.grad.double(), grad.double(), rtol=1e-4, atol=1e-6)
        with torch.no_grad(), routing.use(model, None):  # the router's own choice
            own = router(x)[2]
        differ += int((own.sort(-1).values != ids.sort(-1).values).any(-1).sum())
        compared += ids.shape[0]
    assert differ > 0  # the other router would have chosen otherwise: the replay changed something
    # the flip count of a no-grad pass is the trainer's own choice against the replayed one
    routing.take_flips(model)
    with torch.no_grad():
        _forward(model, data, routes)
    assert routing.take_flips(model) == (differ, compared)


def test_routes_for_another_number_of_layers_are_an_error(moe_root):
    """One route layer per router: routes of another depth are refused (a mismatch would be a silent wrong model)."""
    model = _model(moe_root, "qwen3_moe")
    data = _batch()
    routes = _recorded(model, data)
    with pytest.raises(ValueError, match="routes for 1 MoE layers; the model has 2 routers"):
        _forward(model, data, routes[:, :1])
    with pytest.raises(RuntimeError, match="not aligned with the tokens"):
        _forward(model, data, routes[:-1])


def _coded(data, layers: int, k: int, experts: int) -> torch.Tensor:
    """Position-coded routes (B, L, layers, k): row b, column c, layer l go to experts (3c + b + l + j) mod E, j < k:
    a route that lands on another token sends it elsewhere."""
    rows, cols = data.batch["input_ids"].shape
    b = torch.arange(rows)[:, None, None, None]
    c = torch.arange(cols)[None, :, None, None]
    l_ = torch.arange(layers)[None, None, :, None]
    j = torch.arange(k)[None, None, None, :]
    return ((3 * c + b + l_ + j) % experts).to(torch.int16)


def _saved(root: str, name: str) -> str:
    """A zoo MoE model with its routers off their zero init, saved (for sharded builds)."""
    path = f"{root}/{name}_routed"
    model = _model(root, name)
    del model._routing
    model.save_pretrained(path)
    return path


def _experts(model) -> int:
    router = routing.routers(model)[0]
    return router.weight.shape[0]


def test_coded_routes_land_on_their_tokens_padded_packed_and_through_a_checkpointed_backward(moe_root):
    """Left-padded rows, packed rows and a gradient-checkpointed backward with position-coded routes: packed log-probs
    equal the padded ones (and both differ from the model's own routing), and the checkpointed backward's gradients
    equal the plain backward's (its recompute replays the same routes)."""
    from lib.forward import response_log_probs

    model = _model(moe_root, "qwen3_moe")
    data = _batch(rows=5, seed=7)
    state = routing.state_of(model)
    data.batch[routing.KEY] = _coded(data, state.layers, state.top_k, _experts(model))
    with torch.no_grad():
        padded, _ = response_log_probs(model, data, packed=False)
        packed, _ = response_log_probs(model, data, packed=True)
        own, _ = response_log_probs(model, data.select([k for k in data.batch if k != routing.KEY]), packed=True)
    torch.testing.assert_close(packed, padded, rtol=1e-5, atol=1e-5)
    assert (own - padded).abs().max() > 1e-2
    grads = {}
    for checkpointing in (False, True):
        model.zero_grad()
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        logp, _ = response_log_probs(model, data, packed=True)
        (logp * data.batch["response_mask"]).sum().backward()
        grads[checkpointing] = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for n, g in grads[False].items():
        torch.testing.assert_close(grads[True][n], g, rtol=1e-5, atol=1e-6, msg=n)


def _ranks_body(path: str, sp: int, rows: int):
    from lib.actor import compute_log_probs
    from lib.balance import balance_across_ranks
    from lib.config import BatchingConfig, FSDPConfig, ModelConfig
    from lib.dist import init_topology
    from lib.fsdp import build_sharded_model

    topo = init_topology(device="cpu", sp_size=sp)
    model = build_sharded_model(ModelConfig(path=path, gradient_checkpointing=True), FSDPConfig(), topo)
    state = routing.install(model)
    data = _batch(rows=rows, seed=7)
    data.batch[routing.KEY] = _coded(data, state.layers, state.top_k, _experts(model))
    data.batch["row"] = torch.arange(rows)
    dp_rank, dp_size = topo.rank // sp, topo.world_size // sp
    local = data[dp_rank * rows // dp_size:(dp_rank + 1) * rows // dp_size]
    if dp_size > 1:  # rows move between ranks by their lengths; their routes with them
        local, _ = balance_across_ranks(local, topo.dp_group)
    batching = BatchingConfig(use_dynamic_batching=True, max_tokens_per_rank=24)  # several reordered micro-batches
    logp, _ = compute_log_probs(model, local, batching, topo)
    return local.batch["row"], logp


@pytest.mark.parametrize("sp", [1, 2])
def test_coded_routes_land_on_their_tokens_across_ranks_and_sequence_parallel(moe_root, sp):
    """2 ranks: rows rebalanced between them (sp 1) or each sequence split over an SP group of 2 (Ulysses), dynamic
    micro-batches, gradient checkpointing: every row's log-probs with position-coded routes equal one process's
    padded forward of the same rows."""
    from lib.forward import response_log_probs

    path = _saved(moe_root, "qwen3_moe")
    rows = 6
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    state = routing.install(model)
    data = _batch(rows=rows, seed=7)
    data.batch[routing.KEY] = _coded(data, state.layers, state.top_k, _experts(model))
    with torch.no_grad():
        want, _ = response_log_probs(model, data, packed=False)
    seen = set()
    for got_rows, logp in run_distributed(_ranks_body, path, sp, rows, world_size=2):
        for i, r in enumerate(got_rows.tolist()):
            torch.testing.assert_close(logp[i], want[r], rtol=1e-5, atol=1e-5, msg=f"row {r}")
            seen.add(r)
    assert seen == set(range(rows))
