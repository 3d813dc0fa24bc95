"""The Hugging Face rollout engine: an unsharded replica with the vLLM lifecycle, for CPU and as GPU fallback.

The replica holds no memory while asleep at level 2 (parameters on the meta device) and sits on CPU at
level 1. ``load_weights`` fills it from the streamed full tensors of the FSDP model (lib/sync.py), so CPU
tests exercise the same sync path as GPU runs. Generation is a batched sampling loop with a KV cache;
the sampler draws from its own ``torch.Generator``, never from the training RNG.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from collections.abc import Iterable
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, DynamicCache, cache_utils

from lib import routing, watchdog
from lib.data import left_pad
from lib.engine import awake
from lib.engine.kv import reserve
from lib.engine import (PromptImages, SamplingConfig, Turn, build_output, call_seed, expand_samples, filtering,
                        in_engine_dtype, rollout_columns, stop_ids, turns_from)
from lib.logprobs import kept_mask
from lib.lora import base_name, check_engine_load, inject, is_adapter_param, peft_name
from lib.models import padded_attention, persistent_buffers, retie, tied_aliases
from lib.protocol import DataProto
from lib.vision import attn_implementations, ban, concat_features, placeholder_ids, type_ids
from lib.vision.rope import continue_positions, with_text_row


def _no_init():
    try:  # the module moved in transformers 5: the import tries both homes
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def copyable(cache: Any) -> bool:
    """Whether ``cache.batch_repeat_interleave`` copies everything a prompt's prefill left in ``cache``: every layer
    a key/value layer that has it. Linear-attention and convolution layers (Gated DeltaNet, LFM2's short
    convolutions, Mamba-2) hold states that method does not copy (transformers 5 gives some none, and a layer that
    mixes both kinds inherits the key/value one, which leaves the states of the first sample alone), and a cache
    whose layers are made lazily cannot be judged before the prefill: for those the engine prefills per sample."""
    states = getattr(cache_utils, "LinearAttentionCacheLayerMixin", ())
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(hasattr(layer, "batch_repeat_interleave") and not isinstance(layer, states)
                                for layer in layers)


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """-inf at all but the tokens top-k, then top-p keep (vLLM's rule, lib.logprobs.kept_mask); ``logits`` (B, V)
    float32, already divided by the temperature."""
    return logits.masked_fill(~kept_mask(logits, top_k, top_p), float("-inf"))


class HFEngine:
    def __init__(self, config: Any, device: torch.device, pad_token_id: int, eos_token_ids: list[int],
                 sampling: SamplingConfig, val_sampling: SamplingConfig | None = None, dtype: torch.dtype | None = None,
                 rank_seed: int = 0, attn_implementation: str = "auto", batch_tokens: int = 65536, lora: Any = None,
                 vision: bool = False, routes: bool = False, name: str = "policy"):
        """``eos_token_ids``: every id that ends a response (lib.models.stop_token_ids). ``attn_implementation``:
        auto picks sdpa, or eager for models transformers runs only that way (lib.models.padded_attention).
        ``batch_tokens``: prompt + response tokens generated together (see ``generate``). ``lora``: a PEFT
        LoraConfig: the replica carries the same LoRA layers as the trainer, the adapter in fp32, filled by
        ``load_adapter`` and never merged into the base. ``vision``: the replica is the vision-language class (the
        prompts' images go to its generate); else a vision-language checkpoint's language model alone. ``routes``: a
        mixture-of-experts model's routers are recorded while it samples (lib/routing; training calls only), and the
        rollout carries them as ``routed_experts``. ``name``: the engine's name in lib.engine.awake's log."""
        self.name = name
        self.device, self.pad_id, self.eos_ids = device, pad_token_id, list(eos_token_ids)
        self.sampling, self.val_sampling = sampling, val_sampling or SamplingConfig(temperature=0.0,
                                                                                    max_new_tokens=sampling.max_new_tokens)
        self.dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
        self.rank_seed, self.batch_tokens = rank_seed, batch_tokens
        self.calls = {False: 0, True: 0}  # per kind: validating never shifts the training samples
        attn = padded_attention(config, attn_implementation)
        with torch.device("cpu"), _no_init():
            if vision:
                self.model = AutoModelForImageTextToText.from_config(
                    config, attn_implementation=attn_implementations(config, attn), dtype=self.dtype)
            else:
                self.model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=self.dtype)
        self.model.tie_weights()  # transformers skips the tie when building without weight init
        self.lora = lora
        if lora is not None:

            inject(self.model, lora)
            for name, param in self.model.named_parameters():
                if is_adapter_param(name):  # the adapter in fp32 whatever the base's dtype (PEFT casts x to it)
                    param.data = param.data.float()
        self.model.eval().requires_grad_(False)
        self.cache_arg = cache_keyword(self.model)
        self.routing = routing.install(self.model) if routes else None
        self.vision = vision
        self.banned = placeholder_ids(config) if vision else []  # never sampled (lib.vision.placeholder_ids)
        # tied embeddings: lm_head.weight is embed_tokens.weight. Moving to and from meta unties them; they are
        # tied again at every wake, and a sync writes the one tensor under its listed name
        self.aliases = tied_aliases(self.model)
        # buffers (rotary inv_freq) are computed in __init__, not loaded: keep them to restore after a wake
        self._buffers = {n: b.clone() for n, b in self.model.named_buffers()}
        self._moved()
        self._written: set[str] = set()
        self.base_loaded = False
        """Every base parameter written since the weights last woke from level 2 (a level-1 sleep keeps them)."""
        self.adapter_version: int | None = None
        self._adapter_written: set[str] = set()
        self.level = 0
        self.metrics: dict[str, float] = {}
        self.sleep(2)

    # ---- lifecycle

    def _mem(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device) / 2**30
        return sum(p.numel() * p.element_size() for p in self.model.parameters() if not p.is_meta) / 2**30

    def sleep(self, level: int = 2) -> None:
        """Level 1: the replica moves to CPU (weights kept). Level 2: the replica's memory is freed."""
        self.metrics["engine/mem_before_sleep_gb"] = self._mem()
        self.model.to("meta" if level == 2 else "cpu")
        self._moved()
        self.level = level
        awake.slept(self.name)
        if level == 2:
            self._written = set()
            self.base_loaded = False
            self.adapter_version, self._adapter_written = None, set()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.metrics["engine/mem_after_sleep_gb"] = self._mem()

    def wake_up(self, tags: Iterable[str] = ("weights", "kv_cache")) -> None:
        """``weights``: allocate (level 2, contents undefined until load_weights) or bring back (level 1).
        ``kv_cache``: nothing to do; the HF cache is allocated per generate call."""
        if "weights" in tags and self.level:
            self.metrics["engine/mem_before_wake_gb"] = self._mem()
            if self.level == 2:
                self.model.to_empty(device=self.device)
                for name, buf in self.model.named_buffers():
                    buf.copy_(self._buffers[name])
            else:
                self.model.to(self.device)
            self._moved()
            self.level = 0
            awake.woke(self.name)
            self.metrics["engine/mem_after_wake_gb"] = self._mem()

    def _moved(self) -> None:
        """After the replica moved: tie its aliases again (moves to and from meta untie them) and list its
        parameters anew (the moved tensors)."""
        retie(self.model, self.aliases)
        # base parameters under their HF names (a LoRA layer's base_layer.weight is the plain weight), the
        # adapter's under the names of PEFT's files
        named = list(self.model.named_parameters())
        self._params = {base_name(n): p for n, p in named if not is_adapter_param(n)}
        # weights that are not parameters come with the sync too (their trained values, not __init__'s)
        self._params.update({base_name(n): b for n, b in persistent_buffers(self.model)})
        self._adapter = {peft_name(n): p for n, p in named if is_adapter_param(n)}

    def reset_prefix_cache(self) -> None:
        pass  # no cross-request cache to invalidate

    def close(self) -> None:
        self.sleep(2)  # nothing outside this object to shut down

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if self.level:
            raise RuntimeError("load_weights on a sleeping engine: call wake_up(['weights']) first")
        for name, tensor in weights:
            if name in self.aliases:
                raise KeyError(f"the engine ties {name!r} to {self.aliases[name]!r} (tied embeddings) but the weights "
                               f"sent hold {name!r} as a tensor of its own: the trained model lost the tie")
            if name not in self._params:
                raise KeyError(f"engine has no parameter {name!r} (renamed, or another architecture?)")
            (p := self._params[name]).copy_(tensor if p.dtype == self.dtype else in_engine_dtype(tensor, self.dtype))
            self._written.add(name)

    def finish_sync(self) -> bool:
        """The last call of a sync: every parameter was written since the weights woke (a tied alias is its
        target), so the engine never samples from a stale or uninitialised tensor. Never asks for a second pass."""
        missing = sorted(set(self._params) - self._written)
        if self.level == 0 and missing:
            raise RuntimeError(f"the weight sync left {len(missing)} engine parameters unwritten: {missing[:5]}")
        self.base_loaded = self.level == 0
        return False

    @torch.no_grad()
    def load_adapter(self, version: int, tensors: dict[str, torch.Tensor]) -> None:
        """Write adapter ``version`` (PEFT names -> tensors) into the replica's LoRA layers, in fp32. Every adapter
        tensor must come, and nothing else: a sync that delivers none, or misses one, raises."""
        check_engine_load(bool(self.level), self.lora, version, tensors)
        missing, extra = sorted(set(self._adapter) - set(tensors)), sorted(set(tensors) - set(self._adapter))
        if missing or extra:
            raise RuntimeError(f"adapter version {version} does not fit the engine's LoRA layers: missing {missing[:3]} "
                               f"({len(missing)}), unknown {extra[:3]} ({len(extra)})")
        for name, tensor in tensors.items():
            self._adapter[name].copy_(tensor)
        self.adapter_version, self._adapter_written = version, set(tensors)

    def adapter_state(self) -> tuple[int | None, int]:
        """(the adapter version the engine holds, the number of LoRA modules it fills)."""
        return self.adapter_version, len({n.split(".lora_")[0] for n in self._adapter_written})

    # ---- generation

    def _generator(self, seed: int, validate: bool, key: int) -> torch.Generator:
        g = torch.Generator(device=self.device)
        g.manual_seed(call_seed(seed, self.rank_seed, validate, key))
        return g

    @torch.no_grad()
    def generate(self, data: DataProto, validate: bool = False) -> DataProto:
        """Rows: left-padded ``input_ids``/``attention_mask``/``position_ids`` prompts. Returns the rollout fields
        (lib.engine.build_output) plus the input's non-tensors, ``n`` samples per prompt, interleaved.

        Memory is bounded whatever the batch: prompts go in chunks of at most ``batch_tokens`` prompt + response
        tokens (n samples each), each prompt is prefilled once and its KV cache copied to its n samples, and only
        the last position's logits are computed. Samples are drawn from the call's generator chunk after chunk:
        the same batch, seed and ``batch_tokens`` give the same samples."""
        if self.level:
            raise RuntimeError("generate on a sleeping engine: call wake_up() first")
        sp = self.val_sampling if validate else self.sampling
        t0 = time.perf_counter()
        key = data.meta_info.get("seed_key", self.calls[validate])
        ids = data.batch["input_ids"].to(self.device)
        mask = data.batch["attention_mask"].to(self.device)
        pos = data.batch["position_ids"].to(self.device)
        rope = data.batch.get("rope_position_ids")
        images = data.non_tensor_batch.get("multi_modal")
        record = self.routing is not None and not validate
        responses, logprob_lists, kept, routes = self._generate_chunks(
            ids, mask, pos, sp, self._generator(sp.seed, validate, key), self.stop_ids(validate), rope, images, record)
        self.calls[validate] += 1
        data = expand_samples(data, sp.n)
        rope = data.batch.get("rope_position_ids")
        fields = build_output(data.batch["input_ids"].to(self.device), data.batch["attention_mask"].to(self.device),
                              data.batch["position_ids"].to(self.device), responses, logprob_lists, self.pad_id,
                              prompt_rope=None if rope is None else rope.to(self.device), kept=kept)
        if record:
            fields[routing.KEY] = routes[:, :fields["input_ids"].shape[1]]
        elapsed = time.perf_counter() - t0
        num_tokens = sum(len(r) for r in responses)
        meta = {"generate_s": elapsed, "generated_tokens": num_tokens, "tokens_per_s": num_tokens / max(elapsed, 1e-9)}
        return DataProto.from_dict(fields, rollout_columns(data), {**data.meta_info, **meta})

    def stop_ids(self, validate: bool = False) -> list[int]:
        return stop_ids(self.eos_ids, self.val_sampling if validate else self.sampling)

    @torch.no_grad()
    def generate_ids(self, prompts: list[list[int]], max_tokens: list[int], validate: bool, key: Any,
                     media: list[PromptImages] | None = None) -> list[Turn]:
        """One sample per prompt (token ids, no padding), each cut at its own ``max_tokens``: a multi-turn loop's
        turn. Prompts are left-padded and generated in chunks of ``batch_tokens`` as in ``generate``; the samples
        come from the generator of (seed, rank, validate, ``key``). ``media``: a vision-language prompt's image
        features go in with the prefill, its rope rows continuing over the turns so far."""
        if self.level:
            raise RuntimeError("generate on a sleeping engine: call wake_up() first")
        if not prompts:
            return []
        sp = self.val_sampling if validate else self.sampling
        one = dataclasses.replace(sp, n=1, max_new_tokens=max(max_tokens))
        width = max(map(len, prompts))
        ids, mask, pos = (x.to(self.device) for x in left_pad(prompts, width, self.pad_id))
        rope, images = None, None
        if media is not None:
            images = [m.features for m in media]
        if media is not None and media[0].rope is not None:
            rope = torch.zeros(len(prompts), 3, width, dtype=torch.long)
            for i, (p, m) in enumerate(zip(prompts, media)):
                turns = continue_positions(m.rope, len(p) - m.prompt_len)
                rope[i, :, width - len(p):] = torch.cat([m.rope, turns], -1)
        stop = self.stop_ids(validate)
        responses, logps, kept, _ = self._generate_chunks(ids, mask, pos, one, self._generator(sp.seed, validate, key),
                                                          stop, rope, images)
        return turns_from(responses, logps, max_tokens, set(stop), kept)

    stops_mid_call = False
    """A static batch: no ``generate_until`` (partial rollouts generate in chunks of ``generate_ids``)."""

    def any_active(self, active: bool) -> bool:
        """Whether this rank still has requests (each rank generates alone)."""
        return active

    def _generate_chunks(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, sp: SamplingConfig,
                         gen: torch.Generator, stop_ids: list[int], rope: torch.Tensor | None = None,
                         images: Any = None, record: bool = False
                         ) -> tuple[list[list[int]], list[list[float]], list[list[int]] | None, torch.Tensor | None]:
        """Left-padded prompts in chunks of at most ``batch_tokens`` prompt + response tokens (n samples each).
        ``rope`` (B, 3, P) and ``images`` (per row, its image features or None): a vision-language prompt's.
        Returns the responses, their log-probs, with top-k/top-p sampling the kept set's size at each token (else
        None), and with ``record`` the routes (B * n, P + max new tokens, MoE layers, k) (lib/routing), else None."""
        stop = torch.tensor(stop_ids, device=self.device)
        per_chunk = max(1, self.batch_tokens // ((ids.shape[1] + sp.max_new_tokens) * sp.n))
        responses, logps, kept, routes = [], [], [], []
        for start in range(0, ids.shape[0], per_chunk):
            rows = slice(start, start + per_chunk)
            r, lp, k, rt = self._generate_chunk(ids[rows], mask[rows], pos[rows], sp, gen, stop,
                                                None if rope is None else rope[rows].to(self.device),
                                                None if images is None else images[rows], record)
            responses += r
            logps += lp
            kept += k
            routes.append(rt)
        return responses, logps, kept if filtering(sp) else None, torch.cat(routes) if record and routes else None

    def _generate_chunk(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, sp: SamplingConfig,
                        gen: torch.Generator, stop: torch.Tensor, rope: torch.Tensor | None = None,
                        images: Any = None, record: bool = False
                        ) -> tuple[list[list[int]], list[list[float]], list[list[int]], torch.Tensor | None]:
        """Prompts (b, P) -> b * n responses (eos included), their log-probs and kept sets' sizes, samples of a prompt
        adjacent.
        A vision-language prompt's images go in with the prefill, its rope rows beside the text positions.
        ``record``: the routers' choices too, (b * n, P + max new tokens, MoE layers, k), -1 where none."""
        with routing.recording(self.model) if record else contextlib.nullcontext() as recorded:
            width = ids.shape[1]
            first, copy, prefill_rows, out = self._sample_chunk(ids, mask, pos, sp, gen, stop, rope, images)
        if not record:
            return (*out, None)
        routes = routing.from_calls(recorded, prefill_rows, sp.n if copy else 1)
        return (*out, routing.place(routes, first, width + sp.max_new_tokens))

    def _sample_chunk(self, ids: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor, sp: SamplingConfig,
                      gen: torch.Generator, stop: torch.Tensor, rope: torch.Tensor | None, images: Any
                      ) -> tuple[int, bool, int, tuple[list[list[int]], list[list[float]], list[list[int]]]]:
        """_generate_chunk's sampling: (the first column kept, whether a prompt's cache was copied to its samples,
        the prefill's rows, (responses, log-probs, kept sets' sizes: the vocabulary's without top-k/top-p))."""
        keep = mask.bool().any(0)  # columns where every prompt of the chunk is padding carry nothing
        first = int(keep.float().argmax()) if bool(keep.any()) else 0
        ids, mask, pos = ids[:, first:], mask[:, first:], pos[:, first:]
        rope = None if rope is None else rope[:, :, first:]
        # the model's own cache layers: sliding-window layers keep only their window, linear-attention and
        # convolution layers their state
        cache = reserve(DynamicCache(config=self.model.config), ids.shape[1] + sp.max_new_tokens)
        copy = sp.n > 1 and copyable(cache)
        if sp.n > 1 and not copy:  # a cache that cannot be copied exactly: each sample prefills its own
            ids, mask, pos = (x.repeat_interleave(sp.n, 0) for x in (ids, mask, pos))
            rope = None if rope is None else rope.repeat_interleave(sp.n, 0)
            images = None if images is None else [row for row in images for _ in range(sp.n)]
        prefill_rows = ids.shape[0]
        logits = self.model(input_ids=ids, attention_mask=mask, position_ids=with_text_row(pos, rope),
                            use_cache=True, logits_to_keep=1, **concat_features(images, self.device),
                            **(type_ids(self.model.config, ids) if self.vision else {}),
                            **{self.cache_arg: cache}).logits[:, -1]
        logits = ban(logits, self.banned).float()
        if copy:  # one prefill per prompt, its cache copied to the n samples
            cache.batch_repeat_interleave(sp.n)
            logits, mask, pos = (x.repeat_interleave(sp.n, 0) for x in (logits, mask, pos))
            rope = None if rope is None else rope.repeat_interleave(sp.n, 0)
        batch = logits.shape[0]
        out_tokens, out_logp, out_kept = [], [], []
        cut = filtering(sp)
        done = torch.zeros(batch, dtype=torch.bool, device=self.device)
        step_pos, full_mask = pos[:, -1:], mask
        for step in range(sp.max_new_tokens):
            watchdog.beat()
            if step:
                step_pos = step_pos + 1
                full_mask = torch.cat([full_mask, torch.ones_like(full_mask[:, :1])], 1)
                step_rope = None if rope is None else continue_positions(rope, 1, step - 1)
                logits = self.model(input_ids=token[:, None], attention_mask=full_mask,
                                    position_ids=with_text_row(step_pos, step_rope), use_cache=True,
                                    logits_to_keep=1, **{self.cache_arg: cache}).logits[:, -1]
                logits = ban(logits, self.banned).float()
            if sp.temperature > 0:
                scaled = logits / sp.temperature
                if cut:  # the filter and its kept sets' sizes only where it keeps less than everything
                    scaled = filter_logits(scaled, sp.top_k, sp.top_p)
                    out_kept.append(torch.isfinite(scaled).sum(-1))
                token = torch.multinomial(torch.softmax(scaled, dim=-1), 1, generator=gen).squeeze(-1)
            else:
                scaled = logits
                token = logits.argmax(-1)
            # log-prob under the distribution sampled from (vLLM's processed log-probs); with top_k/top_p off
            # it is the temperature-scaled one the trainer recomputes
            logp = torch.log_softmax(scaled, -1).gather(-1, token[:, None]).squeeze(-1)
            token = torch.where(done, torch.full_like(token, self.pad_id), token)
            out_tokens.append(token)
            out_logp.append(torch.where(done, torch.zeros_like(logp), logp))
            done = done | torch.isin(token, stop)
            if bool(done.all()):
                break
        tokens = torch.stack(out_tokens, 1).cpu() if out_tokens else torch.zeros(batch, 0, dtype=torch.long)
        logps = torch.stack(out_logp, 1).cpu() if out_logp else torch.zeros(batch, 0)
        kept = torch.stack(out_kept, 1).cpu() if out_kept else torch.zeros(batch, tokens.shape[1], dtype=torch.long)
        responses, logprob_lists, kept_lists = [], [], []
        stop_set = set(stop.tolist())
        for row, lp, k in zip(tokens.tolist(), logps.tolist(), kept.tolist()):
            end = next((j + 1 for j, t in enumerate(row) if t in stop_set), len(row))
            responses.append(row[:end])
            logprob_lists.append(lp[:end])
            kept_lists.append(k[:end])
        return first, copy, prefill_rows, (responses, logprob_lists, kept_lists)


def cache_keyword(model: Any) -> str:
    """The keyword a model's forward takes its KV cache by: ``cache`` where it has one (transformers 5.24 renamed
    ``past_key_values`` so, warns on the old name and drops it in 5.40), else ``past_key_values`` (5.17 to 5.19, the
    releases vLLM 0.32 and our GPU image hold)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
