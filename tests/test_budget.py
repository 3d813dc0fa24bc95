"""actor.batching.token_budget memory (issue 55's lever, lib/budget.py): the update's token budget sized from the
device's memory in bytes, through lib/fake_device's counters on CPU; the config's refusals."""

import pytest
import torch

from lib import config, preflight
from lib.testing import run_distributed
from tests.helpers import save_tiny_model, tiny_config

GIB = 2**30
MARGIN = 4 * GIB


def _body(path, total_gib, burst_gib, cap, min_tokens):
    from lib import budget, fake_device
    from lib.config import BatchingConfig, FSDPConfig, ModelConfig
    from lib.dist import init_topology
    from lib.fsdp import build_sharded_model

    topo = init_topology(device="cpu")
    model = build_sharded_model(ModelConfig(path=path), FSDPConfig(), topo)
    total_gib = total_gib[topo.rank] if isinstance(total_gib, list) else total_gib  # each rank its own device
    fake = fake_device.install(fake_device.FakeDevice(total_bytes=total_gib * GIB, base_bytes=GIB,
                                                      burst_bytes=burst_gib * GIB))
    batching = BatchingConfig(use_dynamic_batching=True, max_tokens_per_rank=cap)
    try:
        sized, line = budget.size_from_memory(batching, model, topo.device, model.config.vocab_size, min_tokens,
                                              False, MARGIN)
    except ValueError as e:
        return {"error": str(e)}
    grads = [p.grad for p in model.parameters()]
    return {"tokens": sized.max_tokens_per_rank, "line": line, "moments": budget.trained_bytes(model),
            "free": fake.total - fake.current, "grads_left": any(g is not None for g in grads)}


@pytest.fixture(scope="module")
def path(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("m")), "qwen2")


def test_the_budget_is_what_memory_holds_of_the_measured_activations(path):
    # 12 GiB device, 1 GiB in use; the probe's forward and backward peak 1 GiB above where it started
    r = run_distributed(_body, path, 12, 1, 16384, 64, world_size=1)[0]
    per_token = GIB / 2048  # the probe's 2048 tokens
    expected = int((r["free"] - r["moments"] - MARGIN) // per_token)
    assert r["tokens"] == expected and 14000 < expected < 14336, r  # (11 - 4) GiB at 512 KiB a token, less moments
    assert "sized from memory: " in r["line"] and "512.0 KiB of activations a token" in r["line"]
    assert not r["grads_left"]  # the probe's gradients are dropped
    # a large device: capped at max_tokens_per_rank
    r = run_distributed(_body, path, 80, 1, 16384, 64, world_size=1)[0]
    assert r["tokens"] == 16384 and "capped at max_tokens_per_rank 16384" in r["line"]
    # too small for one full sequence: refused with the fix
    r = run_distributed(_body, path, 6, 1, 16384, 8192, world_size=1)[0]
    assert "fewer than one full sequence (8192)" in r["error"] and "gradient_checkpointing" in r["error"]


def test_the_budget_takes_the_smallest_rank(path):
    """Every rank measures its own device; all take the smallest figure, so they refuse together or not at all."""
    small, large = run_distributed(_body, path, [12, 80], 1, 16384, 64, world_size=2)
    assert small["tokens"] == large["tokens"] < 16384, (small, large)
    a, b = run_distributed(_body, path, [80, 6], 1, 16384, 8192, world_size=2)
    assert "fewer than one full sequence" in a["error"] and "fewer than one full sequence" in b["error"]


def test_without_a_device_allocator_the_budget_is_the_cap(path):
    from lib import budget

    tokens, line = budget.token_budget(torch.nn.Linear(2, 2), torch.device("cpu"), 100, True, 9000, 64, 0, 0)
    assert tokens == 9000 and "no device memory" in line


def test_a_memory_budget_where_it_cannot_be_measured_and_liger_on_cpu_are_refused():
    for change, part in ((lambda c: setattr(c.actor.batching, "token_budget", "bytes"),
                          "actor.batching.token_budget='bytes'; use one of ('fixed', 'memory')"),
                         (lambda c: setattr(c.actor.batching, "token_budget", "memory"),
                          "actor.batching.token_budget memory needs batching.use_dynamic_batching true"),
                         (lambda c: (setattr(c.actor.batching, "token_budget", "memory"),
                                     setattr(c.actor.batching, "use_dynamic_batching", True),
                                     setattr(c.trainer, "sp_size", 2)),
                          "is not measured with sequence parallelism"),
                         (lambda c: setattr(c.actor.model, "liger", True),
                          "actor.model.liger needs a GPU (Liger's kernels are Triton kernels); leave it off on CPU")):
        cfg = config.Config()
        cfg.data.max_prompt_length, cfg.rollout.max_response_length = 64, 64
        change(cfg)
        with pytest.raises(ValueError) as e:
            preflight.validate(cfg, 2, tiny_config("qwen2"))
        assert part in str(e.value), (part, str(e.value))
