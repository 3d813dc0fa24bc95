"""Vision-language models: which ones train with images, and what the trainer needs to know of each.

A vision-language checkpoint is recognised by its config (a ``vision_config``). The families listed in FAMILIES train
with their images; another vision model is refused at start-up with the list. Two kinds:

- Qwen-VL (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Qwen3.5): images of any size, each ``t x h x w`` patches merged into
  ``t * h * w / merge^2`` tokens, positioned by the 3-D rope rule (lib/vision/rope.py); attention stays causal.
- Gemma-3: every image resized to the tower's fixed size and pooled to ``mm_tokens_per_image`` tokens between its
  begin and end tokens; positions stay 1-D; an image's tokens attend to each other both ways in every layer (the
  model builds that mask from ``token_type_ids``; the packed attention from the image blocks, lib/attention.py).
- Gemma-4: every image resized, aspect kept, within a patch budget, its patches pooled k x k into tokens between its
  begin and end tokens; positions stay 1-D; with ``use_bidirectional_attention="vision"`` (the larger checkpoints)
  an image's tokens attend to each other both ways in the sliding-window layers only (``mm_token_type_ids``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Family:
    """What the trainer needs to know of a vision-language family."""

    placeholder: str
    """The token the chat template renders once per image (the prompt vLLM gets), which the processor expands."""
    type_ids: str = ""
    """The model argument marking image tokens (1) among text (0), from which it makes an image's tokens attend to
    each other both ways ("" for a causal model)."""
    two_way: str = ""
    """The layers where an image's tokens attend to each other both ways: "all", "sliding" (the sliding-window
    layers), or "" (none: causal)."""
    expansion: str = "repeat"
    """How the processor expands a placeholder: "repeat" (the placeholder, once per image token), "text" (Gemma-3:
    replaced in the prompt's text, which is tokenized again), "bracket" (Gemma-4: the begin token, the image token
    once per image token, the end token)."""

    @property
    def rope(self) -> bool:
        """Qwen-VL's 3-D rope rows (lib/vision/rope.py) travel beside the text positions; else positions are 1-D."""
        return self.expansion == "repeat"


