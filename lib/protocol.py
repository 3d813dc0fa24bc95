"""DataProto: the batch that moves between the stages of one RL step.

A DataProto is three things with one row per sample:

- ``batch``: ``dict[str, Tensor]``, every tensor's first dim is the row dim;
- ``non_tensor_batch``: ``dict[str, np.ndarray]`` of dtype ``object`` (uids, data sources, ground truths);
- ``meta_info``: ``dict`` of per-batch values (temperature, timings), not indexed by row.

Slicing, ``chunk`` and ``split`` return views (no copy); indexing with indices or a mask, ``repeat`` and
``concat`` copy. There is no tensordict dependency: the hot paths are plain dict comprehensions over a
handful of keys, so the per-call overhead is microseconds and the cost is the tensor copy itself.

Keys written by each stage of a step are listed in DESIGN.md ("One GRPO step").
"""

from __future__ import annotations

import base64
import copy
import json
import pickle
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import save_file

_FORMAT_KEY = "dataproto"
_FORMAT_VERSION = 1


def to_object_array(values: Iterable[Any] | np.ndarray) -> np.ndarray:
    """A 1-D object array holding ``values`` as they are (lists stay lists, not a 2-D array)."""
    if isinstance(values, np.ndarray):
        return values if values.dtype == object else values.astype(object)
    values = list(values)
    return np.fromiter(values, dtype=object, count=len(values))


def _objects_equal(a: np.ndarray, b: np.ndarray) -> bool:
    if a is b:
        return True
    if a.shape != b.shape:
        return False
    try:
        return bool(np.array_equal(a, b))
    except (ValueError, TypeError):  # elements whose == is not a bool (arrays, tensors)
        return all(_values_equal(x, y) for x, y in zip(a.ravel(), b.ravel()))


def _values_equal(x: Any, y: Any) -> bool:
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
        return x.shape == y.shape and x.dtype == y.dtype and bool(torch.equal(x.cpu(), y.cpu()))
    if isinstance(x, np.ndarray) and isinstance(y, np.ndarray):
        return _objects_equal(x, y) if x.dtype == object else bool(np.array_equal(x, y))
    if isinstance(x, (torch.Tensor, np.ndarray)) or isinstance(y, (torch.Tensor, np.ndarray)):
        return False
    return bool(x == y)


def _tensors_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a is b:
        return True
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return False
    # Two views of the same memory with the same layout are equal without reading it.
    if a.data_ptr() == b.data_ptr() and a.stride() == b.stride():
        return True
    return bool(torch.equal(a, b))


def _merge_meta(into: dict, other: dict, what: str) -> None:
    for key, value in other.items():
        if key in into and not _values_equal(into[key], value):
            raise ValueError(f"{what}: meta_info[{key!r}] differs ({into[key]!r} vs {value!r}); "
                             f"drop or rename the key on one side first")
        into[key] = value


@dataclass
class DataProtoItem:
    """One row of a DataProto (``data[i]``): tensors and objects without the row dim."""

    batch: dict[str, torch.Tensor]
    non_tensor_batch: dict[str, Any]
    meta_info: dict


