"""The start-up self-check on a model that trains in bf16 (FSDP2 mixed precision, as on every GPU run): it runs in
fp32 (lib.fsdp.fp32_compute), so a mixer blind to the packed bounds is caught at fp32's tolerance, and the model
computes in bf16 again afterwards. On the first GPU run the check ran in bf16 at tolerance 0.1 and measured 0.023
on the 0.5B shape: a leak like LFM2's (6.5e-5) passed unseen. Here the bf16 policy is FSDP2's own, on gloo."""

import pytest
import torch

from lib.testing import run_distributed
from tests import zoo


def _bf16_selfcheck(model_path: str, device: str = "cpu") -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from lib import fsdp, mixers, selfcheck
    from lib.config import FSDPConfig, ModelConfig
    from lib.dist import init_topology
    from lib.forward import response_log_probs

    topo = init_topology(device=device)
    plain = fsdp.build_sharded_model(ModelConfig(path=model_path), FSDPConfig(mixed_precision=False), topo,
                                     packed=True)
    if device == "cpu":  # the GPU's policy (lib.fsdp.compute_policy on CUDA), on CPU
        fsdp.compute_policy = lambda topo, mixed: MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                                       reduce_dtype=torch.float32)
    model = fsdp.build_sharded_model(ModelConfig(path=model_path), FSDPConfig(), topo, packed=True)
    rows = selfcheck.probe_rows(model.config.get_text_config().vocab_size).to(topo.device)
    mask = rows.batch["response_mask"].bool()

    def logp(m):
        return response_log_probs(m, rows, packed=True)[0].detach()

    with torch.no_grad():
        with fsdp.fp32_compute(plain):  # no mixed precision to switch: TF32 off only (a GPU's convolutions)
            fp32 = logp(plain)
        bf16 = logp(model)
        with fsdp.fp32_compute(model):
            passed = selfcheck.check_modes(model, topo, packed=True, dtype=torch.float32)
            under = logp(model)
        after = logp(model)
    # training still works in bf16 after the check: a forward and backward, gradients in fp32 on the fp32 shards
    loss = response_log_probs(model, rows, packed=True)[0][mask].sum()
    loss.backward()
    grads = {str(p.grad.dtype) for p in model.parameters() if p.grad is not None}
    for name in mixers.find(model):  # the model's own mixer again: blind to the packed bounds
        del model.get_submodule(name).forward
    with torch.no_grad():
        blind_bf16 = selfcheck.check_modes(model, topo, packed=True, dtype=torch.bfloat16)  # the old check
        try:
            with fsdp.fp32_compute(model):
                selfcheck.check_modes(model, topo, packed=True, dtype=torch.float32)
            refused = ""
        except ValueError as e:
            refused = str(e)
    return {"passed": [(r["mode"], r["max_diff"]) for r in passed], "refused": refused,
            "blind_bf16": [(r["mode"], r["max_diff"]) for r in blind_bf16],
            "fp32_vs_plain": float((under - fp32)[mask].abs().max()),
            "bf16_vs_plain": float((bf16 - fp32)[mask].abs().max()),
            "after_vs_bf16": float((after - bf16)[mask].abs().max()), "grads": sorted(grads)}


def _verdicts(results: list[dict]) -> None:
    for r in results:
        assert r["bf16_vs_plain"] > 1e-4, r  # the model really computes in bf16 (1.9e-3 measured)
        assert r["fp32_vs_plain"] < 1e-6, r  # inside fp32_compute: the fp32 model's own numbers
        assert r["after_vs_bf16"] == 0.0, r  # bf16 again after it, to the bit
        assert r["grads"] == ["torch.float32"], r
        assert [m for m, _ in r["passed"]] == ["packing"] and r["passed"][0][1] < 1e-5, r
        # a blind mixer: under bf16's tolerance the old check passed it; in fp32 it is refused
        assert r["blind_bf16"][0][1] < selfcheck_bf16_tolerance(), r
        assert "under packing" in r["refused"], r


@pytest.mark.parametrize("name", ["lfm2"])  # convolutions blind to the bounds leak least of the zoo (6.5e-5)
def test_the_self_check_runs_in_fp32_on_a_bf16_model_and_catches_a_small_leak(tmp_path, name):
    path = zoo.build(name, str(tmp_path))
    _verdicts(run_distributed(_bf16_selfcheck, path, world_size=2, timeout=300))


