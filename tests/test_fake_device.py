"""The code that runs only where CUDA is available, run on CPU through lib/fake_device.py (docs/testing.md
lists every such place and what runs it). A whole GRPO run under the fake is in tests/test_metrics.py."""

import types

import pytest
import torch

from lib import fake_device
from tests.helpers import EOS_IDS, save_tiny_model

GIB = 2**30


@pytest.fixture
def fake(monkeypatch):
    return fake_device.install(fake_device.FakeDevice(total_bytes=80 * GIB, base_bytes=3 * GIB, burst_bytes=0),
                               monkeypatch.setattr)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(str(tmp_path_factory.mktemp("tied")), "qwen2")


def test_the_fake_counts_as_cudas_allocator_does_and_tells_libraries_the_truth(monkeypatch):
    f = fake_device.install(fake_device.FakeDevice(base_bytes=GIB, burst_bytes=GIB), monkeypatch.setattr)
    assert torch.cuda.is_available() and torch.cuda.memory_allocated() == GIB
    torch.cuda.reset_peak_memory_stats()  # the first stage's work: one burst of 1 GiB, freed again
    assert (torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()) == (2 * GIB, GIB)
    torch.cuda.reset_peak_memory_stats()  # the next stage peaks higher
    assert torch.cuda.max_memory_allocated() == 3 * GIB
    f.alloc(5 * GIB)
    assert torch.cuda.mem_get_info() == (f.total - 6 * GIB, f.total)
    f.free(5 * GIB)
    assert torch.cuda.max_memory_allocated() == 6 * GIB and torch.cuda.memory_allocated() == GIB
    # a library's own CUDA branch (torch's checkpoint writer, say) is told the truth, on this machine False
    library = {"__name__": "torch.distributed.checkpoint.filesystem", "torch": torch}
    assert eval("torch.cuda.is_available()", library) is f._real_is_available()


def test_enter_rollout_empties_the_cache_around_the_sync(fake, model_dir):
    """lib/sync.py on a GPU: Python's cycle collector and empty_cache before the engine wakes, and again after the
    sync's buckets are gone."""
    from transformers import AutoModelForCausalLM

    from lib.engine import SamplingConfig
    from lib.engine.hf import HFEngine
    from lib.models import load_config
    from lib.sync import enter_rollout, exit_rollout

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    sp = SamplingConfig(temperature=0.0, max_new_tokens=2)
    engine = HFEngine(load_config(model_dir), torch.device("cpu"), 0, EOS_IDS, sp, sp, dtype=torch.float32)
    before = fake.calls.get("empty_cache", 0)
    metrics = enter_rollout(model, engine, torch.float32)
    assert fake.calls["empty_cache"] - before == 2 and metrics["sync/gb"] > 0
    exit_rollout(model, engine, torch.device("cpu"))


def test_offloading_frees_the_cache(fake, model_dir):
    """lib/fsdp.py on a GPU: parking the model or the optimizer's moments on the CPU empties the allocator's cache
    (after a synchronize for the non-blocking moment copies)."""
    from transformers import AutoModelForCausalLM

    from lib.fsdp import move_optimizer, offload_model

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.tensor([[5, 6, 7]])).logits.sum().backward()
    optimizer.step()
    offload_model(model)
    assert fake.calls["empty_cache"] == 1
    move_optimizer(optimizer, "cpu")
    assert fake.calls["synchronize"] == 1 and fake.calls["empty_cache"] == 2


def test_the_kv_cache_budget_is_the_devices_total_less_what_training_holds(fake, model_dir):
    """lib/engines.device_budget on a GPU: from the device's total memory (never its free memory): less what the
    trainer holds now, the AdamW moments to come, the engine's weights and the margin."""
    from transformers import AutoModelForCausalLM

    from lib import engines

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    n = sum(p.numel() for p in model.parameters())
    run = types.SimpleNamespace(
        topo=types.SimpleNamespace(device=torch.device("cuda", 0), rollout_tp_size=1),
        actor=types.SimpleNamespace(model=model),
        cfg=types.SimpleNamespace(actor=types.SimpleNamespace(fsdp=types.SimpleNamespace(optimizer_offload=False))))
    budget = engines.device_budget(run, torch.bfloat16)
    assert budget == 80 * GIB - 3 * GIB - 8 * n - 2 * n - engines.DEVICE_MARGIN_BYTES
    assert fake.calls["get_device_properties"] == 1
    run.cfg.actor.fsdp.optimizer_offload = True  # the moments live on the CPU: no room kept for them
    assert engines.device_budget(run, torch.bfloat16) == budget + 8 * n


