"""2-rank gloo tests of the DataProto collectives and the Topology meshes."""

import pytest
import torch
import torch.distributed as dist

from lib.dist import all_gather, check_sizes, init_topology, reduce_metrics, reshard
from lib.protocol import DataProto
from lib.testing import run_distributed


def _local_batch(rank: int) -> DataProto:
    # rank 0: 2 rows of length 3; rank 1: 3 rows of length 5 (uneven batch and sequence sizes)
    n, t = (2, 3) if rank == 0 else (3, 5)
    ids = torch.arange(n * t).reshape(n, t) + 100 * rank
    return DataProto.from_dict({"ids": ids, "mask": torch.ones(n, t, dtype=torch.bool),
                                "score": torch.full((n,), float(rank))},
                               {"uid": [f"r{rank}-{i}" for i in range(n)], "gt": [{"rank": rank}] * n},
                               {"step": 7})


def _collectives_body():
    topo = init_topology()
    rank = topo.rank
    local = _local_batch(rank)
    gathered, sizes = all_gather(local, pad_values={"ids": -1}, return_sizes=True)
    out = {"sizes": sizes, "ids": gathered.batch["ids"].tolist(), "mask": gathered.batch["mask"].tolist(),
           "uid": list(gathered.non_tensor_batch["uid"]), "gt": list(gathered.non_tensor_batch["gt"]),
           "meta": gathered.meta_info}
    # reshard: rank 0 takes global rows [4, 0], rank 1 takes [1, 2, 3]
    mine = reshard(local, [[4, 0], [1, 2, 3]])
    out["reshard_uid"] = list(mine.non_tensor_batch["uid"])
    out["reshard_ids"] = mine.batch["ids"].tolist()
    # rows no rank takes are dropped; a rank may take none
    few = reshard(local, [[], [3, 1]], pad_values={"ids": -1})
    out["few_uid"], out["few_ids"] = list(few.non_tensor_batch["uid"]), few.batch["ids"].tolist()
    # an empty rank still takes part
    empty = local[:0] if rank == 1 else local
    out["with_empty"] = len(all_gather(empty))
    out["metrics"] = reduce_metrics({"a": float(rank + 1), "b": float(rank + 1), "c": float(rank + 1),
                                     "d": torch.tensor(float(rank + 1))},
                                    op={"a": "mean", "b": "sum", "c": "max", "d": "min"})
    out["all_sum"] = reduce_metrics({"x": 1.0, "y": 2.0}, op="sum")
    try:
        reduce_metrics({"x": 1.0} if rank == 0 else {"x": 1.0, "y": 1.0})
        out["mismatch"] = None
    except ValueError as e:
        out["mismatch"] = str(e)
    return out


def test_collectives_on_two_ranks():
    r0, r1 = run_distributed(_collectives_body)
    for r in (r0, r1):
        assert r["sizes"] == [2, 3]
        assert r["ids"] == [[0, 1, 2, -1, -1], [3, 4, 5, -1, -1],
                            [100, 101, 102, 103, 104], [105, 106, 107, 108, 109], [110, 111, 112, 113, 114]]
        assert r["mask"][0] == [True, True, True, False, False] and r["mask"][2] == [True] * 5
        assert r["uid"] == ["r0-0", "r0-1", "r1-0", "r1-1", "r1-2"]
        assert r["gt"][0] == {"rank": 0} and r["gt"][4] == {"rank": 1}
        assert r["meta"] == {"step": 7}
        assert r["with_empty"] == 2
        assert r["metrics"] == {"a": 1.5, "b": 3.0, "c": 2.0, "d": 1.0}
        assert r["all_sum"] == {"x": 2.0, "y": 4.0}
        assert r["mismatch"] is not None and "different metric keys" in r["mismatch"]
    assert r0["reshard_uid"] == ["r1-2", "r0-0"] and r1["reshard_uid"] == ["r0-1", "r1-0", "r1-1"]
    assert r0["few_uid"] == [] and r0["few_ids"] == [] and r1["few_uid"] == ["r1-1", "r0-1"]
    assert r1["few_ids"] == [[105, 106, 107, 108, 109], [3, 4, 5, -1, -1]]  # padded to the widest rank
    assert r0["reshard_ids"][0] == [110, 111, 112, 113, 114] and r0["reshard_ids"][1] == [0, 1, 2, 0, 0]


