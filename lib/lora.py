"""LoRA adapters on the policy (PEFT's modules and on-disk format), trained alone on a frozen base.

- Adapters are injected into the meta-device model before ``fully_shard`` (lib/fsdp.py): each targeted Linear becomes
  PEFT's LoRA Linear (``<module>.base_layer`` holds the base weight, ``lora_A``/``lora_B`` the adapter). The base is
  frozen (bf16 on GPU, no gradients, no optimizer state); the adapter is fp32. Nothing is ever merged into the
  trainer's weights.
- The reference (reference=base) is the same model with its adapters switched off (``adapters_off``): no second
  model.
- Sync (lib/sync.py): the base goes to the engine once (again only after a sleep that dropped it), then the adapter
  alone at every step, checked by the engine (``load_adapter``). ``merge``: the engine gets W + s*BA, computed in fp32
  as a temporary (``iter_merged``).
- Names. Trainer: ``model.layers.0.self_attn.q_proj.lora_A.default.weight``. HF (the engine's base):
  ``model.layers.0.self_attn.q_proj.weight``. Adapter files (PEFT, read by PeftModel and vLLM):
  ``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
from dataclasses import dataclass
from typing import Any, Iterator

import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor

from lib import models
from lib.models import hf_name
from lib.vision import VISION_MODULES, has_vision, is_vision_param
from lib.vision import problem as vision_problem

ADAPTER = "default"  # PEFT's name for the one adapter a model holds
PEFT_PREFIX = "base_model.model."
# ranks vLLM's max_lora_rank takes (vllm.config.lora.MaxLoRARanks, 0.25 .. 0.33)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
ALL_LINEAR = "all-linear"
VISION_EXCLUDED = f".*{VISION_MODULES.pattern}.*"
"""PEFT's ``exclude_modules`` on a vision-language model: LoRA trains the language model; the vision tower and its
merger stay as they are (PEFT matches the whole module name)."""


@dataclass
class Sync:
    """What the rollout engine is given of a LoRA policy (lib/sync.py): the adapter as a new version every step
    (checked to cover ``num_modules``), or, with ``merge``, merged weights; ``sleep_level`` between rollouts."""

    merge: bool
    sleep_level: int
    num_modules: int
    version: int = 0


def enabled(cfg: Any) -> bool:
    """``cfg``: an actor.lora section."""
    return cfg.rank > 0 or bool(cfg.adapter_path)


# ---- the PEFT config


ADAPTER_WEIGHTS = "adapter_model.safetensors"


def read_adapter_config(path: str) -> dict:
    """The adapter folder's adapter_config.json; ValueError naming the file and the fix where it is missing, is not
    JSON, or is no LoRA config (no rank ``r``)."""
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise ValueError(f"actor.lora.adapter_path={path!r} holds no adapter_config.json; point it at a PEFT adapter "
                         f"folder (adapter_config.json + {ADAPTER_WEIGHTS})")
    try:
        with open(file) as f:
            saved = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"actor.lora.adapter_path: {file} is not valid JSON ({e}); the file is cut short or "
                         f"damaged: save the adapter again (PeftModel.save_pretrained)") from None
    if not isinstance(saved, dict) or not isinstance(saved.get("r"), int) or saved["r"] < 1:
        raise ValueError(f"actor.lora.adapter_path: {file} has no LoRA rank (\"r\": a positive integer; found "
                         f"{saved.get('r') if isinstance(saved, dict) else type(saved).__name__!r}): not a PEFT LoRA "
                         f"adapter config; point actor.lora.adapter_path at a LoRA adapter saved by PEFT")
    return saved


def peft_config(cfg: Any) -> Any:
    """The PEFT LoraConfig of a run: from actor.lora, or from the starting adapter's own adapter_config.json."""
    from peft import LoraConfig  # deferred, as in inject

    if cfg.adapter_path:
        saved = read_adapter_config(cfg.adapter_path)
        return LoraConfig(r=saved["r"], lora_alpha=saved.get("lora_alpha", saved["r"]),
                          target_modules=saved.get("target_modules"), lora_dropout=saved.get("lora_dropout", 0.0),
                          use_rslora=saved.get("use_rslora", False), bias=saved.get("bias", "none"),
                          use_dora=saved.get("use_dora", False), modules_to_save=saved.get("modules_to_save"),
                          rank_pattern=saved.get("rank_pattern") or {}, alpha_pattern=saved.get("alpha_pattern") or {})
    targets = list(cfg.target_modules) if cfg.target_modules else ALL_LINEAR
    return LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=targets, lora_dropout=cfg.dropout,
                      use_rslora=cfg.use_rslora, bias="none")