@dataclass
class DataProto:
    batch: dict[str, torch.Tensor] = field(default_factory=dict)
    non_tensor_batch: dict[str, np.ndarray] = field(default_factory=dict)
    meta_info: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, value in self.non_tensor_batch.items():
            if not isinstance(value, np.ndarray):
                raise TypeError(f"non_tensor_batch[{key!r}] is {type(value).__name__}; "
                                f"pass a numpy array (DataProto.from_dict converts lists)")
            if value.dtype != object:
                self.non_tensor_batch[key] = value.astype(object)
        self._length = self._check_lengths()

    def _check_lengths(self) -> int:
        sizes: dict[str, int] = {}
        for key, value in self.batch.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"batch[{key!r}] is {type(value).__name__}; batch holds tensors only "
                                f"(put other values in non_tensor_batch)")
            if value.dim() == 0:
                raise ValueError(f"batch[{key!r}] is a 0-d tensor; every field needs a row dim "
                                 f"(put per-batch scalars in meta_info)")
            sizes[key] = value.shape[0]
        for key, value in self.non_tensor_batch.items():
            if value.ndim == 0:
                raise ValueError(f"non_tensor_batch[{key!r}] is a 0-d array; every field needs a row dim")
            sizes[key] = value.shape[0]
        if len(set(sizes.values())) > 1:
            shown = ", ".join(f"{k}={v}" for k, v in sizes.items())
            raise ValueError(f"DataProto fields disagree in length: {shown}")
        return next(iter(sizes.values()), 0)

    # ---- construction

    @classmethod
    def from_dict(cls, tensors: dict[str, torch.Tensor] | None = None,
                  non_tensors: dict[str, Any] | None = None, meta_info: dict | None = None) -> DataProto:
        """Build from tensors and non-tensors; non-tensor lists become 1-D object arrays."""
        non_tensors = {k: to_object_array(v) for k, v in (non_tensors or {}).items()}
        return cls(dict(tensors or {}), non_tensors, dict(meta_info or {}))

    @classmethod
    def from_single_dict(cls, data: dict[str, Any], meta_info: dict | None = None) -> DataProto:
        """Build from one dict: tensors go to ``batch``, arrays and lists to ``non_tensor_batch``."""
        tensors, non_tensors = {}, {}
        for key, value in data.items():
            if isinstance(value, torch.Tensor):
                tensors[key] = value
            elif isinstance(value, (np.ndarray, list, tuple)):
                non_tensors[key] = value
            else:
                raise TypeError(f"{key!r} is {type(value).__name__}; from_single_dict takes tensors, "
                                f"numpy arrays and lists (put per-batch values in meta_info)")
        return cls.from_dict(tensors, non_tensors, meta_info)

    def _new(self, batch: dict, non_tensor_batch: dict, meta_info: dict | None = None) -> DataProto:
        out = DataProto.__new__(DataProto)
        out.batch, out.non_tensor_batch = batch, non_tensor_batch
        out.meta_info = dict(self.meta_info) if meta_info is None else meta_info
        out._length = out._check_lengths()
        return out

    # ---- size and indexing

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, item: Any) -> DataProto | DataProtoItem:
        if isinstance(item, (int, np.integer)):
            i = int(item)
            if not -len(self) <= i < len(self):
                raise IndexError(f"row {i} out of range for a DataProto of length {len(self)}")
            return DataProtoItem({k: v[i] for k, v in self.batch.items()},
                                 {k: v[i] for k, v in self.non_tensor_batch.items()}, dict(self.meta_info))
        if isinstance(item, slice):
            return self._new({k: v[item] for k, v in self.batch.items()},
                             {k: v[item] for k, v in self.non_tensor_batch.items()})
        return self.select_idxs(item)

    def select_idxs(self, idxs: torch.Tensor | np.ndarray | Sequence[int] | Sequence[bool]) -> DataProto:
        """Rows by integer indices (any order, repeats allowed) or by a boolean mask of length len(self)."""
        if isinstance(idxs, torch.Tensor):
            idx = idxs.detach().cpu().numpy()
        else:
            idx = np.asarray(idxs)
        if idx.dtype == bool:
            if idx.shape != (len(self),):
                raise IndexError(f"boolean mask has shape {idx.shape}, the DataProto has {len(self)} rows")
            idx = np.flatnonzero(idx)
        elif idx.size == 0:
            idx = idx.astype(np.int64)
        elif not np.issubdtype(idx.dtype, np.integer):
            raise IndexError(f"indices must be integers or booleans, got dtype {idx.dtype}")
        idx = idx.reshape(-1).astype(np.int64, copy=False)
        if idx.size:
            if idx.max() >= len(self) or idx.min() < -len(self):
                raise IndexError(f"index out of range for a DataProto of length {len(self)}")
            if idx.min() < 0:
                idx = np.where(idx < 0, idx + len(self), idx)
        idx_t = torch.from_numpy(idx)
        by_device: dict[torch.device, torch.Tensor] = {}
        batch = {}
        for key, value in self.batch.items():
            if value.device not in by_device:
                by_device[value.device] = idx_t.to(value.device, non_blocking=True)
            batch[key] = value.index_select(0, by_device[value.device])
        return self._new(batch, {k: v[idx] for k, v in self.non_tensor_batch.items()})

    # ---- keys

    def select(self, batch_keys: Iterable[str] | None = None, non_tensor_batch_keys: Iterable[str] | None = None,
               meta_info_keys: Iterable[str] | None = None, deepcopy: bool = False) -> DataProto:
        """A DataProto with only these keys (None keeps all of that kind). Shares memory unless deepcopy."""
        def pick(d: dict, keys: Iterable[str] | None, what: str) -> dict:
            if keys is None:
                return dict(d)
            missing = [k for k in keys if k not in d]
            if missing:
                raise KeyError(f"{what} has no key(s) {missing}; it has {sorted(d)}")
            return {k: d[k] for k in keys}

        out = self._new(pick(self.batch, batch_keys, "batch"),
                        pick(self.non_tensor_batch, non_tensor_batch_keys, "non_tensor_batch"),
                        pick(self.meta_info, meta_info_keys, "meta_info"))
        if deepcopy:
            out.batch = {k: v.clone() for k, v in out.batch.items()}
            out.non_tensor_batch = {k: copy.deepcopy(v) for k, v in out.non_tensor_batch.items()}
            out.meta_info = copy.deepcopy(out.meta_info)
        return out

    def pop(self, batch_keys: Iterable[str] = (), non_tensor_batch_keys: Iterable[str] = (),
            meta_info_keys: Iterable[str] = ()) -> DataProto:
        """Remove these keys from self and return them as a new DataProto of the same length."""
        batch_keys, non_tensor_batch_keys, meta_info_keys = list(batch_keys), list(non_tensor_batch_keys), \
            list(meta_info_keys)
        out = self.select(batch_keys, non_tensor_batch_keys, meta_info_keys)
        for k in batch_keys:
            del self.batch[k]
        for k in non_tensor_batch_keys:
            del self.non_tensor_batch[k]
        for k in meta_info_keys:
            del self.meta_info[k]
        if not self.batch and not self.non_tensor_batch:
            self._length = 0
        return out

    def union(self, other: DataProto) -> DataProto:
        """Add other's keys to self (in place, returns self). A shared key must hold equal values."""
        if len(self) != len(other) and (self.batch or self.non_tensor_batch) and \
                (other.batch or other.non_tensor_batch):
            raise ValueError(f"union of DataProtos of lengths {len(self)} and {len(other)}")
        for key, value in other.batch.items():
            if key in self.batch and not _tensors_equal(self.batch[key], value):
                raise ValueError(f"union: batch[{key!r}] differs between the two DataProtos")
            self.batch[key] = value
        for key, value in other.non_tensor_batch.items():
            if key in self.non_tensor_batch and not _objects_equal(self.non_tensor_batch[key], value):
                raise ValueError(f"union: non_tensor_batch[{key!r}] differs between the two DataProtos")
            self.non_tensor_batch[key] = value
        _merge_meta(self.meta_info, other.meta_info, "union")
        self._length = self._check_lengths()
        return self

    # ---- combining and cutting

    @staticmethod
    def concat(items: Sequence[DataProto]) -> DataProto:
        """Rows of all items in order. Keys must match; meta_info is merged and conflicts are errors."""
        if not items:
            raise ValueError("concat needs at least one DataProto")
        first = items[0]
        for i, d in enumerate(items[1:], 1):
            if d.batch.keys() != first.batch.keys() or d.non_tensor_batch.keys() != first.non_tensor_batch.keys():
                raise ValueError(f"concat: item {i} has keys {sorted(d.batch)} + {sorted(d.non_tensor_batch)}, "
                                 f"item 0 has {sorted(first.batch)} + {sorted(first.non_tensor_batch)}")
        meta: dict = {}
        for d in items:
            _merge_meta(meta, d.meta_info, "concat")
        batch = {}
        for key in first.batch:
            parts = [d.batch[key] for d in items]
            if len({p.shape[1:] for p in parts}) > 1:
                raise ValueError(f"concat: batch[{key!r}] has trailing shapes {[tuple(p.shape[1:]) for p in parts]}; "
                                 f"pad them to one length first (dist.all_gather pads for you)")
            batch[key] = torch.cat(parts, dim=0)
        non_tensor = {k: np.concatenate([d.non_tensor_batch[k] for d in items], axis=0)
                      for k in first.non_tensor_batch}
        return first._new(batch, non_tensor, meta)

    @staticmethod
    def concat_padded(items: Sequence[DataProto], pad_values: dict[str, float | int] | None = None) -> DataProto:
        """Rows of items whose tensors differ in trailing sizes (rollout rounds of different response widths):
        each tensor is padded at the end of its trailing dims to the largest shape with ``pad_values[key]``
        (default 0), then concatenated. meta_info is dropped (each round's differs)."""
        pad_values = pad_values or {}
        padded = []
        for d in items:
            batch = {}
            for key, t in d.batch.items():
                shape = [max(x.batch[key].shape[i] for x in items) for i in range(1, t.dim())]
                if list(t.shape[1:]) != shape:
                    out = torch.full((t.shape[0], *shape), pad_values.get(key, 0), dtype=t.dtype, device=t.device)
                    out[(slice(None), *[slice(0, n) for n in t.shape[1:]])] = t
                    t = out
                batch[key] = t
            padded.append(d._new(batch, dict(d.non_tensor_batch), {}))
        return DataProto.concat(padded)

    def split(self, size: int) -> list[DataProto]:
        """Consecutive pieces of ``size`` rows (views); the last may be shorter. Empty -> []."""
        if size <= 0:
            raise ValueError(f"split size must be positive, got {size}")
        return [self[i:i + size] for i in range(0, len(self), size)]

    def chunk(self, chunks: int, pad: bool = False) -> list[DataProto]:
        """``chunks`` equal pieces (views). If len is not divisible: an error, or with ``pad=True``
        the batch is first padded with ``pad_to_divisor`` and each piece records nothing of it;
        call ``pad_to_divisor`` yourself when you need ``pad_size`` to unpad later."""
        if chunks <= 0:
            raise ValueError(f"chunks must be positive, got {chunks}")
        data = self
        if len(self) % chunks:
            if not pad:
                raise ValueError(f"cannot chunk {len(self)} rows into {chunks} equal pieces; use "
                                 f"pad_to_divisor(data, {chunks}) first or a batch size divisible by {chunks}")
            data, _ = pad_to_divisor(self, chunks)
        size = len(data) // chunks
        return [data[i * size:(i + 1) * size] for i in range(chunks)]

    def repeat(self, times: int, interleave: bool = True) -> DataProto:
        """Each row ``times`` times: ``aabb`` when interleaved (a prompt's samples adjacent), else ``abab``."""
        if times < 1:
            raise ValueError(f"repeat times must be >= 1, got {times}")
        if interleave:
            batch = {k: v.repeat_interleave(times, dim=0) for k, v in self.batch.items()}
            non_tensor = {k: np.repeat(v, times, axis=0) for k, v in self.non_tensor_batch.items()}
        else:
            batch = {k: v.repeat(times, *([1] * (v.dim() - 1))) for k, v in self.batch.items()}
            non_tensor = {k: np.tile(v, (times,) + (1,) * (v.ndim - 1)) for k, v in self.non_tensor_batch.items()}
        return self._new(batch, non_tensor)

    # ---- devices and files

    def to(self, device: torch.device | str, non_blocking: bool = False) -> DataProto:
        """Move tensors to ``device`` (in place, returns self)."""
        self.batch = {k: v.to(device, non_blocking=non_blocking) for k, v in self.batch.items()}
        return self

    def save(self, path: str | Path, allow_pickle: bool = False) -> None:
        """Tensors to a safetensors file; non-tensors and meta_info as JSON in its header.
        Values JSON cannot hold need ``allow_pickle=True`` (and the same flag to load)."""
        header = {"version": _FORMAT_VERSION, "length": len(self),
                  "non_tensor": {k: _encode(list(v.ravel()), v.shape, f"non_tensor_batch[{k!r}]", allow_pickle)
                                 for k, v in self.non_tensor_batch.items()},
                  "meta": _encode(self.meta_info, None, "meta_info", allow_pickle)}
        tensors = {k: v.detach().to("cpu").contiguous().clone() for k, v in self.batch.items()}
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        save_file(tensors, str(tmp), metadata={_FORMAT_KEY: json.dumps(header)})
        tmp.replace(path)  # atomic: a crash mid-write never leaves a half file under the real name

    @classmethod
    def load(cls, path: str | Path, allow_pickle: bool = False, device: str | torch.device = "cpu") -> DataProto:
        with safe_open(str(path), framework="pt", device=str(device)) as f:
            metadata = f.metadata() or {}
            if _FORMAT_KEY not in metadata:
                raise ValueError(f"{path} is a safetensors file but not a saved DataProto")
            batch = {k: f.get_tensor(k) for k in f.keys()}
        header = json.loads(metadata[_FORMAT_KEY])
        non_tensor = {}
        for key, enc in header["non_tensor"].items():
            flat = _decode(enc, f"non_tensor_batch[{key!r}]", allow_pickle)
            non_tensor[key] = to_object_array(flat).reshape(enc["shape"])
        return cls(batch, non_tensor, _decode(header["meta"], "meta_info", allow_pickle))

    def __repr__(self) -> str:
        def dt(t: torch.Tensor) -> str:
            return str(t.dtype).replace("torch.", "")

        parts = [f"len={len(self)}"]
        if self.batch:
            parts.append("batch={" + ", ".join(f"{k}: {tuple(v.shape)} {dt(v)}" for k, v in self.batch.items()) + "}")
        if self.non_tensor_batch:
            parts.append("non_tensor={" + ", ".join(f"{k}: {v.shape}" for k, v in self.non_tensor_batch.items()) + "}")
        if self.meta_info:
            parts.append(f"meta_info={sorted(self.meta_info)}")
        return "DataProto(" + ", ".join(parts) + ")"