@pytest.mark.gpu
def test_the_self_check_runs_in_fp32_on_a_gpu(tmp_path):
    """The same on a GPU, with the run's own bf16 policy, FSDP2's CUDA kernels and torch's varlen attention in the
    bf16 forwards: lib.fsdp.fp32_compute reaches into FSDP2's state, so the torch of the GPU machine proves it."""
    path = zoo.build("lfm2", str(tmp_path))
    _verdicts(run_distributed(_bf16_selfcheck, path, "cuda", world_size=1, backend="nccl", timeout=300))


def selfcheck_bf16_tolerance() -> float:
    from lib.selfcheck import TOLERANCE

    return TOLERANCE[torch.bfloat16]


# ---- the fused LM head, decided from the model's own numbers (issue 57)


def falcon_h1(root: str) -> str:
    """A tiny Falcon-H1 (attention and Mamba-2 side by side in each layer; its forward multiplies the logits by
    lm_head_multiplier, a muP factor, after a plain linear head) with the zoo's tokenizer."""
    import os

    from transformers import AutoModelForCausalLM, FalconH1Config

    path = os.path.join(root, "falcon_h1")
    if not os.path.exists(os.path.join(path, "generation_config.json")):
        cfg = FalconH1Config(**{**zoo.COMMON, "mamba_d_ssm": 64, "mamba_n_heads": 4, "mamba_d_head": 16,
                                "mamba_d_state": 16, "mamba_n_groups": 1, "mamba_chunk_size": 16,
                                "tie_word_embeddings": False, "lm_head_multiplier": 0.5})
        torch.manual_seed(0)
        zoo._save(AutoModelForCausalLM.from_config(cfg, dtype=torch.float32), path)
    return path


def _head_verdicts(paths: dict[str, str], blind: bool) -> dict:
    """check_fused_head on each model (FSDP on this rank's world); ``blind``: without lib.forward's list of known
    logit scales (only the self-check then stands between such a model and wrong log-probs)."""
    from lib import forward, fsdp, selfcheck
    from lib.config import FSDPConfig, ModelConfig
    from lib.dist import init_topology

    if blind:
        forward.LOGIT_SCALES = ()
    topo = init_topology()
    out = {}
    for name, path in paths.items():
        model = fsdp.build_sharded_model(ModelConfig(path=path), FSDPConfig(), topo, packed=True)
        out[name] = selfcheck.check_fused_head(model, topo)
    return out


def test_every_zoo_architecture_on_the_fused_path_gets_its_own_log_probs_from_it(tmp_path):
    """The fused head's log-probs and entropy equal the whole logits' to fp32's tolerance on every architecture of
    the model zoo that takes the fused path (the others: known post-processing, never fused), on 2 ranks."""
    paths = {name: zoo.build(name, str(tmp_path)) for name in zoo.CASES}
    r0, _ = run_distributed(_head_verdicts, paths, False, world_size=2, timeout=900)
    fused = {n: v for n, v in r0.items() if v is not None}
    assert len(fused) >= 15, sorted(r0)  # most of the zoo takes the fused path
    for name, v in fused.items():
        assert v["fused"] and v["max_diff"] < 1e-5, (name, v)
    assert r0["gemma2"] is None  # a soft-cap: known, never fused


def test_a_head_whose_output_the_model_scales_is_caught_by_the_self_check_without_the_list(tmp_path):
    """Falcon-H1 (its muP multiplier, on no list) and Granite with lib.forward's list of known scales emptied: the
    self-check finds that the fused head is not the model's own head, so the run takes the whole logits."""
    paths = {"falcon_h1": falcon_h1(str(tmp_path)), "granite": zoo.build("qwen2_tied", str(tmp_path))}
    from transformers import AutoModelForCausalLM, GraniteConfig

    granite = tmp_path / "granite"
    torch.manual_seed(0)
    zoo._save(AutoModelForCausalLM.from_config(GraniteConfig(**{**zoo.COMMON, "logits_scaling": 4.0}),
                                               dtype=torch.float32), str(granite))
    paths["granite"] = str(granite)
    (r,) = run_distributed(_head_verdicts, paths, True, world_size=1, timeout=600)
    for name in ("falcon_h1", "granite"):
        assert r[name] is not None and not r[name]["fused"] and "changes" in r[name]["reason"], (name, r[name])


