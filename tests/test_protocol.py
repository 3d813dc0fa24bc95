import numpy as np
import pytest
import torch

from lib.protocol import DataProto, DataProtoItem, pad_to_divisor, to_object_array, unpad


def make(n=6, t=4, meta=None):
    return DataProto.from_dict(
        {"ids": torch.arange(n * t).reshape(n, t), "mask": torch.ones(n, t, dtype=torch.bool),
         "score": torch.arange(n, dtype=torch.float32)},
        {"uid": [f"u{i}" for i in range(n)], "gt": [[i, i + 1] for i in range(n)]},
        meta or {"temperature": 1.0})


def rows(d):
    return d.batch["score"].long().tolist()


def test_from_dict_keeps_lists_as_objects():
    d = make()
    assert len(d) == 6
    assert d.non_tensor_batch["gt"].dtype == object and d.non_tensor_batch["gt"].shape == (6,)
    assert d.non_tensor_batch["gt"][2] == [2, 3]


def test_from_single_dict_routes_by_type():
    d = DataProto.from_single_dict({"a": torch.zeros(3, 2), "b": ["x", "y", "z"], "c": np.array([1, 2, 3])},
                                   meta_info={"k": 1})
    assert set(d.batch) == {"a"} and set(d.non_tensor_batch) == {"b", "c"}
    assert d.non_tensor_batch["c"].dtype == object and d.meta_info == {"k": 1}
    with pytest.raises(TypeError, match="'s'"):
        DataProto.from_single_dict({"s": 3})


def test_length_mismatch_is_refused_with_key_and_sizes():
    with pytest.raises(ValueError, match=r"a=3.*b=2"):
        DataProto.from_dict({"a": torch.zeros(3), "b": torch.zeros(2)})
    with pytest.raises(ValueError, match=r"uid=4"):
        DataProto.from_dict({"a": torch.zeros(3)}, {"uid": list("abcd")})
    with pytest.raises(ValueError, match="0-d"):
        DataProto.from_dict({"a": torch.tensor(1.0)})
    with pytest.raises(TypeError, match="batch\\['a'\\]"):
        DataProto({"a": [1, 2]})


def test_empty():
    e = DataProto()
    assert len(e) == 0 and e.split(2) == [] and "len=0" in repr(e)
    assert [len(c) for c in e.chunk(3)] == [0, 0, 0]
    z = make()[:0]
    assert len(z) == 0 and z.batch["ids"].shape == (0, 4)
    assert len(z.select_idxs([])) == 0 and len(z.repeat(3)) == 0
    assert len(DataProto.concat([z, make(2)])) == 2
    assert pad_to_divisor(z, 4) == (z, 0)


def test_int_index_gives_a_row():
    d = make()
    item = d[-1]
    assert isinstance(item, DataProtoItem)
    assert item.batch["ids"].tolist() == [20, 21, 22, 23] and item.non_tensor_batch["uid"] == "u5"
    with pytest.raises(IndexError):
        d[6]


def test_slice_is_a_view():
    d = make()
    s = d[1:4]
    assert rows(s) == [1, 2, 3] and list(s.non_tensor_batch["uid"]) == ["u1", "u2", "u3"]
    s.batch["ids"][0, 0] = -1
    assert d.batch["ids"][1, 0] == -1
    assert rows(d[::2]) == [0, 2, 4]


@pytest.mark.parametrize("index", [
    [4, 0, 0], np.array([4, 0, 0]), torch.tensor([4, 0, 0]), [-2, 0, 0]])
def test_index_by_integers(index):
    d = make()
    out = d[index]
    expect = [4, 0, 0]
    assert rows(out) == expect
    assert list(out.non_tensor_batch["uid"]) == [f"u{i}" for i in expect]
    assert out.meta_info == d.meta_info


@pytest.mark.parametrize("mask", [
    [True, False, True, False, False, True], np.array([1, 0, 1, 0, 0, 1], dtype=bool),
    torch.tensor([1, 0, 1, 0, 0, 1], dtype=torch.bool)])
def test_index_by_bool_mask(mask):
    d = make()
    out = d[mask]
    assert rows(out) == [0, 2, 5] and list(out.non_tensor_batch["gt"]) == [[0, 1], [2, 3], [5, 6]]
    with pytest.raises(IndexError, match="mask"):
        d[[True, False]]


def test_index_errors():
    d = make()
    with pytest.raises(IndexError):
        d[[6]]
    with pytest.raises(IndexError):
        d[np.array([0.5])]


def test_select_and_pop():
    d = make()
    s = d.select(["ids"], ["uid"], [])
    assert set(s.batch) == {"ids"} and set(s.non_tensor_batch) == {"uid"} and s.meta_info == {}
    assert s.batch["ids"] is d.batch["ids"]
    deep = d.select(deepcopy=True)
    deep.batch["ids"][0, 0] = 99
    deep.non_tensor_batch["gt"][0].append(7)
    assert d.batch["ids"][0, 0] == 0 and d.non_tensor_batch["gt"][0] == [0, 1]
    with pytest.raises(KeyError, match="nope"):
        d.select(["nope"])
    popped = d.pop(["score"], ["gt"], ["temperature"])
    assert set(popped.batch) == {"score"} and set(popped.non_tensor_batch) == {"gt"}
    assert "score" not in d.batch and "gt" not in d.non_tensor_batch and d.meta_info == {}
    assert len(d) == 6
    everything = d.pop(["ids", "mask"], ["uid"])
    assert len(everything) == 6 and len(d) == 0


