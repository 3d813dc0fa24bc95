"""Hugging Face export: from a checkpoint (python -m lib.export) and at the end of a run (the same writer); the
folder loads with from_pretrained and gives the trained model's logits."""

import os

import pytest
import torch

from lib.testing import run_distributed
from tests.helpers import save_tiny_model


def _train_save_export(model_path, run_path):
    import yaml

    from lib import checkpoint, export
    from lib.config import FSDPConfig, ModelConfig, OptimConfig
    from lib.dist import init_topology
    from lib.fsdp import build_sharded_model
    from lib.optim import build_optimizer

    topo = init_topology(device="cpu")
    model = build_sharded_model(ModelConfig(path=model_path), FSDPConfig(), topo, packed=False)
    optimizer, scheduler = build_optimizer(model, OptimConfig(lr=1e-2))
    ids = torch.arange(3, 15).reshape(2, 6)
    model(input_ids=ids).logits.float().pow(2).mean().backward()  # move every weight away from the start model
    optimizer.step()
    if topo.is_main:
        os.makedirs(run_path, exist_ok=True)
        with open(os.path.join(run_path, "config.yaml"), "w") as f:
            yaml.safe_dump({"actor": {"model": {"path": model_path, "trust_remote_code": False}},
                            "critic": {"model": {"path": ""}}}, f)
    checkpoint.save(run_path, 1, {"actor": (model, optimizer)}, {}, topo)
    export.export_hf(model, model_path, os.path.join(run_path, "hf_final"), topo)
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


@pytest.mark.parametrize("arch,tied", [("qwen2", False), ("qwen3", True)])
def test_export_from_checkpoint_and_at_the_end_give_the_trained_logits(tmp_path, arch, tied):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lib import export
    from lib.toy import build_tokenizer

    model_path = save_tiny_model(str(tmp_path / "model"), arch, tie_word_embeddings=tied)
    build_tokenizer(model_path)
    run_path = str(tmp_path / "run")
    trained = run_distributed(_train_save_export, model_path, run_path)[0]
    assert export.main([os.path.join(run_path, "checkpoints", "step_1"), str(tmp_path / "exported")]) == 0
    assert export.main([run_path, str(tmp_path / "from_run")]) == 0  # a run folder: its latest checkpoint
    ids = torch.arange(3, 15).reshape(2, 6)
    start = AutoModelForCausalLM.from_pretrained(model_path)(input_ids=ids).logits
    assert (start - trained).abs().max() > 1e-3  # the step changed the model
    for folder in ("exported", "from_run", "run/hf_final"):
        out = str(tmp_path / folder)
        model = AutoModelForCausalLM.from_pretrained(out)
        with torch.no_grad():
            logits = model(input_ids=ids).logits
        assert (logits - trained).abs().max() < 1e-5, folder
        assert os.path.isfile(os.path.join(out, "generation_config.json"))
        assert AutoTokenizer.from_pretrained(out).padding_side == AutoTokenizer.from_pretrained(model_path).padding_side


def test_export_keeps_the_model_dtype_and_shards(tmp_path):
    from safetensors import safe_open

    from lib.export import write_hf
    from lib.toy import build_tokenizer

    model_path = save_tiny_model(str(tmp_path / "model"), "qwen2")
    build_tokenizer(model_path)
    import json

    cfg_path = os.path.join(model_path, "config.json")
    cfg = json.load(open(cfg_path))
    cfg["dtype"] = "bfloat16"
    json.dump(cfg, open(cfg_path, "w"))
    from transformers import AutoModelForCausalLM

    state = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).state_dict()
    write_hf(state, model_path, str(tmp_path / "out"), max_shard_size="20KB")
    files = sorted(f for f in os.listdir(tmp_path / "out") if f.endswith(".safetensors"))
    assert len(files) > 1 and os.path.isfile(tmp_path / "out" / "model.safetensors.index.json")
    with safe_open(str(tmp_path / "out" / files[0]), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}


def test_export_names_a_folder_without_a_checkpoint(tmp_path, capsys):
    from lib import export

    assert export.main([str(tmp_path), str(tmp_path / "out")]) == 2
    assert "neither a checkpoint" in capsys.readouterr().err


def test_a_head_trained_apart_from_a_tied_embedding_is_exported_untied(tmp_path):
    """Weights whose lm_head differs from the embedding of a model that ties them (a checkpoint written before the
    trainer kept the tie): re-tying would throw the trained head away (logits off by ~0.1 after 2 steps); the
    export is untied instead and gives the weights' logits."""
    from transformers import AutoModelForCausalLM

    from lib.export import write_hf

    path = save_tiny_model(str(tmp_path / "tied"), "qwen2", tie_word_embeddings=True)
    config = AutoModelForCausalLM.from_pretrained(path).config
    config.tie_word_embeddings = False
    torch.manual_seed(1)
    untied = AutoModelForCausalLM.from_config(config).eval()
    write_hf({k: v.clone() for k, v in untied.state_dict().items()}, path, str(tmp_path / "out"))
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = torch.arange(3, 15).reshape(2, 6)
    with torch.no_grad():
        assert torch.allclose(exported(input_ids=ids).logits, untied(input_ids=ids).logits, atol=1e-6)
    assert not exported.config.tie_word_embeddings
