"""One vLLM engine's weight syncs: which sent tensors go through the sync plan (lib.engine.plan) and which through
vLLM's loader, the plan's states, the tied head, and the check that every parameter was written.

The plan's states, one sync each (``EngineSync.state``):

    record -> prove -> ready          (off: vLLM's loader every sync; a plan with nothing to write ends there too)

- **record**: the sync goes through vLLM's loader (one layerwise reload of the whole model), watched by a
  ``Recorder``; at its end the plan is built and the same weights are asked for once more (``finish`` returns True);
- **prove**: that second pass goes through the plan alone into scrambled tensors and is compared bit for bit;
- **ready**: the plan writes what it holds, the layers that keep the loader get a reload of their own.

Names: a parameter's name is its FIRST path in ``named_parameters()`` (the rule torch uses to drop duplicates).
vLLM registers some modules twice: 0.25 ties a head by ``self.lm_head = self.model.embed_tokens``, and its MoE
runner holds the block's router gate again as its own child. The plan's targets are named by that same rule, so
what a sync writes and what the check expects are one set of names.

Nothing here imports vLLM: the engine passes ``run`` (calls a function with vLLM's model, inside vLLM's config
context) and ``reload`` (opens or closes a layerwise reload: ``reload(begin, layers)``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from lib.engine import in_engine_dtype
from lib.engine.plan import Recorder, SyncPlan

log = logging.getLogger("lib.engine.vllm")  # the engine's logger: what users filter on

RunOnModel = Callable[[Callable[[nn.Module], Any]], None]
Reload = Callable[[bool, "list[nn.Module] | None"], None]


def lm_head(model: nn.Module) -> nn.Module | None:
    """The head a model samples from: its own ``lm_head``, or its language model's (vLLM's vision-language classes:
    0.25's Qwen2.5-VL and Qwen3-VL hold only ``language_model.lm_head``)."""
    head = getattr(model, "lm_head", None)
    if isinstance(head, nn.Module):
        return head
    language = model.get_language_model() if hasattr(model, "get_language_model") else None
    language = language if isinstance(language, nn.Module) else getattr(model, "language_model", None)
    head = getattr(language, "lm_head", None) if language is not None else None
    return head if isinstance(head, nn.Module) else None


def embedding_modules(model: nn.Module) -> list[nn.Module]:
    """The modules registered under a name ending in ``embed_tokens`` (the language model's input embedding)."""
    return [m for n, m in model.named_modules(remove_duplicate=False) if n.split(".")[-1] == "embed_tokens"]


def tensor_names(model: nn.Module) -> dict[int, str]:
    """Each parameter and buffer by identity -> its first path (``named_parameters()``' own choice), LoRA's
    ``.base_layer.`` taken out (vLLM's loader reports the plain name)."""
    names: dict[int, str] = {}
    for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), n.replace(".base_layer.", "."))
    return names


def reported_aliases(params: frozenset[str]) -> dict[str, str]:
    """The names a loader may report for a parameter, mapped to it (made once per engine). vLLM 0.32 reports each
    parameter by its own name. vLLM 0.25's fused-MoE layer is a ``MoERunner`` whose child ``routed_experts`` holds
    the experts' weights; ``RoutedExperts.load_weights`` yields names relative to itself and the runner passes them
    up unchanged, so the loader reports ``...mlp.experts.w13_weight`` for ``...mlp.experts.routed_experts.w13_weight``
    (the bytes are written; the H100 run of 2026-11-27 failed its MoE sync on the name). A name that is no parameter
    stands for the one parameter that is it with a single module inserted before its last part (none, or several:
    no alias, and the check names what was not written)."""
    inner: dict[str, list[str]] = {}
    for name in params:
        parts = name.split(".")
        if len(parts) >= 3:
            inner.setdefault(".".join(parts[:-2] + parts[-1:]), []).append(name)
    return {alias: found[0] for alias, found in inner.items() if len(found) == 1 and alias not in params}


def written_parameters(reported: Iterable[str], params: frozenset[str]) -> set[str]:
    """The engine's parameter names that a loader's reported names stand for (``reported_aliases``)."""
    aliases = reported_aliases(params)
    return {aliases.get(name, name) for name in reported}