def problems(cfg: Any, model_config: Any, engine: str) -> list[str]:
    """What a run with actor.lora ``cfg`` cannot do, each with its fix (lib.preflight.validate). ``engine``: the
    rollout.engine setting (vLLM's limits apply unless it is hf)."""
    out = []
    if cfg.rank < 0:
        out.append(f"actor.lora.rank={cfg.rank} must be >= 0 (0: no LoRA)")
    if cfg.dropout != 0:
        out.append(f"actor.lora.dropout={cfg.dropout}: dropout makes the trainer's log-probs those of a random "
                   f"sub-network, not of the policy that sampled; set actor.lora.dropout 0")
    if cfg.reference not in ("base", "init"):
        out.append(f"actor.lora.reference={cfg.reference!r}; use base or init")
    if cfg.reference == "init" and not cfg.adapter_path:
        out.append("actor.lora.reference=init is the starting adapter, frozen: set actor.lora.adapter_path, or use "
                   "reference base (a fresh adapter starts as the base)")
    if cfg.sleep_level not in (1, 2):
        out.append(f"actor.lora.sleep_level={cfg.sleep_level}; use 1 (the engine keeps the base) or 2 (the base is "
                   f"sent again every step)")
    if not enabled(cfg):
        return out + _set_while_off(cfg)
    if out:
        return out
    if not cfg.adapter_path and cfg.alpha <= 0:
        out.append(f"actor.lora.alpha={cfg.alpha:g} scales the adapter's output by {cfg.alpha:g} / rank: nothing "
                   f"could be learned; use alpha > 0 (e.g. 2 x rank)")
    if cfg.adapter_path:
        try:
            saved = read_adapter_config(cfg.adapter_path)
        except ValueError as e:
            return out + [str(e)]
        if not os.path.isfile(os.path.join(cfg.adapter_path, ADAPTER_WEIGHTS)):
            out.append(f"actor.lora.adapter_path={cfg.adapter_path!r} holds no {ADAPTER_WEIGHTS}: the adapter's "
                       f"weights are missing; save the adapter again (PeftModel.save_pretrained), or leave "
                       f"adapter_path empty for a fresh adapter")
        if saved.get("lora_alpha", saved["r"]) <= 0:
            out.append(f"the adapter at {cfg.adapter_path} has lora_alpha {saved.get('lora_alpha')}: its output is "
                       f"scaled by 0 or less, so nothing could be learned; set lora_alpha > 0 in its "
                       f"adapter_config.json")
        if cfg.rank and cfg.rank != saved.get("r"):
            out.append(f"actor.lora.rank={cfg.rank} but the adapter at {cfg.adapter_path} has rank {saved.get('r')}; "
                       f"leave actor.lora.rank 0 (the adapter's own) or start a fresh adapter")
        if saved.get("lora_dropout", 0.0):
            out.append(f"the adapter at {cfg.adapter_path} has lora_dropout {saved['lora_dropout']}: its log-probs in "
                       f"training would not be the sampling policy's; set lora_dropout 0 in its adapter_config.json")
    pc = peft_config(cfg)
    serve = "vLLM's LoRA cannot serve it" if engine != "hf" else "the engines sync plain LoRA only"
    if pc.use_dora:
        out.append(f"the adapter uses DoRA: {serve}; train a plain LoRA adapter (use_dora false)")
    if pc.bias != "none":
        out.append(f"the adapter trains biases (bias={pc.bias!r}): {serve}; use bias none")
    if pc.modules_to_save:
        out.append(f"the adapter has modules_to_save {pc.modules_to_save}: {serve}; drop them")
    if pc.rank_pattern or pc.alpha_pattern:
        out.append("the adapter has per-module ranks or alphas (rank_pattern / alpha_pattern): one rank and alpha "
                   "for every module is what the sync checks; retrain with a single rank")
    if engine != "hf" and not cfg.merge and pc.r > VLLM_LORA_RANKS[-1]:
        out.append(f"LoRA rank {pc.r} is above vLLM's maximum {VLLM_LORA_RANKS[-1]}; lower actor.lora.rank, set "
                   f"actor.lora.merge (the engine gets merged weights), or use rollout.engine=hf")
    if model_config is not None:
        try:
            names = target_names(model_config, pc)
        except ValueError as e:
            out.append(str(e) if str(e).startswith("actor.lora") else f"actor.lora: {e}")
        else:
            bad = [n for n in names if not _is_decoder_linear(n)]
            if bad:
                out.append(f"LoRA on {bad[:3]}: embedding and lm_head adapters are not served by vLLM and break tied "
                           f"embeddings; target the decoder's linear layers only (actor.lora.target_modules)")
    return out