def test_the_fused_heads_default_is_the_whole_logits_on_a_gpu():
    """model.fused_head auto: the fused head on CPU (where bench/ measured it to help), the whole logits on a GPU
    (the H100 measured 0.97x tokens/s and a higher peak); on and off force either."""
    from lib.fsdp import fused_head_wanted

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert fused_head_wanted("auto", cpu) and not fused_head_wanted("auto", gpu)
    assert fused_head_wanted("on", gpu) and not fused_head_wanted("off", cpu)


@pytest.mark.parametrize("flags", [[], ["--trainer.sp_size", "2"]], ids=["fsdp", "sp2"])
def test_falcon_h1_trains_with_the_default_settings(tmp_path, flags):
    """Falcon-H1 with every default (fused_head auto on CPU, packing), 2 ranks, FSDP and Ulysses sp 2: it trains 2
    GRPO steps, the engine's log-probs match the trainer's, and the self-check's choice is in the log. Before, every
    run ended at its first forward ("does not use its LM head as a plain last layer")."""
    import json
    import subprocess

    from tests.helpers import child_env, forked_torchrun
    from tests.test_e2e import ROOT

    path = falcon_h1(str(tmp_path))
    cmd = forked_torchrun(2, "train_grpo.py", *zoo.grpo_args(path, str(tmp_path)), *flags)
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900, env=child_env())
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "self-check: fused LM head off for the policy's FalconH1ForCausalLM" in text, text[-4000:]
    rows = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    train = [r for r in rows if "actor/pg_loss" in r]
    assert len(train) == 2 and all(r["rollout/logp_abs_diff"] < 1e-5 and r["actor/grad_norm"] > 0 for r in train)


# ---- a mixture-of-experts model whose routes flip between two forwards (issue 58)


def _flipping_routes(path: str, replay: bool) -> dict:
    """The self-check (packing, then Ulysses sp 2) on a Qwen3-MoE whose routers pick the next expert in every forward
    over other tokens than the first one's (the padded forward's): a near-tie resolved one way in one forward and the
    other way in the next, made certain."""
    from lib import fsdp, routing, selfcheck
    from lib.config import FSDPConfig, ModelConfig
    from lib.dist import init_topology

    topo = init_topology(device="cpu", sp_size=2)
    model = fsdp.build_sharded_model(ModelConfig(path=path), FSDPConfig(), topo, packed=True)
    first: dict = {}

    def flip(router, args, out):
        logits, weights, ids = out
        if ids.shape[0] != first.setdefault("tokens", ids.shape[0]):
            return logits, weights, (ids + 1) % logits.shape[-1]
        return None

    for router in routing.routers(model):
        router.register_forward_hook(flip)
    try:
        passed = selfcheck.check_modes(model, topo, True, torch.float32, replay=replay)
        return {"passed": [r["mode"] for r in passed], "installed": routing.state_of(model) is not None}
    except ValueError as e:
        return {"refused": str(e), "installed": routing.state_of(model) is not None}


def test_routes_that_flip_between_forwards_are_named_as_the_routers_and_pass_under_replay(tmp_path):
    """Without replay the check refuses, naming the routers' near-ties (under one set of routes the modes agree)
    rather than "some layer mixes tokens across SP slices"; with routing replay it compares the modes under one set of
    routes, as training does, and passes both (packing and sp 2)."""
    path = zoo.build("qwen3_moe", str(tmp_path))
    off, _ = run_distributed(_flipping_routes, path, False, world_size=2)
    assert "refused" in off and "routers chose other experts between the two forwards" in off["refused"], off
    assert "--rollout.routing_replay" in off["refused"] and "mixes tokens" not in off["refused"].split("no layer")[0]
    assert not off["installed"]  # the check's own replay hooks are gone again
    on, _ = run_distributed(_flipping_routes, path, True, world_size=2)
    assert on.get("passed") == ["packing", "Ulysses sp_size 2"] and on["installed"], on