class EngineSync:
    """The sync state of one engine (module docstring). ``param_names``: the engine's parameters as
    ``named_parameters()`` names them, read before any reload; ``tied_head``: the config ties the head to the
    embedding; ``use_plan``: record a plan at the first sync (False: vLLM's loader every sync); ``dtype``: the
    engine's, which the loader's tensors are cast to (the plan's copies cast inside their foreach: a whole fp32
    shard comes uncast, lib.sync)."""

    def __init__(self, run: RunOnModel, reload: Reload, param_names: frozenset[str], tied_head: bool,
                 use_plan: bool, rank: int = 0, metrics: dict[str, float] | None = None,
                 dtype: torch.dtype | None = None):
        self.run, self.reload, self.rank, self.dtype = run, reload, rank, dtype
        self.param_names, self.tied_head = param_names, tied_head
        self.aliases = reported_aliases(param_names)  # what a release's loader may report instead of a name
        self.metrics = metrics if metrics is not None else {}
        self.state = "record" if use_plan else "off"
        self.plan: SyncPlan | None = None
        self.wide: set[str] = set()  # sent names the plan rounds to the engine's dtype first (finish)
        self.recorder: Recorder | None = None
        self.recording = contextlib.ExitStack()  # the processing wrappers of the record sync
        self.syncing = False  # a sync has sent its first bucket
        self.loading = False  # inside a layerwise reload (from the first loader bucket to finish_load)
        self.head: nn.Module | None = None  # the sampling head, found when the plan is built
        self.embedding: tuple[str, torch.Tensor] | None = None  # (its name, the tensor) of this sync
        self.written: set[str] | None = set()  # the vLLM names one sync wrote (None: its loader does not say)
        self.counts = {"plan": 0, "loader": 0}
        self.batched = True  # the plan's copies of a bucket in one foreach (False: a copy_ each; bench_sync's row)

    # ---- one sync

    def load(self, batch: list[tuple[str, torch.Tensor]]) -> None:
        """One bucket of (HF name, tensor): the plan's tensors copied in place, the rest through vLLM's loader inside
        one layerwise reload per sync (of the layers that keep the loader, or of the whole model)."""
        if not self.syncing:
            self._begin()
        if self._head_loads():
            # vLLM's loader skips lm_head.weight for a tied model, and during a layerwise reload a head layer of its
            # own sits on meta apart from the embedding: keep the embedding to load the head with (finish)
            self.embedding = next(((n, t) for n, t in batch if n.endswith("embed_tokens.weight")), self.embedding)
        if self.state in ("prove", "ready"):  # prove: the second pass, the plan alone into scrambled tensors
            takes = [self.plan.takes(n, t) for n, t in batch]
            # a tensor the engine keeps wider than its dtype gets the loader's value: the sent one rounded first
            taken = [self._in_dtype(w) if w[0] in self.wide else w for w, take in zip(batch, takes) if take]
            if self.batched:
                written = self.plan.write_all(taken)
            else:
                written = set().union(*(self.plan.write(n, t) for n, t in taken))
            if self.state == "prove":
                return
            self._wrote(written)
            self.counts["plan"] += len(taken)
            batch = [w for w, take in zip(batch, takes) if not take]
            if not batch:
                return
        self.counts["loader"] += len(batch)
        batch = [self._in_dtype(w) for w in batch]  # vLLM's loaders are written for the engine's dtype
        if self.embedding is not None:  # the head's copy the same tensor as the embedding's (the record sync's plan)
            self.embedding = next((w for w in batch if w[0] == self.embedding[0]), self.embedding)
        if not self.loading:
            self.reload(True, list(self.plan.fallback) if self.state == "ready" else None)
            self.loading = True
            if self.recorder is not None:  # the record sync: its processing watched until the reload closes
                self.run(lambda model: self.recording.enter_context(self.recorder.watching_processing(model)))

        def load(model: nn.Module) -> None:
            with self._recording_mode(batch):
                loaded = model.load_weights(batch)  # the vLLM names written (fused q/k/v count once)
            if loaded is None:
                self.written = None  # a model whose loader does not say: nothing to verify against
            else:
                self._wrote(loaded)

        self.run(load)

    def finish(self) -> bool:
        """The last call of a sync: load the tied head (``_load_tied_head``), then check that every vLLM parameter was
        written, so the engine never samples from a dummy or stale tensor. Returns True when the same weights must be
        sent once more: the record sync proves its plan with them."""
        if not self.syncing:
            return False
        self.syncing = False
        if self.state == "prove":
            self.embedding = None
            self._prove()
            return False
        if self.loading and self._head_loads():
            if self.embedding is not None:
                self.embedding = self._in_dtype(self.embedding)
            with self._recording_mode([self.embedding] if self.embedding is not None else []):
                self._load_tied_head()
        self.embedding = None
        if self.written is not None:
            missing = sorted(self.param_names - self.written)
            if missing:
                raise RuntimeError(f"the weight sync left {len(missing)} vLLM parameters unwritten: {missing[:5]}")
        self.metrics["sync/plan_tensors"] = float(self.counts["plan"])
        self.metrics["sync/loader_tensors"] = float(self.counts["loader"])
        if self.state != "record":
            return False
        with self.recorder:  # the reload's close runs the last layers' processing (attention: always here)
            self.finish_load()
        self.recording.close()
        model = self.recorder.model
        self.plan, self.recorder = self.recorder.build(model, tensor_names(model)), None
        # the names whose copies write a tensor kept wider than the engine's dtype (a parameter kept in fp32): the
        # plan's copy would keep what the loader rounds, and its proof (bit for bit) would fail
        self.wide = set() if self.dtype is None else {
            n for n, targets in self.plan.writes.items()
            if any(t.value is None and t.view.dtype != self.dtype for t in targets)}
        unknown = sorted({t.name for targets in self.plan.writes.values() for t in targets}
                         - self.param_names - {n.replace(".base_layer.", ".") for n, _ in model.named_buffers()})
        if unknown:  # the check below would miss these: a naming rule of ours out of step with torch's
            raise RuntimeError(f"the sync plan names tensors the engine does not: {unknown[:5]}")
        self.head = lm_head(model)
        if self.plan.whole or not self.plan.writes:
            self.state = "off"
            log.warning("weight sync: %s", self.plan.summary())
            return False
        self.state = "prove"
        return True

    def finish_load(self) -> None:
        """Close the sync's layerwise reload (the engine's KV wake: generation needs it closed)."""
        if self.loading:
            self.reload(False, None)
            self.loading = False

    def use_plan(self, on: bool) -> None:
        """Between the plan and vLLM's loader from the next sync on: on, the plan already proved, or recorded at the
        next sync if there is none."""
        if self.syncing:
            raise RuntimeError("use_sync_plan during a sync")
        if not on:
            self.state = "off"
        else:
            proven = self.plan is not None and self.plan.proven and bool(self.plan.writes)
            self.state = "ready" if proven else "record"

    def close(self) -> None:
        """The reload closed and the plan dropped: its views hold the engine's weight storages (on a GPU vLLM's
        sleep allocator's, which serves one engine a process)."""
        self.finish_load()
        self.recording.close()
        self.plan = self.recorder = None
        self.embedding = None
        self.state = "off"

    # ---- inside

    def _begin(self) -> None:
        self.syncing = True
        self.written, self.embedding = set(), None
        self.counts = {"plan": 0, "loader": 0}
        if self.state == "ready" and not self.plan.valid():
            log.warning("weight sync: vLLM's tensors moved since the plan was recorded; recording it again")
            self.state, self.plan = "record", None
        if self.state == "record":
            model: list[nn.Module] = []
            self.run(model.append)
            self.recorder = Recorder(model[0])
            self._proof_t0 = time.perf_counter()
        elif self.state == "prove":
            self.plan.scramble()

    def _head_loads(self) -> bool:
        """Whether this sync loads a tied head: through the loader, unless the plan writes the head's layer."""
        return self.tied_head and (self.state in ("record", "off") or (self.state == "ready" and self.head_reloads()))

    def head_reloads(self) -> bool:
        """The head's layer keeps vLLM's loader under the plan (read from the plan's fallback, which the proof may
        grow), so each sync reloads it."""
        return self.head is not None and self.head in self.plan.fallback

    def _wrote(self, names: Iterable[str]) -> None:
        if self.written is not None:  # an earlier loader of this sync did not say what it wrote: nothing to check
            self.written |= {self.aliases.get(n, n) for n in names}

    def _in_dtype(self, weight: tuple[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
        return weight[0], in_engine_dtype(weight[1], self.dtype)

    def _recording_mode(self, batch: list[tuple[str, torch.Tensor]]) -> Any:
        if self.recorder is None:
            return contextlib.nullcontext()
        self.recorder.sending(batch)
        return self.recorder

    def _prove(self) -> None:
        self.plan.prove()
        self.state = "ready" if self.plan.writes else "off"
        self.metrics["sync/plan_proof_seconds"] = time.perf_counter() - self._proof_t0
        if self.rank == 0:
            log.warning("weight sync: %s", self.plan.summary())

    def _load_tied_head(self) -> None:
        """Write the synced embedding into the tied head's own layer. Without it, finalising the reload puts the
        head's previous kernel tensors back (on CPU a packed copy of the start weights), so vLLM would sample from a
        head the trainer no longer has: logp_abs_diff 0.26 on a tied model after one step. A head that is the
        embedding module itself (vLLM 0.25's ties) was written with it."""
        if self.embedding is None:
            raise RuntimeError("the weight sync of a tied-embedding model sent no embed_tokens.weight")
        embedding = self.embedding[1]

        def load(model: nn.Module) -> None:
            head = lm_head(model)
            if head is None:
                raise RuntimeError(f"{type(model).__name__} has no lm_head (nor its language model): the tied head "
                                   f"cannot be written")
            if any(head is e for e in embedding_modules(model)):
                return
            head.weight.weight_loader(head.weight, embedding)

        self.run(load)