def _set_while_off(cfg: Any) -> list[str]:
    """LoRA settings given while LoRA is off (rank 0, no adapter_path): the full model would train where the user
    asked for an adapter, with nothing said (issue 59). One message naming them."""
    default = type(cfg)()
    names = ("target_modules", "alpha", "use_rslora", "merge", "sleep_level")
    given = [f"{name}={getattr(cfg, name)!r}" for name in names if getattr(cfg, name) != getattr(default, name)]
    if not given:
        return []
    return [f"actor.lora.{', actor.lora.'.join(given)} set, but LoRA is off (actor.lora.rank 0 and no "
            f"actor.lora.adapter_path): the full model would train; set actor.lora.rank (e.g. 8) for an adapter, or "
            f"leave those settings out"]


def _is_decoder_linear(name: str) -> bool:
    leaf = name.rsplit(".", 1)[-1]
    return leaf not in ("lm_head", "embed_tokens", "wte", "embed_in", "embed_out")


def target_names(model_config: Any, pc: Any) -> list[str]:
    """The module names the adapter wraps, resolved on a meta-device model (no memory)."""
    kind = "vision_lm" if has_vision(model_config) and not vision_problem(model_config) else "causal_lm"
    model = models.build_empty(model_config, kind, "sdpa")
    try:
        inject(model, pc)
    except ValueError as e:
        raise ValueError(f"actor.lora.target_modules: {e}; name the model's linear layers (e.g. q_proj, v_proj) or "
                         f"leave it empty for every linear layer of the decoder") from None
    return [n for n, _ in lora_layers(model)]


# ---- the adapter on a model


def inject(model: nn.Module, pc: Any) -> nn.Module:
    """Wrap the targeted Linear layers of ``model`` in place (on any device; on meta nothing is allocated). Only the
    adapter requires grad. A fresh adapter is PEFT's default init: A Kaiming-uniform, B zero (the base's outputs).
    A vision-language model's vision tower gets none (``VISION_EXCLUDED``)."""
    from peft import inject_adapter_in_model  # deferred: peft is heavy to import and only LoRA runs use it

    pc = copy.deepcopy(pc)
    if any(is_vision_param(name + ".") for name, _ in model.named_modules()):
        pc.exclude_modules = VISION_EXCLUDED
    inject_adapter_in_model(pc, model, adapter_name=ADAPTER)
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_param(name))
    return model


def is_adapter_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    from peft.tuners.lora import LoraLayer  # deferred, as in inject

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def has_lora(model: nn.Module) -> bool:
    return bool(lora_layers(model))


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its base: every LoRA layer skips its adapter. Only PEFT's flag is flipped (its own
    ``enable_adapters`` would also change requires_grad, which FSDP2 fixed at its first forward)."""
    layers = [m for _, m in lora_layers(model)]
    before = [m._disable_adapters for m in layers]
    for m in layers:
        m._disable_adapters = True
    try:
        yield
    finally:
        for m, b in zip(layers, before):
            m._disable_adapters = b


def cast_frozen(model: nn.Module, dtype: torch.dtype) -> None:
    """The frozen base in ``dtype`` (bf16 on GPU: no fp32 master copy is needed for weights never stepped). A
    parameter held by several modules (tied embeddings: the input embedding and lm_head) is cast once and the one
    new parameter goes in every slot, so the tie holds (a new parameter per slot made lm_head a matrix of its own,
    which the sync then sent apart; found on the first GPU run)."""
    cast: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for key, param in list(module._parameters.items()):
            if param is not None and not param.requires_grad and param.dtype != dtype:
                if id(param) not in cast:
                    cast[id(param)] = nn.Parameter(param.to(dtype), requires_grad=False)
                module._parameters[key] = cast[id(param)]


def load_adapter_weights(model: nn.Module, path: str) -> None:
    """Fill a full (unsharded) model's adapter from a PEFT folder; every adapter tensor must be there."""
    file = os.path.join(path, ADAPTER_WEIGHTS)
    if not os.path.isfile(file):
        raise ValueError(f"actor.lora.adapter_path={path!r} holds no {ADAPTER_WEIGHTS}")
    set_adapter(model, load_file(file), f"the adapter at {path}")


def set_adapter(model: nn.Module, tensors: dict[str, torch.Tensor], what: str = "the adapter") -> None:
    """Copy ``tensors`` (PEFT names) into a full model's LoRA layers; every one of them must be given."""
    params = dict(model.named_parameters())
    wanted = {peft_name(n): n for n in params if is_adapter_param(n)}
    missing = sorted(set(wanted) - set(tensors))
    if missing:
        raise ValueError(f"{what} lacks {len(missing)} of the model's LoRA tensors ({missing[:3]}): it was trained "
                         f"for other modules or another model")
    with torch.no_grad():
        for key, name in wanted.items():
            params[name].copy_(tensors[key])


# ---- names


def base_name(name: str) -> str:
    """Trainer name of a base parameter -> its HF name."""
    return hf_name(name).replace(".base_layer.", ".")