def test_start_up_decisions_on_a_gpu_machine(fake, monkeypatch):
    """What start-up decides where torch sees a GPU: the device (auto: cuda), the engine (auto: vLLM where it is
    installed), packed rows refused without a varlen kernel, and no CPU-build check of vLLM."""
    import importlib.util

    from lib import attention, config, preflight
    from lib.dist import resolve_device

    assert resolve_device("auto") == torch.device("cuda")
    cfg = config.parse([], default_preset="tiny_cpu_grpo")
    assert cfg.rollout.engine == "auto"
    assert preflight.picks_vllm(cfg) == (importlib.util.find_spec("vllm") is not None)
    cfg.trainer.device = "cpu"  # forced: the CPU engine and no GPU packing rule
    assert not preflight.picks_vllm(cfg) and preflight._packing_problems(cfg, False) == []
    cfg.trainer.device = "auto"
    monkeypatch.setattr(attention, "varlen_kernel", lambda: None)
    (refused,) = preflight._packing_problems(cfg, False)
    assert "needs a varlen attention kernel" in refused and "--actor.batching.no-use-remove-padding" in refused
    monkeypatch.setattr(attention, "varlen_kernel", lambda: "torch")
    assert preflight._packing_problems(cfg, False) == []
    if importlib.util.find_spec("vllm") is not None:
        assert preflight.vllm_problems(None) == []  # the GPU build: no CPU head-size rule


def test_the_device_decides_dtypes_and_offloads():
    """The choices made from the Topology's device (no CUDA call): bf16 engines and reward models, the teacher and
    the reward model waiting on the CPU, on a GPU; fp32 and no offload on a CPU."""
    from lib import distill, engines

    gpu, cpu = torch.device("cuda", 0), torch.device("cpu")
    run = lambda device: types.SimpleNamespace(topo=types.SimpleNamespace(device=device))  # noqa: E731
    assert engines.engine_dtype(run(gpu)) == torch.bfloat16 and engines.engine_dtype(run(cpu)) == torch.float32
    cfg = types.SimpleNamespace(distill=types.SimpleNamespace(teacher_offload=True))
    assert distill.offloads(cfg, gpu) and not distill.offloads(cfg, cpu)
    from lib.fsdp import compute_policy

    topo = lambda device: types.SimpleNamespace(device=device)  # noqa: E731
    assert compute_policy(topo(gpu), True).param_dtype == torch.bfloat16
    assert compute_policy(topo(gpu), True).reduce_dtype == torch.float32
    assert compute_policy(topo(gpu), False).param_dtype is None and compute_policy(topo(cpu), True).param_dtype is None


def test_the_update_profiles_gpu_branches(monkeypatch):
    """bench/profile_summary.py on a GPU, on CPU: the peak memory by phase through the optimizer's step hooks reads
    the allocator (the fake's, each phase peaking higher), and the summary of GPU kernels counts the device's idle
    time as the wall time less the union of the kernels' intervals."""
    from torch.autograd import DeviceType

    from bench import profile_summary

    fake_device.install(fake_device.FakeDevice(base_bytes=GIB, burst_bytes=GIB), monkeypatch.setattr)
    model = torch.nn.Linear(4, 4)
    optimizer = torch.optim.AdamW(model.parameters())
    phases = profile_summary.PhasePeaks(optimizer)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    peaks = phases.close()
    assert set(peaks) == {"forward+backward", "optimizer step"} and 0 < peaks["forward+backward"] < peaks[
        "optimizer step"], peaks
    kernel = lambda name, start, end: types.SimpleNamespace(  # noqa: E731 (a CUDA event as torch.profiler gives it)
        name=name, device_type=DeviceType.CUDA, device_time_total=end - start,
        time_range=types.SimpleNamespace(start=start, end=end))
    events = [kernel("sm90_xmma_gemm_bf16", 0, 10), kernel("flash_fwd_kernel", 5, 20), kernel("nccl_allGather", 30, 35)]
    prof = types.SimpleNamespace(events=lambda: events)
    text, headline = profile_summary.summary(prof, torch.device("cuda"), 40e-6, peaks, "fake")
    assert "GPU idle: 0.000 s (37.5% of the wall time" in text and "matmul" in headline and "GPU idle" in headline
    assert "Peak memory by phase: forward+backward" in text