def pad_to_divisor(data: DataProto, divisor: int) -> tuple[DataProto, int]:
    """Append rows (taken cyclically from the start) so len is divisible; returns (padded, pad_size)."""
    pad_size = (-len(data)) % divisor
    if pad_size == 0:
        return data, 0
    if len(data) == 0:
        raise ValueError("cannot pad an empty DataProto: there is no row to repeat")
    idx = np.arange(pad_size) % len(data)
    return DataProto.concat([data, data.select_idxs(idx)]), pad_size


def unpad(data: DataProto, pad_size: int) -> DataProto:
    """Drop the ``pad_size`` rows that ``pad_to_divisor`` added."""
    return data[:len(data) - pad_size] if pad_size else data


# ---- JSON with an opt-in pickle escape hatch, for save/load

def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    raise TypeError(type(value).__name__)


def _encode(values: Any, shape: tuple | None, what: str, allow_pickle: bool) -> dict:
    enc: dict[str, Any] = {} if shape is None else {"shape": list(shape)}
    try:
        enc["json"] = json.loads(json.dumps(values, default=_plain))
    except (TypeError, ValueError) as err:
        if not allow_pickle:
            raise ValueError(f"DataProto.save: {what} holds a value JSON cannot store ({err}); "
                             f"convert it to str/int/float/list/dict or pass allow_pickle=True") from None
        enc["pickle"] = base64.b64encode(pickle.dumps(values)).decode("ascii")
    return enc


def _decode(enc: dict, what: str, allow_pickle: bool) -> Any:
    if "json" in enc:
        return enc["json"]
    if not allow_pickle:
        raise ValueError(f"DataProto.load: {what} was saved with pickle; pass allow_pickle=True "
                         f"if you trust the file")
    return pickle.loads(base64.b64decode(enc["pickle"]))