def peft_name(name: str) -> str:
    """Trainer name of an adapter parameter -> its name in PEFT's adapter file."""
    name = hf_name(name).replace(f".lora_A.{ADAPTER}.", ".lora_A.").replace(f".lora_B.{ADAPTER}.", ".lora_B.")
    return PEFT_PREFIX + name


# ---- full tensors (every rank in step: a DTensor's full_tensor is an all-gather)


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


def _modules_and_params(model: nn.Module) -> Iterator[tuple[str, Any]]:
    """Each LoRA layer once (its name, the module) at its first parameter, and every parameter outside LoRA layers
    (its name, the parameter), in registration order."""
    layers = dict(lora_layers(model))
    done: set[str] = set()
    for name, param in model.named_parameters():
        owner = next((n for n in (name.split(".base_layer.")[0], name.split(".lora_A.")[0], name.split(".lora_B.")[0])
                      if n != name and n in layers), None)
        if owner is None:
            yield name, param
        elif owner not in done:
            done.add(owner)
            yield owner, layers[owner]


@torch.no_grad()
def iter_base(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor in ``dtype``) of every base parameter: what the engine holds under the adapter."""
    for name, item in _modules_and_params(model):
        params = item.base_layer.named_parameters() if isinstance(item, nn.Module) else [("", item)]
        for sub, param in params:
            t = param.detach()
            t = t.to(dtype) if dtype is not None else t
            yield base_name(f"{name}.{sub}" if sub else name), _full(t)


@torch.no_grad()
def iter_adapter(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(PEFT name, full fp32 tensor) of every adapter parameter."""
    for name, param in model.named_parameters():
        if is_adapter_param(name):
            yield peft_name(name), _full(param.detach().float())


@torch.no_grad()
def iter_merged(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of a model with its adapter merged: W + s * B @ A computed in fp32 as a temporary and
    cast to ``dtype``; the trainer's own weights are never written."""
    for name, item in _modules_and_params(model):
        if not isinstance(item, nn.Module):
            t = item.detach()
            yield base_name(name), _full(t.to(dtype) if dtype is not None else t)
            continue
        weight = _full(item.base_layer.weight.detach()).float()
        a = _full(item.lora_A[ADAPTER].weight.detach()).float()
        b = _full(item.lora_B[ADAPTER].weight.detach()).float()
        merged = torch.addmm(weight, b, a, alpha=item.scaling[ADAPTER])
        yield base_name(f"{name}.weight"), merged.to(dtype or weight.dtype)
        del weight, merged
        if item.base_layer.bias is not None:
            t = item.base_layer.bias.detach()
            yield base_name(f"{name}.bias"), _full(t.to(dtype) if dtype is not None else t)


def check_engine_load(asleep: bool, served: Any, version: int, tensors: dict) -> None:
    """What every engine's ``load_adapter`` refuses: a sleeping engine, one built without LoRA (``served`` None), and
    a sync that delivers no tensor."""
    if asleep:
        raise RuntimeError("load_adapter on a sleeping engine: call wake_up() first")
    if served is None:
        raise RuntimeError("load_adapter on an engine built without LoRA (pass lora=...)")
    if not tensors:
        raise RuntimeError(f"the adapter sync of version {version} delivered no tensors")


def num_modules(model: nn.Module) -> int:
    return len(lora_layers(model))


def base_hash(weights: Iterator[tuple[str, torch.Tensor]]) -> str:
    """A digest of the base weights (names, shapes, dtypes, bytes): a resume onto another base is refused."""
    h = hashlib.blake2b(digest_size=16)
    for name, t in weights:
        t = t.detach().contiguous().cpu()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype};".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


# ---- PEFT folders


def save_adapter(out_dir: str, tensors: dict[str, torch.Tensor], pc: Any, base_model_path: str = "",
                 vision: bool = False) -> None:
    """A PEFT adapter folder (adapter_config.json + adapter_model.safetensors) that ``PeftModel.from_pretrained`` and
    vLLM's ``LoRARequest`` load. ``target_modules`` is written as the layers' short names; ``vision`` (the base is a
    vision-language model): with ``VISION_EXCLUDED``, so that a vision tower's layers of those names stay bare."""
    if not tensors:
        raise RuntimeError("an adapter with no tensors: the model holds no LoRA layer")
    pc = copy.deepcopy(pc)
    pc.target_modules = sorted({k[len(PEFT_PREFIX):].split(".lora_")[0].rsplit(".", 1)[-1] for k in tensors})
    pc.base_model_name_or_path = base_model_path
    if vision:
        pc.exclude_modules = VISION_EXCLUDED
    pc.inference_mode = True
    os.makedirs(out_dir, exist_ok=True)
    pc.save_pretrained(out_dir)
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
              os.path.join(out_dir, ADAPTER_WEIGHTS))