def test_union():
    d = make()
    extra = DataProto.from_dict({"adv": torch.ones(6), "ids": d.batch["ids"].clone()}, {"uid": list(d.non_tensor_batch["uid"])},
                                {"step": 3, "temperature": 1.0})
    out = d.union(extra)
    assert out is d and {"adv", "ids"} <= set(d.batch) and d.meta_info == {"temperature": 1.0, "step": 3}
    bad = DataProto.from_dict({"ids": torch.zeros(6, 4, dtype=torch.long)})
    with pytest.raises(ValueError, match="'ids'"):
        make().union(bad)
    with pytest.raises(ValueError, match="'uid'"):
        make().union(DataProto.from_dict(non_tensors={"uid": list("abcdef")}))
    with pytest.raises(ValueError, match="temperature"):
        make().union(DataProto(meta_info={"temperature": 0.5}))
    with pytest.raises(ValueError, match="lengths 6 and 2"):
        make().union(make(2))


def test_concat():
    a, b = make(2), make(3)
    out = DataProto.concat([a, b])
    assert rows(out) == [0, 1, 0, 1, 2] and list(out.non_tensor_batch["uid"]) == ["u0", "u1", "u0", "u1", "u2"]
    with pytest.raises(ValueError, match="temperature"):
        DataProto.concat([a, make(2, meta={"temperature": 0.7})])
    with pytest.raises(ValueError, match="keys"):
        DataProto.concat([a, a.select(["ids"])])
    with pytest.raises(ValueError, match="'ids'.*trailing"):
        DataProto.concat([a, make(2, t=5)])
    with pytest.raises(ValueError):
        DataProto.concat([])


def test_chunk_split_and_padding():
    d = make(6)
    assert [rows(c) for c in d.chunk(3)] == [[0, 1], [2, 3], [4, 5]]
    with pytest.raises(ValueError, match="pad_to_divisor"):
        d.chunk(4)
    padded, pad = pad_to_divisor(d, 4)
    assert pad == 2 and rows(padded) == [0, 1, 2, 3, 4, 5, 0, 1]
    assert rows(unpad(padded, pad)) == rows(d)
    assert [rows(c) for c in d.chunk(4, pad=True)] == [[0, 1], [2, 3], [4, 5], [0, 1]]
    big, pad = pad_to_divisor(make(2), 7)  # more padding than rows: cycle
    assert pad == 5 and rows(big) == [0, 1, 0, 1, 0, 1, 0]
    assert [rows(p) for p in d.split(4)] == [[0, 1, 2, 3], [4, 5]]
    assert [len(p) for p in d.split(10)] == [6]
    with pytest.raises(ValueError):
        d.split(0)


def test_repeat():
    d = make(2)
    inter = d.repeat(3, interleave=True)
    assert rows(inter) == [0, 0, 0, 1, 1, 1]
    assert list(inter.non_tensor_batch["uid"]) == ["u0"] * 3 + ["u1"] * 3
    tiled = d.repeat(2, interleave=False)
    assert rows(tiled) == [0, 1, 0, 1] and tiled.batch["ids"].shape == (4, 4)
    assert list(tiled.non_tensor_batch["gt"]) == [[0, 1], [1, 2], [0, 1], [1, 2]]
    grid = DataProto.from_dict(non_tensors={"g": np.array([["a", "b"], ["c", "d"]], dtype=object)})
    assert grid.repeat(2, interleave=False).non_tensor_batch["g"].shape == (4, 2)


def test_no_non_tensors_and_to():
    d = DataProto.from_dict({"x": torch.zeros(3, 2)})
    assert len(d.repeat(2)) == 6 and len(d[[True, False, True]]) == 2
    assert d.to("cpu").batch["x"].device.type == "cpu"


def test_save_load_roundtrip(tmp_path):
    d = make()
    d.meta_info["nested"] = {"a": [1, 2], "b": None}
    d.non_tensor_batch["np_ints"] = to_object_array([np.int64(3)] * 6)
    path = tmp_path / "batch.safetensors"
    d[1:5].save(path)  # a view: saved without its parent's other rows
    back = DataProto.load(path)
    assert rows(back) == [1, 2, 3, 4] and back.batch["mask"].dtype == torch.bool
    assert list(back.non_tensor_batch["gt"]) == [[1, 2], [2, 3], [3, 4], [4, 5]]
    assert back.non_tensor_batch["np_ints"][0] == 3 and back.meta_info == d.meta_info
    empty = tmp_path / "empty.safetensors"
    make()[:0].save(empty)
    assert len(DataProto.load(empty)) == 0
    grid = DataProto.from_dict(non_tensors={"g": np.array([["a", "b"], ["c", "d"]], dtype=object)})
    grid.save(tmp_path / "grid.safetensors")
    assert DataProto.load(tmp_path / "grid.safetensors").non_tensor_batch["g"][1, 0] == "c"


def test_save_refuses_pickle_unless_asked(tmp_path):
    d = make(2)
    d.non_tensor_batch["obj"] = to_object_array([{1, 2}, {3}])  # sets are not JSON
    with pytest.raises(ValueError, match="allow_pickle=True"):
        d.save(tmp_path / "x.safetensors")
    assert not (tmp_path / "x.safetensors").exists()
    d.save(tmp_path / "x.safetensors", allow_pickle=True)
    with pytest.raises(ValueError, match="allow_pickle=True"):
        DataProto.load(tmp_path / "x.safetensors")
    assert DataProto.load(tmp_path / "x.safetensors", allow_pickle=True).non_tensor_batch["obj"][0] == {1, 2}


def test_repr_is_short():
    r = repr(make())
    assert "ids: (6, 4) int64" in r and "uid: (6,)" in r and "temperature" in r and len(r) < 300
