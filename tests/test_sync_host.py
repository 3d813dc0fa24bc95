"""The trainer's side of a weight sync on one rank as a GPU holds the model (issue 74, 1): with bf16 mixed precision
one rank's model is FSDP2's one root unit, every parameter a DTensor over a shard group of one rank. The bucketed
walk must yield iter_full_params's tensors bit for bit without one DTensor op a parameter (a DTensor's ``detach()``
was about 47 us of dispatch a parameter, 13.6 ms a sync of the 0.5B shape), and leave autograd as it was. The
sync itself sends those shards uncast: the engine's copy casts them (on the H200 of 2026-11-30 the sync of the 0.5B
shape cast its 290 fp32 shards a tensor at a time, an allocation each, before the plan's copies). Counted, never
timed: a dispatch mode sees every op the walk runs."""

import torch

from lib.testing import run_distributed
from tests.helpers import save_tiny_model


def _walk(path):
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    from lib import fsdp
    from lib.config import FSDPConfig, ModelConfig
    from lib.dist import init_topology

    class Ops(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.all, self.dtensor = [], []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.all.append(str(func))
            if any(isinstance(a, DTensor) for a in tree_flatten((args, kwargs or {}))[0]):
                self.dtensor.append(str(func))
            return func(*args, **(kwargs or {}))

    topo = init_topology(device="cpu")
    model = fsdp.build_sharded_model(ModelConfig(path=path), FSDPConfig(), topo, mp_policy=fsdp.GPU_POLICY)
    params = dict(model.named_parameters())
    out = {"params": len(params), "dtensors": sum(isinstance(p, DTensor) for p in params.values())}
    for dtype in (torch.bfloat16, None):
        reference = list(fsdp.iter_full_params(model, dtype))
        with Ops() as ops:
            bucketed = list(fsdp.iter_full_params_bucketed(model, dtype, 64 * 2**10))
        out[str(dtype)] = {
            "names": [n for n, _ in reference] == [n for n, _ in bucketed],
            "equal": all(torch.equal(a, b) and a.dtype == b.dtype for (_, a), (_, b) in zip(reference, bucketed)),
            "plain": all(type(t) is torch.Tensor and not t.requires_grad and t.grad_fn is None for _, t in bucketed),
            "dtensor_ops": sorted(set(ops.dtensor)), "ops": len(ops.all),
            # dtype None: the shards themselves, no copy
            "shared": all(t.untyped_storage().data_ptr() == p._local_tensor.untyped_storage().data_ptr()
                          for (_, t), p in zip(bucketed, params.values()))}
    # the sync's walk: the shards themselves, uncast (no op); the sync into an engine in bf16 casts in its copies
    from lib.engine import SamplingConfig
    from lib.engine.hf import HFEngine
    from lib.models import load_config
    from lib.sync import sync_weights

    with Ops() as ops:
        uncast = list(fsdp.iter_full_params_bucketed(model, torch.bfloat16, 64 * 2**10, cast_whole=False))
    out["uncast"] = {"ops": len(ops.all), "dtypes": sorted({str(t.dtype) for _, t in uncast}),
                     "shared": all(t.untyped_storage().data_ptr() == p._local_tensor.untyped_storage().data_ptr()
                                   for (_, t), p in zip(uncast, params.values()))}
    engine = HFEngine(load_config(path), topo.device, 0, [1], SamplingConfig(max_new_tokens=2), dtype=torch.bfloat16)
    engine.wake_up(["weights"])
    wide = "model.layers.0.mlp.down_proj.weight"  # a parameter the engine keeps in fp32: a cast's value all the same
    engine.model.get_parameter(wide).data = engine.model.get_parameter(wide).data.float()
    with Ops() as ops:
        metrics = sync_weights(model, engine, torch.bfloat16, 64 * 2**10)
    want = dict(fsdp.iter_full_params(model, torch.bfloat16))
    held = dict(engine.model.named_parameters())
    out["sync"] = {"casts": sum(op.startswith("aten._to_copy") for op in ops.all),
                   "copies": sum(op.startswith("aten.copy_") for op in ops.all),
                   "equal": all(torch.equal(held[n], t) and held[n].dtype == torch.bfloat16 for n, t in want.items()
                                if n in held and n != wide),
                   "wide": held[wide].dtype == torch.float32 and torch.equal(held[wide], want[wide].float()),
                   "bytes": metrics["sync/gb"] * 2**30, "bf16_bytes": sum(t.numel() * 2 for t in want.values())}
    out["autograd"] = all(p.requires_grad and p.grad is None for p in model.parameters()) and torch.is_grad_enabled()
    return out


def test_one_ranks_root_unit_syncs_without_a_dtensor_op_a_parameter(tmp_path):
    (r,) = run_distributed(_walk, save_tiny_model(str(tmp_path / "m"), "qwen2"), world_size=1)
    assert r["params"] == r["dtensors"] > 0, r  # the GPU's layout: one root unit of DTensors
    for dtype in ("torch.bfloat16", "None"):
        x = r[dtype]
        assert x["names"] and x["equal"] and x["plain"], (dtype, x)
        assert x["dtensor_ops"] == [], (dtype, x)  # before: aten.detach.default, one a parameter
    assert r["torch.bfloat16"]["ops"] == r["params"]  # one cast a shard, nothing else
    assert r["None"]["ops"] == 0 and r["None"]["shared"]
    assert r["uncast"] == {"ops": 0, "dtypes": ["torch.float32"], "shared": True}, r["uncast"]
    # the engine holds the weights as a cast does, each cast inside its copy (before: a cast tensor a parameter,
    # then its copy); the sync's bytes are the engine's (bf16), not the fp32 shards'
    sync = r["sync"]
    assert sync["equal"] and sync["wide"] and sync["copies"] >= r["params"], sync
    assert sync["casts"] == 1, sync  # the fp32-kept parameter's alone: rounded to bf16 before its copy
    assert sync["bytes"] == sync["bf16_bytes"], sync
    assert r["autograd"]


def test_a_bf16_hf_engine_takes_an_integer_buffer_exactly(tmp_path):
    """Where the engine keeps a tensor in another dtype than its own, only a floating one is rounded to the engine's
    dtype first (lib.engine.in_engine_dtype): an integer persistent buffer is copied as sent (rounded through bf16,
    1001 came back 1000)."""
    from lib.engine import SamplingConfig
    from lib.engine.hf import HFEngine
    from lib.models import load_config

    engine = HFEngine(load_config(save_tiny_model(str(tmp_path / "m"), "qwen2")), torch.device("cpu"), 0, [1],
                      SamplingConfig(max_new_tokens=2), dtype=torch.bfloat16)
    engine.wake_up(["weights"])
    engine.model.model.register_buffer("counted", torch.zeros(2, dtype=torch.long))  # persistent
    engine.sleep(1)  # the engine lists its weights anew as it moves
    engine.wake_up(["weights"])
    engine.load_weights([("model.counted", torch.tensor([1001, 70001]))])
    assert engine.model.model.counted.tolist() == [1001, 70001]