QWEN_VL = Family("<|image_pad|>")
FAMILIES: dict[str, Family] = {
    **{name: QWEN_VL for name in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_5", "qwen3_5_moe")},
    "gemma3": Family("<start_of_image>", type_ids="token_type_ids", two_way="all", expansion="text"),
    "gemma4": Family("<|image|>", type_ids="mm_token_type_ids", two_way="sliding", expansion="bracket"),
}
"""Model type -> its Family."""


def family(config: Any) -> Family:
    return FAMILIES[config.model_type]


def two_way(config: Any) -> str:
    """Where this model's image tokens attend to each other both ways (``Family.two_way``): Gemma-4 only with
    ``use_bidirectional_attention="vision"`` (its smaller checkpoints stay causal)."""
    if config.model_type not in FAMILIES:
        return ""
    mode = FAMILIES[config.model_type].two_way
    if mode == "sliding" and getattr(config.get_text_config(), "use_bidirectional_attention", None) != "vision":
        return ""
    return mode


def type_ids(config: Any, input_ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """The model argument that marks image tokens, for a family whose image tokens attend both ways ({} otherwise):
    what its own forward takes to build that mask."""
    name = FAMILIES[config.model_type].type_ids if two_way(config) else ""
    return {name: (input_ids == config.image_token_id).long()} if name else {}


def has_vision(config: Any) -> bool:
    """Whether the checkpoint carries a vision tower."""
    return getattr(config, "vision_config", None) is not None


def problem(config: Any) -> str:
    """Why images cannot be trained with this model, which has a vision tower ("" if they can)."""
    if getattr(config, "model_type", "") not in FAMILIES:
        return (f"vision-language training supports {sorted(FAMILIES)}; this model is a "
                f"{getattr(config, 'model_type', '?')}")
    return ""


def vllm_problem() -> str:
    """Why vLLM cannot roll out image prompts on this machine ("" if it can). vLLM's Qwen-VL model code imports
    transformers' torchvision image processor, so torchvision must import beside this torch (PyPI's torchvision for
    torch 2.13 is a CUDA build, which fails to import beside the CPU torch)."""
    try:
        import torchvision  # noqa: F401  (deferred: only vLLM with images needs it, and a broken build raises here)
    except Exception as e:  # noqa: BLE001 - ImportError, or RuntimeError from a build for another torch
        return (f"the vLLM engine with image prompts needs torchvision (vLLM's Qwen-VL model code imports "
                f"transformers' torchvision image processor), which cannot be imported here ({type(e).__name__}: "
                f"{str(e)[:120]}); install the torchvision built for torch {torch.__version__}, or set "
                f"--rollout.engine hf")
    return ""


VISION_MODULES = re.compile(r"(^|\.)(visual|vision_tower|vision_model|multi_modal_projector|embed_vision)\.")


def is_vision_param(name: str) -> bool:
    """A parameter of the vision tower or its merger / projector (Qwen-VL: ``model.visual.*``; Gemma-3:
    ``model.vision_tower.*``, ``model.multi_modal_projector.*``; Gemma-4: ``model.vision_tower.*``,
    ``model.embed_vision.*``)."""
    return VISION_MODULES.search(name) is not None


BANNED_ATTR = "banned_token_ids"
"""The attribute of a trained model listing the token ids it never samples (``placeholder_ids``): set where the model
is built (lib.fsdp.build_sharded_model), read by its forward (lib.forward)."""

BANNED_LOGIT = -1e9
"""The logit a placeholder token gets: its probability is 0 in fp32 and bf16, and at any temperature the scaled value
stays finite (so the entropy's p * log p is 0, not nan)."""


def placeholder_ids(config: Any) -> list[int]:
    """The ids that stand for image (and video) features. A response must never hold one: the model's forward
    would take it for an image slot. The engines never sample them and the trainer's log-probs are of the same
    distribution (their logits set to BANNED_LOGIT on both sides)."""
    return sorted({int(i) for key in ("image_token_id", "video_token_id")
                   if (i := getattr(config, key, None)) is not None})


def ban(logits: torch.Tensor, ids: list[int] | None) -> torch.Tensor:
    """``logits`` (..., V) with the columns ``ids`` set to BANNED_LOGIT (a new tensor; the input unchanged)."""
    if not ids:
        return logits
    return logits.index_fill(-1, torch.tensor(ids, device=logits.device), BANNED_LOGIT)


def merge_size(config: Any) -> int:
    """Patches merged per side into one language-model token (Qwen-VL)."""
    return int(config.vision_config.spatial_merge_size)


def num_images(features: dict[str, torch.Tensor]) -> int:
    """Images in one row's features (Qwen-VL: one grid row each; Gemma: one pixel tensor each)."""
    return len(features["image_grid_thw"]) if "image_grid_thw" in features else len(features["pixel_values"])


def attn_implementations(config: Any, text: str, vision: str = "sdpa") -> dict[str, str]:
    """``attn_implementation`` per sub-config: the decoder's (packed or padded) for the language model, sdpa for the
    vision tower (which bounds its own images through ``cu_seqlens``)."""
    names = {key: vision if key == "vision_config" else text for key, value in vars(config).items()
             if hasattr(value, "model_type") and hasattr(value, "to_dict")}
    return {"": text, **names}


def batch_metrics(images: Any, input_ids: torch.Tensor, image_token_id: int) -> dict[str, float]:
    """Images per sample and image tokens per sample of a rollout batch (``images``: per row, its features or None)."""
    counts = [num_images(f) if f else 0 for f in images]
    tokens = (input_ids == image_token_id).sum(1).float()
    return {"vision/images_per_sample": sum(counts) / max(len(counts), 1),
            "vision/image_tokens_mean": float(tokens.mean()) if tokens.numel() else 0.0}


def blank_image(config: Any, device: Any = None) -> dict[str, torch.Tensor]:
    """The features of the smallest image the vision tower takes (Qwen-VL: one merged token, merge x merge black
    patches; Gemma-3: one black image of the tower's size; Gemma-4: one token's patches): what a micro-batch without images runs through the tower
    so that every rank runs it (lib.forward)."""
    vc = config.vision_config
    expansion = family(config).expansion
    if expansion == "bracket":  # Gemma-4: one token, its k x k patches (x, y), no padding
        k = vc.pooling_kernel_size
        grid = torch.stack(torch.meshgrid(torch.arange(k), torch.arange(k), indexing="xy"), -1).reshape(1, k * k, 2)
        return {"pixel_values": torch.zeros(1, k * k, 3 * vc.patch_size ** 2, device=device),
                "image_position_ids": grid.to(device)}
    if expansion == "text":  # Gemma-3: one image of the tower's fixed size
        return {"pixel_values": torch.zeros(1, vc.num_channels, vc.image_size, vc.image_size, device=device)}
    merge = merge_size(config)
    temporal = vc.temporal_patch_size if isinstance(vc.temporal_patch_size, int) else vc.temporal_patch_size[0]
    patch = vc.in_channels * temporal * vc.patch_size ** 2
    return {"pixel_values": torch.zeros(merge * merge, patch, device=device),
            "image_grid_thw": torch.tensor([[1, merge, merge]], device=device)}


def concat_features(rows: Any, device: Any = None) -> dict:
    """The image features of several rows (each a dict of ``pixel_values``, with Qwen-VL ``image_grid_thw``, or None),
    in row order, as one model call takes them; empty when no row has images."""
    rows = [] if rows is None else [r for r in rows if r]
    if not rows:
        return {}
    return {key: torch.cat([r[key] for r in rows]).to(device) for key in rows[0]}
