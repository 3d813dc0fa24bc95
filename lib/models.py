"""Hugging Face model and tokenizer loading: causal LM (policy, reference) and critic (scalar value head).

Models are built on the meta device on every rank; only rank 0 reads weights from disk, and lib/fsdp.py
broadcasts them into the shards, so a node holds one CPU copy of the weights, not one per rank.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import logging
import os
import re
from typing import Any, Iterator

import torch
from torch import nn
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText,
                          AutoModelForTokenClassification, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast)

from lib import attention, mixers
from lib.vision import attn_implementations, has_vision

log = logging.getLogger(__name__)

KINDS = ("causal_lm", "critic", "vision_lm")
"""vision_lm: a vision-language model trained with its images (lib/vision); its language model alone is a causal_lm."""


UNFUSED_HEAD_ATTR = "_rl_unfused_head"
"""Set on a model (lib.fsdp, from model.fused_head off) whose forwards make the whole logits tensor (lib.forward)."""


def attn_implementation(requested: str = "auto", packed: bool = False, sp_size: int = 1, config: Any = None) -> str:
    """The attention a trained model is built with. Packed rows go through lib/attention.py (varlen kernels: torch's
    own or flash-attn on CUDA; one padded causal sdpa elsewhere, or exact math where the model's attention has a
    feature sdpa lacks); padded rows use what ``padded_attention`` picks for ``config``."""

    if sp_size > 1 or (packed and requested == "auto"):
        return attention.register()
    if requested != "auto":
        if requested == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
            raise ValueError("attn_implementation=flash_attention_2 but flash_attn is not installed; "
                             "pip install -e '.[flash-attn]' or use attn_implementation=auto")
        return requested
    return padded_attention(config)


def padded_attention(config: Any = None, requested: str = "auto") -> str:
    """The attention for padded rows (the HF engine, the padded trainer path): ``requested`` unless auto or the
    packed-only implementation; else sdpa where the model class takes it, eager where it does not (Gemma-2's
    soft-capping, GPT-OSS's sinks: transformers refuses sdpa for those)."""

    if requested not in ("auto", attention.NAME):
        return requested
    if config is None:
        return "sdpa"
    mapping = AutoModelForCausalLM._model_mapping
    cls = mapping[type(config)] if type(config) in mapping else None
    return "sdpa" if cls is None or getattr(cls, "_supports_sdpa", True) else "eager"


def check_model_path(path: str, setting: str = "actor.model.path") -> None:
    """Fail early (before any weights load) with a message that names the fix; ``setting``: the config key that
    named the path."""
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            if os.path.exists(os.path.join(path, "adapter_config.json")):
                raise ValueError(f"{setting}={path!r} is a LoRA adapter folder (adapter_config.json), not a model: "
                                 f"point --{setting} at its base model and --actor.lora.adapter_path at the adapter")
            raise ValueError(f"model path {path!r} has no config.json; point --{setting} at a Hugging Face "
                             f"model folder (config.json + *.safetensors)")
        return
    if os.path.exists(path):
        raise ValueError(f"model path {path!r} is a file; point it at the model's folder")
    if os.environ.get("HF_HUB_OFFLINE") == "1" or path.startswith(("/", ".", "~")):
        raise ValueError(f"model path {path!r} does not exist; check the path (hub downloads are off or it "
                         f"looks like a local path)")


def saved_dtype(config: Any) -> torch.dtype:
    """The dtype a checkpoint's config says its weights are in (fp32 where it says none)."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    return getattr(torch, dtype) if isinstance(dtype, str) else dtype


def load_config(path: str, trust_remote_code: bool = False, setting: str = "actor.model.path") -> Any:
    check_model_path(path, setting)
    return AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)


def load_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    """The model's tokenizer; a missing pad token is set to eos (with a warning), left padding for prompts."""
    tok = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    tok = _as_saved(tok, path)
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise ValueError(f"tokenizer at {path!r} has neither a pad nor an eos token; add one to its "
                             f"tokenizer_config.json")
        log.warning("tokenizer at %s has no pad token; using eos (%r) as pad", path, tok.eos_token)
        tok.pad_token = tok.eos_token
    tok.padding_side = "left"
    return tok


def _as_saved(tok: Any, path: str) -> Any:
    """The tokenizer as its tokenizer.json defines it. transformers 5 builds the class its config.json's model type
    maps to (Qwen2Tokenizer for any qwen2 model) and that class puts its own pre-tokenizer and normaliser in place of
    the file's: a character-level tokenizer saved beside a Qwen2 model then silently drops newlines and spaces.
    Where the pipelines differ, the file's wins (loaded without the model-type class)."""
    file = os.path.join(path, "tokenizer.json")
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is None or not os.path.isfile(file):
        return tok
    with open(file, encoding="utf-8") as f:
        saved = json.load(f)
    loaded = json.loads(backend.to_str())
    if all(saved.get(k) == loaded.get(k) for k in ("pre_tokenizer", "normalizer")):
        return tok
    log.warning("tokenizer at %s: %s replaces the pre-tokenizer or normaliser of its tokenizer.json; loading the "
                "file's own", path, type(tok).__name__)
    return PreTrainedTokenizerFast.from_pretrained(path)


def _auto_class(kind: str) -> Any:
    if kind == "causal_lm":
        return AutoModelForCausalLM
    if kind == "critic":
        # Qwen2/Qwen3/Llama ...ForTokenClassification: the base model + a Linear(hidden, 1) "score" head
        return AutoModelForTokenClassification
    if kind == "vision_lm":
        return AutoModelForImageTextToText
    raise ValueError(f"model kind must be one of {KINDS}, got {kind!r}")


def _model_config(config: Any, kind: str) -> Any:
    """The config to build ``kind`` from: a critic gets one label (the value) and no dropout on its head
    (transformers' default for the generic head is 0.1, which would make values noisy in train mode)."""
    if kind != "critic":
        return config
    config = copy.deepcopy(config)
    config.num_labels = 1
    config.classifier_dropout = 0.0
    return config


def without_dropout(config: Any) -> tuple[Any, list[str]]:
    """A copy of ``config`` with every training-only noise set to 0, and the settings changed (``name=rate``): the
    dropout rates, and the routers' jitter of mixture-of-experts models (Mixtral's and PhiMoE's router_jitter_noise,
    PhiMoE's input_jitter_noise: noise on the router's input in training mode, which vLLM never applies; with 0.2 the
    canary read ~8e-3, replay on or off). The engine samples without them, so the trainer's log-probs of those
    samples (and its update) must not have them either. Text and vision sub-configs included."""
    config = copy.deepcopy(config)
    changed: list[str] = []

    def visit(cfg: Any, prefix: str) -> None:
        for key, value in list(vars(cfg).items()):
            if hasattr(value, "to_dict") and hasattr(value, "model_type"):  # a sub-config
                visit(value, f"{prefix}{key}.")
            elif ("dropout" in key or key.endswith("pdrop") or "jitter" in key) and isinstance(value, (int, float)) \
                    and not isinstance(value, bool) and value > 0:
                setattr(cfg, key, 0.0)
                changed.append(f"{prefix}{key}={value}")

    visit(config, "")
    return config, changed


def _attn(config: Any, kind: str, attn_impl: str) -> Any:
    """A vision-language model takes one implementation per sub-config (its vision tower keeps sdpa)."""
    return attn_implementations(config, attn_impl) if kind == "vision_lm" else attn_impl


def build_empty(config: Any, kind: str, attn_impl: str, trust_remote_code: bool = False) -> nn.Module:
    """The model on the meta device (no memory), ready for fully_shard + to_empty + broadcast."""
    cls = _auto_class(kind)
    attn_impl = _attn(config, kind, attn_impl)
    try:
        with torch.device("meta"):
            model = cls.from_config(_model_config(config, kind), attn_implementation=attn_impl,
                                    trust_remote_code=trust_remote_code, dtype=torch.float32)
    except ValueError as e:
        if "Unrecognized configuration class" not in str(e):
            raise
        hint = (": a vision-language model whose language model has no class of its own trains with image prompts "
                "(an images column in the data; lib/vision)") if has_vision(config) else ""
        raise ValueError(f"transformers builds no {cls.__name__} for a {config.model_type} model{hint}") from None
    mixers.bound(model)  # linear attention, convolutions, Mamba: packed rows keep to their sequences there too
    return model


def load_full(path: str, kind: str, attn_impl: str, trust_remote_code: bool = False, config: Any = None) -> nn.Module:
    """The model with its weights on CPU in float32 (rank 0 only), built from ``config`` (default: the model's
    own). A critic built from a causal LM checkpoint gets a freshly initialised value head (transformers warns
    about it)."""
    cls = _auto_class(kind)
    config = _model_config(config if config is not None else load_config(path, trust_remote_code), kind)
    return cls.from_pretrained(path, config=config, attn_implementation=_attn(config, kind, attn_impl),
                               trust_remote_code=trust_remote_code, dtype=torch.float32)


def tied_aliases(model: nn.Module) -> dict[str, str]:
    """Parameters registered under two names (tied embeddings: ``lm_head.weight`` is ``model.embed_tokens.weight``):
    alias -> the name ``named_parameters()`` lists. Read it right after building, since moving the model to or from
    the meta device (``to("meta")``, ``to_empty``) gives every name a tensor of its own."""
    first: dict[int, str] = {}
    aliases = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        if id(param) in first:
            aliases[name] = first[id(param)]
        else:
            first[id(param)] = name
    return aliases


def retie(model: nn.Module, aliases: dict[str, str]) -> None:
    """Make each alias the very tensor of its target again (after ``to_empty``/``to("meta")`` untied them)."""
    params = dict(model.named_parameters(remove_duplicate=False))
    for alias, target in aliases.items():
        if params[alias] is not params[target]:
            module, _, attr = alias.rpartition(".")
            setattr(model.get_submodule(module), attr, params[target])


def stop_token_ids(path: str, tokenizer: Any, trust_remote_code: bool = False) -> list[int]:
    """The ids that end a response: the tokenizer's eos and every eos id of the model's generation_config.json
    (Qwen2.5-Instruct lists <|im_end|> and <|endoftext|>; Llama-3.x-Instruct ends a turn with <|eot_id|>), as
    transformers' generate and vLLM stop on them."""
    ids = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    try:
        eos = GenerationConfig.from_pretrained(path, trust_remote_code=trust_remote_code).eos_token_id
    except OSError:  # no generation_config.json: the model config's eos
        eos = getattr(load_config(path, trust_remote_code), "eos_token_id", None)
    ids += [eos] if isinstance(eos, int) else list(eos or [])
    return sorted(set(ids))


_WRAPPER_PARTS = re.compile(r"(_checkpoint_wrapped_module\.|_fsdp_wrapped_module\.|_orig_mod\.)")


@functools.lru_cache(maxsize=None)  # a sync asks it of every tensor (a model has a few hundred names)
def hf_name(name: str) -> str:
    """A parameter's Hugging Face name, without the wrappers' parts (activation checkpointing, FSDP1,
    torch.compile) that a wrapped model's ``named_parameters`` puts in it."""
    return _WRAPPER_PARTS.sub("", name)


def persistent_buffers(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, buffer) of every persistent buffer: the weights of a model that are not parameters (Gemma-4's
    per-layer ``layer_scalar``; the MoE router's ``e_score_correction_bias`` in DeepSeek-V3 and GLM-4.5, which
    decides the experts a token reaches). They are in the checkpoint and in ``state_dict()``; the engine and the
    export need their trained values, not the ones ``__init__`` computes. Non-persistent buffers (rotary
    ``inv_freq``) are derived from the config and stay out."""
    for module_name, module in model.named_modules():
        for name, buf in module._buffers.items():  # its own (named_buffers(recurse=False) costs ~4 us a layer)
            if buf is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buf


def check_not_meta(model: nn.Module) -> None:
    bad = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
    if bad:
        raise RuntimeError(f"tensors still on the meta device after loading: {bad[:5]}")