def _mesh_body(sp_size: int, shard: int):
    topo = init_topology(sp_size=sp_size, fsdp_shard_size=shard)
    x = torch.tensor([float(topo.rank)])
    dist.all_reduce(x, group=topo.sp_group)  # the group really is the sp axis
    return {"dp": (topo.dp_rank, topo.dp_size), "sp": (topo.sp_rank, topo.sp_size), "sp_sum": x.item(),
            "fsdp": (tuple(topo.fsdp_mesh.mesh.shape), topo.fsdp_mesh.mesh_dim_names),
            "tp": topo.rollout_tp_size, "device": str(topo.device), "backend": topo.backend}


@pytest.mark.parametrize("sp_size,shard", [(1, 0), (2, 1)])
def test_meshes_world_two(sp_size, shard):
    r0, r1 = run_distributed(_mesh_body, sp_size, shard)
    if sp_size == 1:
        assert [r["dp"] for r in (r0, r1)] == [(0, 2), (1, 2)]
        assert [r["sp"] for r in (r0, r1)] == [(0, 1), (0, 1)]
        assert r0["sp_sum"] == 0.0 and r1["sp_sum"] == 1.0
        assert r0["fsdp"] == ((2,), ("shard",))
    else:
        assert [r["dp"] for r in (r0, r1)] == [(0, 1), (0, 1)]
        assert [r["sp"] for r in (r0, r1)] == [(0, 2), (1, 2)]
        assert r0["sp_sum"] == r1["sp_sum"] == 1.0
        assert r0["fsdp"] == ((2, 1), ("replicate", "shard"))
    assert r0["device"] == "cpu" and r0["backend"] == "gloo" and r0["tp"] == 1


def test_impossible_sizes_name_the_fix():
    with pytest.raises(ValueError, match=r"sp_size=3 does not divide the world size 4; use one of \[1, 2, 4\]"):
        check_sizes(4, sp_size=3)
    with pytest.raises(ValueError, match="fsdp_shard_size=3"):
        check_sizes(4, fsdp_shard_size=3)
    with pytest.raises(ValueError, match="rollout_tp_size=0"):
        check_sizes(4, rollout_tp_size=0)
    check_sizes(8, sp_size=4, fsdp_shard_size=4, rollout_tp_size=2)


def _fails_on_rank_one():
    if dist.get_rank() == 1:
        raise RuntimeError("boom on purpose")
    dist.barrier()  # rank 0 waits for a peer that never comes


def test_helper_reports_the_failing_rank():
    with pytest.raises(AssertionError, match="(?s)rank 1 of 2 failed.*boom on purpose"):
        run_distributed(_fails_on_rank_one, timeout=60)


def _dies_unreported():
    import os

    os._exit(3)


def test_helper_says_when_ranks_died_without_a_result():
    """Ranks that exit without reporting (killed, os._exit) end the wait at once, and the error says so: it said
    they 'did not finish within 60s' and blamed a mismatched collective."""
    with pytest.raises(AssertionError, match=r"ranks \[0, 1\] of 2 exited without a result \(exit codes \{0: 3, 1: 3\}\)"):
        run_distributed(_dies_unreported, timeout=60)


def _what_the_rank_sees():
    import os
    import sys

    import lib.dist

    return (os.environ.get("SPMD_TEST_MARK"), os.getcwd(), sys.path[0], lib.dist.check_sizes.__name__,
            int(os.environ["RANK"]), torch.get_num_threads(), "PYTORCH_NVML_BASED_CUDA_CHECK" in os.environ)


def test_ranks_forked_from_the_server_see_the_callers_environment_and_a_fresh_library(tmp_path, monkeypatch):
    """lib.testing forks its ranks from a server that imported the trainer once: each rank still sees the caller's
    environment, working folder and import path as they are at the call (the server started before them), its rank
    and one thread; and the library as imported fresh (a patch in the caller's process, which a spawned rank would
    not see either, is not there). The server is reused by the next call."""
    import lib.dist
    from lib import testing

    monkeypatch.setenv("SPMD_TEST_MARK", "here")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(lib.dist.check_sizes, "__name__", "patched")
    monkeypatch.delenv("PYTORCH_NVML_BASED_CUDA_CHECK", raising=False)  # the server's start-up setting, not the caller's
    first = run_distributed(_what_the_rank_sees)
    assert first == [("here", str(tmp_path), str(tmp_path), "check_sizes", r, 1, False) for r in (0, 1)], first
    assert testing._context().get_start_method() == "forkserver"
    monkeypatch.setenv("SPMD_TEST_MARK", "again")
    assert [r[0] for r in run_distributed(_what_the_rank_sees)] == ["again", "again"]
