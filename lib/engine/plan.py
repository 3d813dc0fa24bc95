"""The weight sync's plan: where a rollout engine's own loaders put each tensor the trainer sends, recorded once and
then replayed as plain copies.

vLLM's loaders place a Hugging Face tensor in the engine's parameters in their own layouts (q, k and v as slices of
one fused qkv weight, gate and up of one gate_up, experts stacked in one tensor, a head tied to the embedding).
Going through them every sync costs host work (vLLM's layerwise reload: every layer to meta and back, each loader run
twice, fresh tensors, a second copy). The plan is taken from the loaders themselves, not from a table of names:

1. **Record** (the first sync, through the engine's own loader): a dispatch mode sees every ``copy_`` the loaders run
   and keeps, for each tensor sent, the views it was copied from and the views of the engine's tensors it was copied
   into (offset, sizes and strides inside the owning parameter). Wrappers around each layer's post-load processing
   (``process_weights_after_loading``) mark a layer whose processing does more than keep bytes in place: it runs a
   kernel of its own (vLLM's CPU build packs linear weights for oneDNN), makes new tensors (padding, transposes,
   derived tensors such as MLA's absorbed weights) or sets callables or tensors on the layer. A layer whose loader
   writes anything but a copy of a sent tensor is marked too.
2. **Prove** (the same sync, a second pass of the same weights): every tensor the plan would write is saved, set to
   a byte pattern no weight has, and written again through the plan alone; the result must equal what the loader
   wrote, bit for bit. A tensor that differs (or keeps the pattern: a byte the plan misses) is put back as the
   loader wrote it and its layer keeps the loader.
3. **Replay** (every later sync): each tensor the plan holds is written with one ``copy_`` per destination view (a
   dtype cast happens inside the copy); the rest go through the engine's loader. Before each sync the plan checks
   that the engine's tensors still live where it recorded them; if not, the next sync records again.

Nothing here imports vLLM: the engine passes its model and calls these around its own loader.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode

Spec = tuple[int, tuple[int, ...], tuple[int, ...]]
"""A view inside a tensor: (offset from the tensor's own storage offset, sizes, strides), in elements."""

PROCESS = "process_weights_after_loading"
CONSTANT_FILLS = (torch.ops.aten.fill_.Scalar, torch.ops.aten.zero_.default)
INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _spec(view: torch.Tensor, base: torch.Tensor) -> Spec:
    return view.storage_offset() - base.storage_offset(), tuple(view.shape), tuple(view.stride())


def _view(base: torch.Tensor, spec: Spec) -> torch.Tensor:
    offset, size, stride = spec
    return base.detach().as_strided(size, stride, base.storage_offset() + offset)


def _extent(t: torch.Tensor) -> tuple[int, int]:
    """The storage elements a view spans: [first, last + 1)."""
    if t.numel() == 0:
        return t.storage_offset(), t.storage_offset()
    last = sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return t.storage_offset(), t.storage_offset() + last + 1


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """A layer's own parameters and buffers (not its children's)."""
    return {**{n: p for n, p in module._parameters.items() if p is not None},
            **{n: b for n, b in module._buffers.items() if b is not None}}


def _held(module: nn.Module) -> dict[str, int]:
    """The callables and tensors a layer (or its quant method) keeps as plain attributes, by identity: a processing
    step that sets one (a packed kernel's closure, a derived tensor) leaves state a plain copy cannot update."""
    return {k: id(v) for k, v in vars(module).items()
            if k not in ("_parameters", "_buffers", "_modules", PROCESS) and not k.startswith("__")
            and (isinstance(v, torch.Tensor) or (callable(v) and not isinstance(v, type)))}


@dataclass
class Sent:
    """A tensor the sync sent: where its elements lie in its storage, and that storage, weakly (a copy from it
    counts while the storage lives: vLLM's layerwise reload runs a layer's loaders once all of its tensors have
    arrived, with an earlier bucket's tensors among them; holding them here would keep every bucket alive)."""
    ptr: int
    lo: int
    hi: int
    name: str
    offset: int  # the sent tensor's own storage offset (a source view's spec is relative to it)
    storage: StorageWeakRef


@dataclass
class Write:
    """One ``copy_`` a loader ran: a view of the sent tensor into a view of a layer's own tensor."""
    module: nn.Module
    tensor: str
    dst: Spec
    src: Spec
    layout: tuple[tuple[int, ...], tuple[int, ...], torch.dtype]  # the owning tensor's shape, strides, dtype
    value: float | None = None  # a constant written instead of a sent view (src unused)


class Recorder(TorchDispatchMode):
    """Active around one sync through the engine's own loader (and its processing): see the module docstring, 1."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        self.writes: dict[str, list[Write]] = {}
        self.fills: dict[str, list[Write]] = {}  # constant writes, under the name of a tensor sent beside them
        self.names: dict[str, None] = {}  # every name sent, in order
        self.marked: dict[nn.Module, str] = {}  # layer -> why the plan cannot replay its loading
        self.whole: str = ""  # why no part of the model can be replayed ("" if none)
        self.reads: list[tuple[nn.Module, int]] = []  # what weightless layers' processing read (storages; build)
        self._weighted: set[nn.Module] = set()  # layers a loader wrote a sent tensor into
        self.restored: list[tuple[nn.Module, str]] = []  # layer tensors written whole from another layer tensor
        self._sent: list[Sent] = []  # every sent tensor still alive, the newest first
        self._bucket_first = ""  # the current bucket's first name
        self._scalar_read = False  # a loader read a value out of a sent tensor (``.item()``) in this bucket, since
        # the last fill (a copy between the read and the fill does not clear it: the value may be kept aside)
        self._owners: dict[int, tuple[nn.Module, str]] = {}
        self._processing: nn.Module | None = None
        self._last = ""  # the sent tensor last copied

    # ---- what the engine tells it

    def sending(self, batch: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The tensors of the bucket about to go through the loader."""
        batch = list(batch)
        new = [Sent(_ptr(t), *_extent(t), name, t.storage_offset(), StorageWeakRef(t.untyped_storage()))
               for name, t in batch if t.numel()]
        # a storage freed since may have its address reused by this bucket: the dead are dropped, the newest first
        self._sent = new[::-1] + [s for s in self._sent if not s.storage.expired()]
        self._bucket_first = batch[0][0] if batch else self._bucket_first
        self._scalar_read = False
        self.names.update(dict.fromkeys(name for name, _ in batch))

    @contextlib.contextmanager
    def watching_processing(self, model: nn.Module) -> Iterator[None]:
        """Wrap every layer's post-load processing (its quant method's, or the layer's own: attention) for the
        duration of the block; the wrappers are instance attributes, removed after."""
        installed: list[Any] = []
        for module in model.modules():
            for owner in (getattr(module, "quant_method", None), module):
                method = getattr(owner, PROCESS, None)
                if owner is None or method is None or PROCESS in vars(owner):
                    continue
                object.__setattr__(owner, PROCESS, self._wrap(module, owner, method))
                installed.append(owner)
        try:
            yield
        finally:
            for owner in installed:
                vars(owner).pop(PROCESS, None)

    def _wrap(self, first: nn.Module, owner: Any, method: Any) -> Any:
        def processing(*args: Any, **kwargs: Any) -> Any:
            # a quant method is called with its layer (one method object may serve several layers)
            module = args[0] if owner is not first and args and isinstance(args[0], nn.Module) else first
            before, held = _layout(module), (_held(module), _held(owner))
            outer, self._processing = self._processing, module
            try:
                return method(*args, **kwargs)
            finally:
                self._processing = outer
                if module in self._weighted:  # (a weightless layer: what its processing reads decides, build)
                    changed = sorted({*_changed(held[0], _held(module)), *_changed(held[1], _held(owner))})
                    if changed:
                        self._mark(module, f"its post-load processing sets {', '.join(changed)} (state a copy "
                                           f"cannot update)")
                    if _layout(module) != before:
                        self._mark(module, "its post-load processing replaces or reshapes its tensors")
        return processing

    # ---- the dispatch mode

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self._processing is not None:
            self._see_processing(func, args, kwargs, out)
        elif func is torch.ops.aten.copy_.default:
            self._see_copy(args[0], args[1])
        elif func in CONSTANT_FILLS and self._sent:
            self._see_fill(args[0], float(args[1]) if len(args) > 1 else 0.0)
            self._scalar_read = False
        elif func is torch.ops.aten._local_scalar_dense.default:
            self._scalar_read = self._scalar_read or self._find_sent(args[0]) is not None
        elif func._schema.is_mutable:
            for tensor in _written_args(func, args, kwargs):
                owner = self._owner(tensor)
                if owner is not None:
                    self._mark(owner[0], f"its loader runs {func} on {owner[1]} (not a copy of a sent tensor)")
        return out

    def _see_processing(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        module = self._processing
        inputs = [a for a in _flat(args, kwargs) if isinstance(a, torch.Tensor) and not a.is_meta]
        if module not in self._weighted:
            self.reads.extend((module, _ptr(t)) for t in inputs if t.numel())
        elif func.namespace != "aten":
            self._mark(module, f"its post-load processing runs {func} (a kernel layout of its own)")
        elif _makes_tensors(func) and inputs:
            self._mark(module, f"its post-load processing makes new tensors ({func})")

    def _see_copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.is_meta or src.is_meta:
            return
        owner = self._owner(dst)
        sent = self._find_sent(src)
        if owner is None:
            if sent is not None:
                self.whole = f"a loader copies {sent.name} into a tensor that no layer holds"
            return
        module, name = owner
        if sent is None:
            if _whole(dst, _tensors(module)[name]) and self._layer_tensor(src):
                # a layer's whole tensor into another's (vLLM's reload restoring its kernel tensors, a tensor that
                # never went to meta onto itself, a tied head's into the embedding it shares): its bytes were
                # recorded where the sync wrote them; build checks that some write covers the destination
                self.restored.append((module, name))
                return
            self._mark(module, f"its loader writes {name} from a tensor the sync did not send (a cast or a "
                               f"computed tensor)")
            return
        base = _tensors(module)[name]
        self._weighted.add(module)
        self._last = sent.name
        src_spec = (src.storage_offset() - sent.offset, tuple(src.shape), tuple(src.stride()))
        self.writes.setdefault(sent.name, []).append(
            Write(module, name, _spec(dst, base), src_spec, (tuple(base.shape), base.stride(), base.dtype)))

    def _see_fill(self, dst: torch.Tensor, value: float) -> None:
        """A loader setting part of a layer's tensor to a constant (vLLM pads a vocabulary's rows with zeros): a
        write the plan replays with the same constant, with the sent tensor last copied (the one whose loader this
        is). A value the loader read out of a sent tensor (``fill_(loaded.item())``) is no constant: the proof, which
        sends the same weights, could not tell, so its layer keeps the loader."""
        owner = None if dst.is_meta else self._owner(dst)
        if owner is None:
            return
        module, name = owner
        if self._scalar_read:
            self._mark(module, f"its loader fills {name} with a value read from a sent tensor (not a constant)")
        base = _tensors(module)[name]
        self._weighted.add(module)
        self.fills.setdefault(self._last or self._bucket_first, []).append(
            Write(module, name, _spec(dst, base), (0, (), ()), (tuple(base.shape), base.stride(), base.dtype), value))

    # ---- lookups

    def _find_sent(self, src: torch.Tensor) -> Sent | None:
        """The live sent tensor ``src`` views (the newest, where a freed storage's address came back)."""
        ptr, (lo, hi) = _ptr(src), _extent(src)
        for entry in self._sent:
            if entry.ptr == ptr and entry.lo <= lo and hi <= entry.hi and not entry.storage.expired():
                return entry
        return None

    def _owner(self, tensor: torch.Tensor) -> tuple[nn.Module, str] | None:
        """The layer and name of the engine tensor whose storage ``tensor`` views (layers' tensors are made and
        freed during a reload, so a cached answer is checked before it is used)."""
        ptr = _ptr(tensor)
        hit = self._owners.get(ptr)
        if hit is None or _ptr_of(*hit) != ptr:
            self._owners = {_ptr(t): (m, n) for m in self.model.modules() for n, t in _tensors(m).items()
                            if not t.is_meta}
            hit = self._owners.get(ptr)
        return hit

    def _layer_tensor(self, src: torch.Tensor) -> bool:
        """``src`` is the whole of a layer's own tensor (not a part of one, not a tensor of the loader's)."""
        owner = self._owner(src)
        return owner is not None and _whole(src, _tensors(owner[0])[owner[1]])

    def _mark(self, module: nn.Module, why: str) -> None:
        self.marked.setdefault(module, why)

    # ---- the plan

    def build(self, model: nn.Module, names: dict[int, str]) -> SyncPlan:
        """The plan from what was recorded, against the engine's tensors as they are now (after its processing).
        ``names``: engine tensor id -> the name its loader reports (finish_sync's check)."""
        weights = {_ptr(t) for m in self._weighted for t in _tensors(m).values() if not t.is_meta and t.numel()}
        derived = next((m for m, ptr in self.reads if ptr in weights), None)
        if derived is not None and not self.whole:
            self.whole = (f"{type(derived).__name__}'s post-load processing reads synced weights (derived tensors "
                          f"a copy would leave stale)")
        plan = SyncPlan(whole=self.whole)
        if self.whole:
            return plan
        recorded = {name: [*self.writes.get(name, []), *self.fills.get(name, [])]
                    for name in dict.fromkeys([*self.writes, *self.fills])}
        # a tensor written only from another layer's tensor: no write of a sent tensor reaches it
        covered = {id(_tensors(w.module).get(w.tensor)) for writes in recorded.values() for w in writes}
        for module, name in self.restored:
            if id(_tensors(module).get(name)) not in covered:
                self._mark(module, f"its loader writes {name} from another layer's tensor, never from a sent one")
        # a layer whose own tensors no longer have the layout its loader wrote into: processing changed it
        for writes in recorded.values():
            for w in writes:
                kernel = _tensors(w.module).get(w.tensor)
                if kernel is None or (tuple(kernel.shape), kernel.stride(), kernel.dtype) != w.layout:
                    self._mark(w.module, f"{w.tensor} is kept in another layout than its loader writes")
        fallback = _with_descendants(model, set(self.marked))
        for name, writes in recorded.items():
            if name not in self.writes or any(w.module in fallback for w in writes):
                plan.loader.add(name)
                continue
            plan.writes[name] = [Target(_view(_tensors(w.module)[w.tensor], w.dst), w.src, w.module, w.tensor,
                                        names.get(id(_tensors(w.module)[w.tensor]), w.tensor), w.value)
                                 for w in writes]
        plan.loader.update(n for n in self.names if n not in plan.writes)
        plan.fallback = {m: self.marked.get(m, "a layer inside one that keeps the loader") for m in fallback
                         if _tensors(m)}
        return plan


@dataclass
class Target:
    view: torch.Tensor  # the destination, a view of the engine's own tensor
    src: Spec  # the part of the sent tensor copied there
    module: nn.Module
    tensor: str
    name: str  # the engine's name of the owning tensor
    value: float | None = None  # a constant the loader writes there (padding), instead of ``src``


@dataclass
class SyncPlan:
    """``writes`` is read once into what ``takes`` and ``valid`` check (a sync asks them of every tensor, and their
    Python was about 2 ms a sync of the 0.5B shape: issue 74); ``prove`` reads it again after it drops names. Change
    ``writes`` only before the first of them (tests do, to break a plan)."""
    writes: dict[str, list[Target]] = field(default_factory=dict)  # sent name -> where its bytes go
    loader: set[str] = field(default_factory=set)  # sent names whose layer keeps the engine's loader
    fallback: dict[nn.Module, str] = field(default_factory=dict)  # layers that keep the loader, and why
    whole: str = ""  # why the whole model keeps the loader ("" if it does not)
    proven: bool = False
    _saved: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    _reach: dict[str, int] | None = field(default=None, repr=False)  # sent name -> _reach of its targets
    _owned: list[tuple[nn.Module, str, int]] | None = field(default=None, repr=False)  # (layer, tensor, storage)

    def takes(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether the plan writes this sent tensor (its name recorded, contiguous and long enough for every part
        of it the plan copies: ``_fits``, read once a name)."""
        if self._reach is None:
            self._reach = {n: _reach(targets) for n, targets in self.writes.items()}
        reach = self._reach.get(name, NEVER)
        return reach == 0 or (0 < reach <= tensor.numel() and tensor.is_contiguous())

    def write(self, name: str, tensor: torch.Tensor) -> set[str]:
        """Copy a sent tensor into every destination the loader gave it, one ``copy_`` a destination (the plain
        reference of ``write_all``); returns the engine names written."""
        with torch.no_grad():
            for target in self.writes[name]:
                if target.value is None:
                    target.view.copy_(_view(tensor, target.src))
                else:
                    target.view.fill_(target.value)
        return {t.name for t in self.writes[name]}

    def write_all(self, sent: list[tuple[str, torch.Tensor]]) -> set[str]:
        """``write`` for a bucket of sent tensors (each one the plan ``takes``): every copy in one
        ``torch._foreach_copy_`` (one dispatch for the bucket, casts inside it; a Python ``copy_`` a destination was
        the plan's host cost), then the constants. The proof writes through here too, so what it proves is this.
        Returns the engine names written."""
        dsts, srcs, fills, names = [], [], [], set()
        for name, tensor in sent:
            for target in self.writes[name]:
                if target.value is None:
                    dsts.append(target.view)
                    srcs.append(_view(tensor, target.src))
                else:
                    fills.append(target)
                names.add(target.name)
        with torch.no_grad():
            if dsts:
                torch._foreach_copy_(dsts, srcs)
            for target in fills:
                target.view.fill_(target.value)
        return names

    def owners(self) -> list[torch.Tensor]:
        """The engine tensors the plan writes (each once)."""
        seen: dict[int, torch.Tensor] = {}
        for targets in self.writes.values():
            for t in targets:
                kernel = _tensors(t.module)[t.tensor]
                seen.setdefault(id(kernel), kernel)
        return list(seen.values())

    def valid(self) -> bool:
        """The engine's tensors still live where the plan recorded them: each layer's tensor of that name is on the
        storage its targets view. The (layer, name, storage) the plan writes are read once; a check is one lookup
        of each (not a dict of a layer's tensors rebuilt a target: 1.25 ms for the 0.5B's 290, issue 74)."""
        if self._owned is None:
            self._owned = list(dict.fromkeys((t.module, t.tensor, _ptr(t.view)) for targets in self.writes.values()
                                             for t in targets))
        return all(_ptr_of(module, name) == ptr for module, name, ptr in self._owned)

    def takes_reference(self, name: str, tensor: torch.Tensor) -> bool:
        """``takes`` target by target (its plain reference)."""
        targets = self.writes.get(name)
        return bool(targets) and all(t.value is not None or _fits(tensor, t.src) for t in targets)

    def valid_reference(self) -> bool:
        """``valid`` target by target, each layer's tensors gathered afresh (its plain reference)."""
        def storage(module: nn.Module, name: str) -> int:
            t = _tensors(module).get(name)
            return -1 if t is None or t.is_meta else _ptr(t)
        return all(storage(t.module, t.tensor) == _ptr(t.view) for targets in self.writes.values() for t in targets)

    # ---- the proof (module docstring, 2)

    def scramble(self) -> None:
        """Save every tensor the plan writes (to host memory) and fill it with a pattern: all bits set (a NaN in
        floating types, -1 in integer ones)."""
        with torch.no_grad():
            for kernel in self.owners():
                self._saved[id(kernel)] = (kernel, kernel.detach().to("cpu", copy=True))
                _bits(kernel).fill_(-1)

    def prove(self) -> dict[nn.Module, str]:
        """After the plan alone wrote the same weights: compare each tensor bit for bit with what the loader had
        written. A tensor that differs is put back and its layer (every sent name writing into it) keeps the loader.
        Returns the layers that failed, with the reason."""
        failed: dict[nn.Module, str] = {}
        with torch.no_grad():
            for kernel, saved in self._saved.values():
                same = torch.equal(_bits(kernel).cpu(), _bits(saved))
                if not same:
                    kernel.copy_(saved.to(kernel.device))
                    for targets in self.writes.values():
                        for t in targets:
                            if _tensors(t.module)[t.tensor] is kernel:
                                failed.setdefault(t.module, f"the plan's copy of {t.tensor} differs from what its "
                                                            f"loader wrote")
        self._saved.clear()
        self._reach = self._owned = None  # names leave ``writes`` below
        for module, why in failed.items():
            self.fallback[module] = why
        for name in [n for n, targets in self.writes.items() if any(t.module in failed for t in targets)]:
            self.loader.add(name)
            del self.writes[name]
        self.proven = True
        return failed

    def summary(self) -> str:
        if self.whole:
            return f"every tensor through the engine's loader: {self.whole}"
        counts: dict[str, int] = {}
        for why in self.fallback.values():
            counts[why] = counts.get(why, 0) + 1
        kept = "; ".join(f"{n} layer{'s' * (n > 1)}: {why}" for why, n in sorted(counts.items(), key=lambda x: -x[1]))
        return (f"{len(self.writes)} tensors through the plan (proved bit for bit against the loader), "
                f"{len(self.loader)} through the engine's loader" + (f" ({kept})" if kept else ""))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().view(INT_OF_SIZE[t.element_size()])


def _fits(tensor: torch.Tensor, spec: Spec) -> bool:
    offset, size, stride = spec
    if not tensor.numel():
        return False
    last = offset + sum((s - 1) * st for s, st in zip(size, stride))
    return tensor.is_contiguous() and 0 <= offset and last < tensor.numel()


NEVER = -1


def _reach(targets: list[Target]) -> int:
    """The elements a contiguous sent tensor must hold for ``_fits`` to pass for every target copied from it: 0 where
    every target is a constant (any tensor is taken), NEVER where none could be (no target, or one before the
    tensor's start)."""
    copies = [t.src for t in targets if t.value is None]
    if not targets or any(offset < 0 for offset, _, _ in copies):
        return NEVER
    if not copies:
        return 0
    return max(1, *(offset + sum((s - 1) * st for s, st in zip(size, stride)) + 1 for offset, size, stride in copies))


def _layout(module: nn.Module) -> dict[str, tuple]:
    return {n: (_ptr(t), tuple(t.shape), t.stride(), t.dtype) for n, t in _tensors(module).items() if not t.is_meta}


def _whole(view: torch.Tensor, base: torch.Tensor) -> bool:
    """``view`` is all of ``base`` (its storage, offset, shape and strides)."""
    return (_ptr(view) == _ptr(base) and view.storage_offset() == base.storage_offset()
            and view.shape == base.shape and view.stride() == base.stride())


def _ptr_of(module: nn.Module, name: str) -> int:
    """The storage of a layer's own parameter or buffer ``name`` (-1: none, or on meta), looked up directly (no
    ``_tensors`` dict)."""
    t = module._parameters.get(name)
    if t is None:
        t = module._buffers.get(name)
    return -1 if t is None or t.is_meta else _ptr(t)


def _changed(before: dict[str, int], after: dict[str, int]) -> list[str]:
    return [k for k, v in after.items() if before.get(k) != v]


def _with_descendants(model: nn.Module, marked: set[nn.Module]) -> set[nn.Module]:
    """The marked layers and every layer inside one (a reload of a layer takes its children with it)."""
    out = set(marked)
    for module in model.modules():
        if module in marked:
            out.update(module.modules())
    return out


def _flat(args: tuple, kwargs: dict) -> list[Any]:
    out: list[Any] = []
    for a in [*args, *kwargs.values()]:
        out.extend(a if isinstance(a, (list, tuple)) else [a])
    return out


def _written_args(func: Any, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if isinstance(value, torch.Tensor) and not value.is_meta:
                out.append(value)
    return out


def _makes_tensors(func: Any) -> bool:
    """An op that returns a tensor of its own (not a view of an input, not an input written in place)."""
    return any(str(r.type) in ("Tensor", "Tensor[]", "Optional[Tensor]") and r.alias_info is None
               for r in func._schema.returns)
